"""The reference FP8 value of a tensor, written out independently of ``megatron.core.fp8``: the
tests' and ``tests/benchmarks/fp8_gpu_check.py``'s dequantized operands."""

import torch


def dequantized(
    t: torch.Tensor, dtype: torch.dtype, margin: int = 0, precision: torch.dtype = torch.float64
) -> torch.Tensor:
    """t's FP8 value in ``precision``: with s = fp8_max / amax / 2**margin (1 for an empty or
    zero tensor), q = cast(clamp(t * s)), value q / s."""
    t = t.detach()
    zero = torch.zeros((), dtype=torch.double, device=t.device)
    amax = t.abs().max().double() if t.numel() else zero
    top = torch.finfo(dtype).max
    scale = (top / amax / 2**margin).float() if amax > 0 else torch.ones((), device=t.device)
    q = (t.float() * scale).clamp(-top, top).to(dtype)
    return (q.double() / scale.double()).to(precision)
