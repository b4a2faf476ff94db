"""SwiGLU with its bias, fused: y = x + b, [gate | up] = y, out = silu(gate) * up."""

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.jit import jit_fuser


@jit_fuser
def _bias_swiglu(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if bias is not None:
        y = y + bias
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def bias_swiglu_impl(
    input: torch.Tensor,
    bias: Optional[torch.Tensor],
    fp8_input_store: bool = False,
    cpu_offload_input: bool = False,
) -> torch.Tensor:
    """silu(gate) * up of ``input`` (+ ``bias``) split in halves along the last dimension
    (megatron-core's signature; fp8 storage and CPU offload are not supported)."""
    if fp8_input_store or cpu_offload_input:
        raise NotImplementedError(
            "bias_swiglu_impl: fp8_input_store and cpu_offload_input are not supported"
        )
    return _bias_swiglu(input, bias)
