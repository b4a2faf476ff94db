"""megatron.core.optimizer: ``OptimizerConfig`` and ``get_megatron_optimizer`` over torch.optim.

``get_megatron_optimizer(config, model_chunks)`` builds ``torch.optim.AdamW`` (or ``Adam``
without decoupled weight decay, or ``SGD``) over the chunks' parameters in two groups (weight
decay multiplier 1, and 0 for biases and 1-D parameters, as megatron-core does), fused
kernels when every parameter is on a CUDA device, foreach kernels on other accelerators,
plain loops on CPU. It wraps it in ``FP32Optimizer`` (fp32 parameters),
``Float16OptimizerWithFloat16Params`` (bf16/fp16 parameters, fp32 main copies) or, with
``use_distributed_optimizer``, ``DistributedOptimizer`` (fp32 main parameters and state for
this rank's shard only; ``distrib_optimizer``) and returns a ``ChainedOptimizer`` of that one
optimizer, as megatron-core 0.16.1 does.
"""

from typing import Any, Dict, List, Optional

import torch

from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
    init_optimizer_state,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig, unsupported_settings
from megatron.core.utils import get_model_config

__all__ = [
    "OptimizerConfig",
    "get_megatron_optimizer",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "ChainedOptimizer",
    "DistributedOptimizer",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "get_grad_norm_fp32",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
]


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: List[torch.nn.Module],
    config_overrides: Optional[Dict[Any, Any]] = None,
    use_gloo_process_groups: bool = True,
    pg_collection: Optional[Any] = None,
    dump_param_to_param_group_map: Optional[str] = None,
) -> MegatronOptimizer:
    """The Megatron optimizer for ``model_chunks`` (see the module docstring).

    Groups: ``pg_collection.mp`` (norms, zero counts) and ``pg_collection.tp`` (which copy of
    a TP-replicated parameter counts); without ``pg_collection`` the MPU fallback
    (``parallel_state``) is read at step time. ``config_overrides`` other than None/{} and
    ``dump_param_to_param_group_map`` are not supported (clear error).
    """
    bad = unsupported_settings(config)
    if bad:
        name, value, expected = bad[0]
        raise NotImplementedError(
            f"OptimizerConfig.{name}={value!r} is not supported here; expected {expected!r}"
        )
    if config_overrides:
        raise NotImplementedError(
            f"config_overrides={config_overrides!r}: per-parameter overrides are not supported; "
            "expected None (megatron's default: no weight decay on biases and 1-D params) or {}"
        )
    if dump_param_to_param_group_map is not None:
        raise NotImplementedError("dump_param_to_param_group_map is not supported; expected None")
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr=None; expected a learning rate")
    if not model_chunks:
        raise ValueError("model_chunks is empty; expected at least one model chunk")
    if pg_collection is not None:
        for field in ("mp", "tp"):
            if getattr(pg_collection, field, None) is None:
                raise ValueError(
                    f"pg_collection.{field} is None; get_megatron_optimizer needs the "
                    "model-parallel (mp) and tensor-parallel (tp) groups"
                )

    _check_distributed_optimizer_settings(config, model_chunks)

    param_groups = _get_param_groups(model_chunks, config, config_overrides)
    params = [p for g in param_groups for p in g["params"]]
    if not params:
        raise ValueError("model_chunks have no trainable parameters")
    optimizer = _build_torch_optimizer(param_groups, config, params)

    if not (config.fp16 or config.bf16):
        for p in params:
            if p.dtype != torch.float32:
                raise TypeError(
                    f"a parameter has dtype {p.dtype} but bf16=fp16=False; expected float32 "
                    "parameters (set bf16/fp16 in OptimizerConfig for half precision)"
                )
    grad_scaler = _grad_scaler(config, params[0].device)
    if config.use_distributed_optimizer:
        inner: MegatronOptimizer = DistributedOptimizer(
            optimizer,
            config,
            grad_scaler,
            init_optimizer_state,
            model_chunks=model_chunks,
            data_parallel_group=None if pg_collection is None else pg_collection.dp_cp,
        )
    elif config.fp16 or config.bf16:
        inner = Float16OptimizerWithFloat16Params(
            optimizer, config, grad_scaler, init_optimizer_state
        )
    else:
        inner = FP32Optimizer(optimizer, config, init_optimizer_state)
    if pg_collection is not None:
        inner.grad_stats_parallel_group = pg_collection.mp
        inner.tp_group = pg_collection.tp
    if any(_has_experts(chunk) for chunk in model_chunks):
        # expert gradients: their own norm part, over expert tp x ep x pp (MPU fallback)
        inner.has_expert_params = True
        if pg_collection is not None:
            inner.expert_grad_stats_parallel_group = pg_collection.tp_ep_pp
            # the distributed optimizer's expert shards: over expert DP
            inner.expert_data_parallel_group = pg_collection.expt_dp
    chained = ChainedOptimizer([inner])
    chained.model_chunks = list(model_chunks)
    return chained


