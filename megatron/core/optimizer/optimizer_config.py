"""``OptimizerConfig``: megatron-core 0.16.1's optimizer settings (every field, same defaults).

Implemented here: ``optimizer`` "adam" (AdamW with ``decoupled_weight_decay``, else Adam) and
"sgd", ``lr``/``min_lr``, ``weight_decay``, Adam betas/eps, ``sgd_momentum``, ``bf16``/``fp16``
with fp32 main parameters, ``loss_scale`` / dynamic loss scaling (``initial_loss_scale``,
``min_loss_scale``, ``loss_scale_window``, ``hysteresis``), ``clip_grad``,
``log_num_zeros_in_grad``, ``use_distributed_optimizer`` / ``overlap_param_gather`` (with DDP
chunks built the same way). The other fields are accepted; ``get_megatron_optimizer`` raises a
clear error for a value that asks for something missing here (CPU offload, precision-aware
optimizer, muon, ...).
"""

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megatron.core.optimizer.grad_scaler import is_valid_loss_scale


@dataclass
class OptimizerConfig:
    """Configuration for ``get_megatron_optimizer`` (megatron-core 0.16.1 field names)."""

    lr: Optional[float] = None
    min_lr: Optional[float] = None
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    weight_decay: float = 0.01
    apply_wd_to_qk_layernorm: bool = False
    fp8_recipe: Optional[str] = None
    fp16: bool = False
    bf16: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    params_dtype: torch.dtype = torch.float32
    use_precision_aware_optimizer: bool = False
    store_param_remainders: bool = True
    main_grads_dtype: torch.dtype = torch.float32
    main_params_dtype: torch.dtype = torch.float32
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    optimizer: str = "adam"
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    decoupled_weight_decay: bool = True
    sgd_momentum: float = 0.9
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True
    muon_use_nesterov: bool = False
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"
    muon_extra_scale_factor: float = 1.0
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    overlap_param_gather_with_optimizer_step: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    use_torch_optimizer_for_cpu_offload: bool = False
    overlap_cpu_optimizer_d2h_h2d: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    timers: Optional[Callable] = None
    config_logger_dir: str = ""

    @property
    def use_precision_aware_optimizer_no_fp8_or_ds_fp8(self) -> bool:
        """Whether gradients live in ``param.decoupled_grad`` (never here)."""
        return False

    def __post_init__(self) -> None:
        if self.fp16 and self.bf16:
            raise ValueError("OptimizerConfig: fp16=True and bf16=True; expected at most one")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(
                f"OptimizerConfig: optimizer={self.optimizer!r}; expected 'adam' or 'sgd'"
            )
        scales = [("initial_loss_scale", self.initial_loss_scale)]
        scales += [("min_loss_scale", self.min_loss_scale)]
        if self.loss_scale is not None:
            scales.append(("loss_scale", self.loss_scale))
        for name, value in scales:
            if not is_valid_loss_scale(value):
                raise ValueError(
                    f"OptimizerConfig: {name}={value!r}; expected a number > 0, finite in "
                    "float32 (an infinite loss scale overflows every fp16 step)"
                )


def unsupported_settings(config: OptimizerConfig) -> list:
    """``(field, value, expected)`` for each setting this project does not implement."""
    wanted: list[tuple[str, Any]] = [
        ("optimizer_cpu_offload", False),
        ("use_precision_aware_optimizer", False),
        ("overlap_param_gather_with_optimizer_step", False),
        ("reuse_grad_buf_for_mxfp8_param_ag", False),
        ("fp8_recipe", None),
        ("decoupled_lr", None),
        ("decoupled_min_lr", None),
    ]
    return [(n, getattr(config, n), v) for n, v in wanted if getattr(config, n) != v]
