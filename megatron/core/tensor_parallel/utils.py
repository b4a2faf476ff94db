"""Small helpers shared by the tensor-parallel layers: splitting, vocabulary ranges, groups.

A "TP group" is a ``torch.distributed`` process group, or ``None`` meaning one rank (no
tensor parallelism). Every public function that takes a group resolves it with
``tp_group_or_mpu``: an explicit group wins; ``None`` is the documented MPU fallback
(``parallel_state.get_tensor_model_parallel_group()`` when model parallelism is initialized,
else a single rank).
"""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.device import comm_device
from megatron.core.utils import get_pg_rank, get_pg_size


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


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, tp_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """This TP rank's 1/T of the flattened ``tensor`` (a view, or a copy with ``new_buffer``).

    ``tp_group=None``: MPU fallback (see module docstring).
    """
    size, rank = group_size_and_rank(tp_group_or_mpu(tp_group))
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
    group = tp_group_or_mpu(tp_group)
    if group_size_and_rank(group)[0] == 1:
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


# ---------------------------------------------------------------------------------------------
# Groups and the collectives every mapping is built from (explicit group, CPU/gloo aware).
# ---------------------------------------------------------------------------------------------


def tp_group_or_mpu(tp_group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The TP group to use: ``tp_group`` when given; else the MPU fallback
    ``parallel_state.get_tensor_model_parallel_group()`` when model parallelism is
    initialized; else ``None`` (one rank)."""
    if tp_group is not None:
        return tp_group
    if dist.is_available() and dist.is_initialized():
        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_tensor_model_parallel_group()
    return None


def group_size_and_rank(group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    """(T, this rank's index in ``group``); (1, 0) for ``None``."""
    return get_pg_size(group), get_pg_rank(group)


def all_reduce_copy(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A new tensor holding the sum of ``tensor`` over ``group`` (``tensor`` is not modified)."""
    buf = tensor.to(comm_device(group), copy=True).contiguous()
    dist.all_reduce(buf, group=group)
    return buf.to(tensor.device)


def all_gather_along_first_dim(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """cat over ranks (rank order) of every rank's ``tensor`` along dim 0 (equal shapes)."""
    size = dist.get_world_size(group=group)
    local = tensor.to(comm_device(group)).contiguous()
    out = local.new_empty((local.shape[0] * size,) + tuple(local.shape[1:]))
    if local.device.type == "cpu":  # gloo: list all-gather
        dist.all_gather(list(out.chunk(size, dim=0)), local, group=group)
    else:
        dist.all_gather_into_tensor(out, local, group=group)
    return out.to(tensor.device)


def reduce_scatter_along_first_dim(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Block ``rank`` (along dim 0, T equal blocks) of the sum of ``tensor`` over ``group``.

    gloo has no reduce-scatter: it all-reduces a private copy and keeps this rank's block
    (same result, T times the traffic; CPU runs are for correctness). ``tensor`` is never
    modified.
    """
    size, rank = group_size_and_rank(group)
    if tensor.shape[0] % size != 0:
        raise ValueError(
            f"reduce-scatter along dim 0: size {tensor.shape[0]} (shape {tuple(tensor.shape)}) "
            f"must be divisible by the group size ({size})"
        )
    device = comm_device(group)
    if device.type == "cpu":
        full = all_reduce_copy(tensor, group)
        return full.chunk(size, dim=0)[rank].contiguous()
    full = tensor.to(device).contiguous()
    out = full.new_empty((full.shape[0] // size,) + tuple(full.shape[1:]))
    dist.reduce_scatter_tensor(out, full, group=group)
    return out.to(tensor.device)
