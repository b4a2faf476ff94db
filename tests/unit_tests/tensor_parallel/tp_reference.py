"""Shared pieces of the tensor-parallel tests: the TP group (the whole world), seeded full
tensors every rank agrees on, and this rank's slices of them.

The dense references are plain torch on the full float64 CPU tensors; they never call the
code under test. Inputs of the code under test go to ``device()`` (CPU under gloo, this
rank's GPU under ``TEST_BACKEND=nccl``).
"""

from typing import Callable, Tuple

import torch
import torch.distributed as dist

from megatron.core.device import comm_device
from tests.unit_tests.dist_utils import WORLD_SIZE

TOL = 1e-10  # float64 parity


def world_group() -> Tuple[dist.ProcessGroup, int, int]:
    """(the world group used as the TP group, T, this rank)."""
    return dist.group.WORLD, WORLD_SIZE, dist.get_rank()


def device() -> torch.device:
    """The device the default group's backend uses (the layers put their parameters there)."""
    return comm_device()


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` on ``device()``."""
    return tensor.to(device(), copy=True)


def seeded(shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    """A standard-normal tensor every rank draws identically."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def full_weight(shape, seed: int, init: Callable = torch.nn.init.normal_) -> torch.Tensor:
    """The full weight a layer's ``init_method`` builds (float32 draw from the default CPU
    generator seeded with ``seed``), as float64."""
    torch.manual_seed(seed)
    weight = torch.empty(shape, dtype=torch.float32)
    init(weight)
    return weight.double()


def block(tensor: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    """Block ``rank`` of ``parts`` equal blocks along ``dim``."""
    return tensor.chunk(parts, dim=dim)[rank]
