"""Moved to ``megatron.core.tensor_parallel.grad_accumulation_fusion`` (the tensor-parallel
linear layers use it and must not import ``megatron.core.transformer``); re-exported here."""

from megatron.core.tensor_parallel.grad_accumulation_fusion import (  # noqa: F401
    accumulate_weight_grad,
    linear_with_grad_accumulation_fusion,
)