def _has_experts(chunk: torch.nn.Module) -> bool:
    """Whether a model chunk has routed experts (its config sets ``num_moe_experts``)."""
    try:
        config = get_model_config(chunk)
    except RuntimeError:  # a bare module without a config
        return False
    return getattr(config, "num_moe_experts", None) is not None


def _grad_scaler(config: OptimizerConfig, device: torch.device):
    """Constant scaler with ``loss_scale``, dynamic for fp16 without it, else None."""
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale, device=device)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=int(config.loss_scale_window),
            hysteresis=config.hysteresis,
            device=device,
        )
    return None


def _check_distributed_optimizer_settings(
    config: OptimizerConfig, model_chunks: List[torch.nn.Module]
) -> None:
    """The optimizer and the DDP chunks agree on ``use_distributed_optimizer`` (a plain
    optimizer over reduce-scattered gradients would step on unreduced values) and on
    ``overlap_param_gather``."""
    for index, chunk in enumerate(model_chunks):
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None:
            continue
        if ddp_config.use_distributed_optimizer != config.use_distributed_optimizer:
            raise ValueError(
                f"OptimizerConfig.use_distributed_optimizer={config.use_distributed_optimizer} "
                f"but model chunk {index} was wrapped with DistributedDataParallelConfig("
                f"use_distributed_optimizer={ddp_config.use_distributed_optimizer}); expected "
                "the same value in both"
            )
        if config.overlap_param_gather and not ddp_config.overlap_param_gather:
            raise ValueError(
                "OptimizerConfig.overlap_param_gather=True but model chunk "
                f"{index} was wrapped with DistributedDataParallelConfig(overlap_param_gather="
                "False); expected the same value in both"
            )
    if config.overlap_param_gather and not config.use_distributed_optimizer:
        raise ValueError(
            "OptimizerConfig.overlap_param_gather=True needs use_distributed_optimizer=True "
            "(--overlap-param-gather only supported with distributed optimizer)"
        )


def _get_param_groups(
    model_chunks: List[torch.nn.Module], config: OptimizerConfig, config_overrides: Any
) -> List[dict]:
    """Default group (wd_mult 1) first, then biases and 1-D parameters (wd_mult 0)."""
    skip_wd = config_overrides is None
    decayed, not_decayed = [], []
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if skip_wd and (name.endswith(".bias") or len(param.shape) == 1):
                not_decayed.append(param)
            else:
                decayed.append(param)
    base = {
        "is_expert_parallel": False,
        "lr_mult": 1.0,
        "is_decoupled_lr": False,
        "max_lr": config.lr,
        "min_lr": config.min_lr,
    }
    groups = [{"params": decayed, "default_config": True, "wd_mult": 1.0, **base}]
    if skip_wd:
        groups.append({"params": not_decayed, "default_config": True, "wd_mult": 0.0, **base})
    return [g for g in groups if g["params"]]


def _build_torch_optimizer(
    param_groups: List[dict], config: OptimizerConfig, params: List[torch.Tensor]
) -> torch.optim.Optimizer:
    devices = {p.device.type for p in params}
    kernel: Dict[str, Any] = {}
    if devices == {"cuda"}:
        kernel = {"fused": True}
    elif "cpu" in devices:
        kernel = {"foreach": False}
    else:
        kernel = {"foreach": True}
    if config.optimizer == "adam":
        cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        return cls(
            param_groups,
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            **kernel,
        )
    kernel.pop("fused", None)
    return torch.optim.SGD(
        param_groups,
        lr=config.lr,
        weight_decay=config.weight_decay,
        momentum=config.sgd_momentum,
        **kernel,
    )
