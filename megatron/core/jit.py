"""``jit_fuser``: how megatron-core fuses small elementwise functions (``torch.compile`` on
the torch versions this core supports, as megatron-core 0.16.1 does from torch 2.2)."""

from typing import Callable

import torch


def jit_fuser(function: Callable) -> Callable:
    """``torch.compile(function)``; compiled lazily, on its first call, once per input
    signature (shapes that change are then compiled as dynamic)."""
    return torch.compile(function)
