"""The base class of megatron modules (an ``nn.Module`` that keeps its config) and
``Float16Module``, the wrapper that runs a model chunk in bf16/fp16 (megatron-core's names).
"""

from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


class MegatronModule(torch.nn.Module):
    """``torch.nn.Module`` with ``self.config``; pipeline chunks add ``set_input_tensor``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: Tuple[Tuple[int, int, int], ...] = (),
        metadata: Optional[dict] = None,
    ) -> Dict[str, Any]:
        """Sharded state dict for ``dist_checkpointing``: every parameter a ShardedTensor of
        its global tensor (split over TP by its ``partition_dim``), ``_extra_state`` a
        ShardedObject; children with their own ``sharded_state_dict`` use it
        (``transformer.utils.module_sharded_state_dict``)."""
        from megatron.core.transformer.utils import module_sharded_state_dict

        return module_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The module's ``state_dict`` (megatron-core's name for it)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def set_is_first_microbatch(self) -> None:
        """With ``config.fp8``: ``is_first_microbatch = True`` on every submodule that has it
        (the FP8 layers then cast their weights again and keep them for the step's other
        microbatches, ``megatron.core.fp8.cache``)."""
        if getattr(self.config, "fp8", None) is None:
            return
        for module in self.modules():
            if hasattr(module, "is_first_microbatch"):
                module.is_first_microbatch = True


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """False for the last stage's copy of tied word embeddings (``param.shared = True``),
    whose gradient equals the first stage's after the embedding all-reduce: gradient norms
    and zero counts skip it."""
    return not getattr(param, "shared", False)


def leave_as_allocated(weight: torch.Tensor) -> None:
    """The ``init_method`` the GPT's layers are built with: a no-op, because GPTModel fills
    every parameter afterwards from its own seeded generator (layout-independent)."""


def parallel_linear(
    spec: Union[ModuleSpec, type],
    input_size: int,
    output_size: int,
    config: TransformerConfig,
    tp_group: Optional[dist.ProcessGroup],
    **kwargs: Any,
) -> torch.nn.Module:
    """A tensor-parallel linear layer of the GPT (``spec``: column or row parallel) with its
    weight left as allocated (``init_method`` in ``kwargs`` overrides), not an expert's;
    ``kwargs``: the layer's own keywords (bias, gather_output, input_is_parallel, ...)."""
    kwargs.setdefault("init_method", leave_as_allocated)
    return build_module(
        spec, input_size, output_size, config=config, is_expert=False, tp_group=tp_group, **kwargs
    )


def output_projection(
    spec: Union[ModuleSpec, type],
    input_size: int,
    config: TransformerConfig,
    tp_comm_buffer_name: str,
    tp_group: Optional[dist.ProcessGroup],
) -> torch.nn.Module:
    """The projection [.., input_size / T] -> [.., hidden_size] that ends attention
    (``linear_proj``) and the MLP (``linear_fc2``): a row-parallel layer (``spec``) whose
    input is already split over ``tp_group``, with bias ``config.add_bias_linear`` returned
    unadded (it is added with the residual), its weight left as allocated."""
    return parallel_linear(
        spec,
        input_size,
        config.hidden_size,
        config,
        tp_group,
        bias=config.add_bias_linear,
        input_is_parallel=True,
        skip_bias_add=True,
        tp_comm_buffer_name=tp_comm_buffer_name,
    )


class Float16Module(MegatronModule):
    """Runs ``module`` in half precision (megatron-core 0.16.1's wrapper): its parameters
    and buffers are cast to bf16 (``config.bf16``) or fp16 (``config.fp16``) once, here.

    ``forward``: on the chunk that embeds (the first pipeline stage) floating-point inputs
    are cast to the half dtype; on the chunk that computes the output (the last stage) the
    floating-point outputs are cast to fp32 when ``fp32_output`` (the default), so the loss
    and everything after it are computed in fp32. Integer tensors (token ids, labels) are
    left alone. First/last stage: the wrapped chunk's ``pre_process`` / ``post_process``
    (what a GPT chunk is built with, whatever its pipeline and virtual stage); a module
    without them counts as both. fp32 master weights live in the optimizer
    (``Float16OptimizerWithFloat16Params``), gradients in DDP's ``main_grad``.
    """

    def __init__(self, config: TransformerConfig, module: torch.nn.Module) -> None:
        super().__init__(config)
        self.fp16, self.bf16 = config.fp16, config.bf16
        if self.fp16 == self.bf16:
            raise ValueError(
                f"Float16Module: config.fp16={config.fp16}, config.bf16={config.bf16}; "
                "expected exactly one of them True"
            )
        self.dtype = torch.float16 if self.fp16 else torch.bfloat16
        self.vp_stage = getattr(module, "vp_stage", None)
        self.pg_collection = getattr(module, "pg_collection", None)
        self.add_module("module", module.to(self.dtype))

    def float16_convertor(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` in the module's half dtype."""
        return value.to(self.dtype)

    def set_input_tensor(self, input_tensor) -> None:
        """Hand the previous stage's activations to the wrapped chunk."""
        return self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs, fp32_output: bool = True, **kwargs):
        """The wrapped chunk on half-precision inputs; fp32 outputs on the last stage."""
        if getattr(self.module, "pre_process", True):
            inputs = fp32_to_float16(inputs, self.float16_convertor)
            kwargs = {k: fp32_to_float16(v, self.float16_convertor) for k, v in kwargs.items()}
        outputs = self.module(*inputs, **kwargs)
        if fp32_output and getattr(self.module, "post_process", True):
            outputs = float16_to_fp32(outputs)
        return outputs

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """The wrapped chunk's state dict (no ``module.`` prefix)."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The wrapped chunk's state dict for a checkpoint."""
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", *args, **kwargs) -> Dict[str, Any]:
        """The wrapped chunk's sharded state dict (same keys as without the wrapper)."""
        return self.module.sharded_state_dict(prefix, *args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load into the wrapped chunk (values are cast to its dtype by ``copy_``)."""
        return self.module.load_state_dict(state_dict, strict=strict)


def conversion_helper(value: Any, conversion: Callable[[Any], Any]) -> Any:
    """``conversion`` applied to ``value``, or to every leaf of nested tuples/lists (the
    container types are kept)."""
    if not isinstance(value, (tuple, list)):
        return conversion(value)
    converted = [conversion_helper(v, conversion) for v in value]
    return tuple(converted) if isinstance(value, tuple) else converted


def fp32_to_float16(value: Any, float16_convertor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """fp32 tensors (leaves of nested tuples/lists) through ``float16_convertor``; every
    other value unchanged."""

    def convert(v):
        if isinstance(v, torch.Tensor) and v.dtype == torch.float32:
            return float16_convertor(v)
        return v

    return conversion_helper(value, convert)


def float16_to_fp32(value: Any) -> Any:
    """bf16/fp16 tensors (leaves of nested tuples/lists) as fp32; every other value
    unchanged."""

    def convert(v):
        if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16):
            return v.float()
        return v

    return conversion_helper(value, convert)
