"""The seeded, layout-free initialization of LoRA adapter weights (dense and expert)."""

import math
import zlib
from typing import Callable

import torch


def adapter_init_method(
    name: str, generator: torch.Generator
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The init of a full [out, in] adapter weight from ``generator``: xavier (normal),
    normal (std 0.02), kaiming (uniform, a = sqrt(5), torch.nn.Linear's), zero."""
    init = torch.nn.init
    return {
        "xavier": lambda w: init.xavier_normal_(w, generator=generator),
        "normal": lambda w: init.normal_(w, std=0.02, generator=generator),
        "kaiming": lambda w: init.kaiming_uniform_(w, a=math.sqrt(5), generator=generator),
        "zero": init.zeros_,
    }[name]


def adapter_seed(seed: int, name: str) -> int:
    """The adapter's generator seed: (seed, the layer's global name), layout-free."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
