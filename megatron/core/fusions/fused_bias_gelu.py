"""GELU with its bias, fused: out = gelu(x + b), the exact (erf) GELU of the unfused layer.

megatron-core's fused bias-GELU uses the tanh approximation; this one keeps the unfused
layer's math, so switching the fusion on changes only rounding."""

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.jit import jit_fuser


@jit_fuser
def _bias_gelu(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return F.gelu(y if bias is None else y + bias)


def bias_gelu_impl(input: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """gelu(``input`` + ``bias``)."""
    return _bias_gelu(input, bias)
