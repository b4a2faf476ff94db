"""Small helpers shared by the tensor-parallel layers: splitting and vocabulary ranges.

A "TP group" is a ``torch.distributed`` process group, or ``None``: the MPU fallback of
``process_groups_config.resolve_group("tp", ...)`` (``parallel_state``'s TP group when
initialized, else one rank).
"""

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.communication import all_gather_along_first_dim
from megatron.core.process_groups_config import get_pg_rank, get_pg_size, resolve_group


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> List[torch.Tensor]:
    """Split ``tensor`` into ``num_partitions`` equal pieces along its last dimension.

    Returns views unless ``contiguous_split_chunks`` (then contiguous copies).
    """
    last_dim_size = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return [chunk.contiguous() for chunk in chunks]
    return list(chunks)


def strided_shard(full: torch.Tensor, dim: int, stride: int, size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``size``: ``full`` cut along ``dim`` into size * stride
    blocks, blocks rank, rank + size, ... kept (megatron-core's strided split of a
    parameter with ``partition_stride``; ``full`` itself for size 1)."""
    if size == 1:
        return full
    blocks = full.chunk(size * stride, dim=dim)
    return torch.cat(blocks[rank::size], dim=dim)


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, tp_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """This TP rank's 1/T of the flattened ``tensor`` (a view, or a copy with ``new_buffer``).

    ``tp_group=None``: MPU fallback (see module docstring).
    """
    group = resolve_group("tp", tp_group)
    size, rank = get_pg_size(group), get_pg_rank(group)
    numel = tensor.numel()
    if numel % size != 0:
        raise ValueError(
            f"split_tensor_into_1d_equal_chunks: tensor.numel() ({numel}) must be divisible by "
            f"the tensor-parallel size ({size})"
        )
    part = numel // size
    data = tensor.reshape(-1)[rank * part : (rank + 1) * part]
    return data.clone() if new_buffer else data


def gather_split_1d_tensor(
    tensor: torch.Tensor, tp_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """Inverse of ``split_tensor_into_1d_equal_chunks``: the concatenation over TP ranks
    (rank order) of every rank's flat ``tensor``. ``tp_group=None``: MPU fallback."""
    group = resolve_group("tp", tp_group)
    if get_pg_size(group) == 1:
        return tensor.reshape(-1).clone()
    return all_gather_along_first_dim(tensor.reshape(-1), group)


class VocabUtility:
    """The vocabulary range [first, last) held by TP rank ``rank`` of ``world_size``."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank, world_size: int
    ) -> Sequence[int]:
        """[rank * P, (rank + 1) * P) for partition size P."""
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> Sequence[int]:
        """The range of rank ``rank`` when a vocabulary of V entries is split in T equal parts."""
        if global_vocab_size % world_size != 0:
            raise ValueError(
                f"vocabulary size ({global_vocab_size}) must be divisible by the "
                f"tensor-parallel size ({world_size}); pad the vocabulary (e.g. "
                "make_vocab_size_divisible_by) to a multiple of it"
            )
        per_partition = global_vocab_size // world_size
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            per_partition, rank, world_size
        )


def divide(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` after checking that it divides exactly."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Raise ValueError unless ``denominator`` divides ``numerator``."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
