"""How a sequence is split across context-parallel (CP) ranks, and how it is put back.

With C ranks the sequence is cut into 2C equal chunks and rank r holds chunks r and 2C-1-r,
in that order: under a causal mask every rank then does the same amount of attention work.
Attention gathers keys and values from all ranks with ``gather_from_context_parallel_region``,
whose backward hands each rank the gradient of its own shard summed over the ranks.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.communication import all_gather_along_first_dim, reduce_scatter_along_first_dim
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import get_pg_rank, get_pg_size, resolve_group


def cp_shard_positions(seq_length: int, cp_size: int, cp_rank: int) -> torch.LongTensor:
    """Global positions held by CP rank ``cp_rank`` of ``cp_size`` (load-balanced split).

    With chunk length k = seq_length / (2C): positions [r*k, (r+1)*k) then
    [(2C-1-r)*k, (2C-r)*k). C = 1 holds the whole sequence (any length).
    """
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_shard_positions: cp_size must be an int >= 1, got {cp_size!r}")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(
            f"cp_shard_positions: cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}"
        )
    if cp_size == 1:
        return torch.arange(seq_length, dtype=torch.long)
    num_chunks = 2 * cp_size
    if seq_length % num_chunks != 0:
        raise ValueError(
            f"cp_shard_positions: seq_length ({seq_length}) must be divisible by "
            f"2 * context_parallel_size ({num_chunks}) for the load-balanced CP split"
        )
    chunk = seq_length // num_chunks
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, dtype=torch.long)
    mirror = num_chunks - 1 - cp_rank
    second = torch.arange(mirror * chunk, (mirror + 1) * chunk, dtype=torch.long)
    return torch.cat([first, second])


def cp_gathered_positions(seq_length: int, cp_size: int) -> torch.LongTensor:
    """Global positions of a tensor gathered over the CP group, in gather (rank) order.

    The concatenation of ``cp_shard_positions(seq_length, cp_size, r)`` for r = 0 .. C-1.
    """
    return torch.cat([cp_shard_positions(seq_length, cp_size, r) for r in range(cp_size)])


def thd_partitioned_indices(
    cu_seqlens_padded: Union[torch.Tensor, Sequence[int]],
    total_tokens: int,
    cp_size: int,
    cp_rank: int,
) -> torch.LongTensor:
    """Positions of a packed (THD) sequence that CP rank ``cp_rank`` holds, in its order.

    Each document [cu[i], cu[i+1]) (padded length a multiple of 2C) is split with the
    load-balanced rule on its own: chunk k = length / (2C), the rank keeps chunks r and
    2C-1-r of every document, documents in order. Tokens past ``cu[-1]`` (up to
    ``total_tokens``) are split as one more document. (Transformer Engine's
    ``thd_get_partitioned_indices``, which megatron-core uses, in plain torch.)
    """
    offsets = _as_int_list(cu_seqlens_padded)
    if offsets[-1] < total_tokens:
        offsets = offsets + [total_tokens]
    if offsets[-1] != total_tokens or offsets[0] != 0:
        raise ValueError(
            f"thd_partitioned_indices: cu_seqlens_padded must run from 0 to at most "
            f"total_tokens ({total_tokens}), got {offsets}"
        )
    pieces: List[torch.Tensor] = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        length = end - start
        if length % (2 * cp_size) and cp_size > 1:
            raise ValueError(
                f"thd_partitioned_indices: padded document length {length} (at {start}) is not "
                f"a multiple of 2 * cp_size ({2 * cp_size})"
            )
        pieces.append(start + cp_shard_positions(length, cp_size, cp_rank))
    if not pieces:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(pieces)


def thd_document_positions(
    positions: torch.Tensor,
    cu_seqlens_padded: Union[torch.Tensor, Sequence[int]],
    total_tokens: int,
) -> Tuple[torch.LongTensor, torch.LongTensor]:
    """For positions of a packed (THD) row: the document each lies in and its position
    within that document (tokens past ``cu[-1]`` form one more document)."""
    offsets = _as_int_list(cu_seqlens_padded)
    if offsets[-1] < total_tokens:
        offsets = offsets + [total_tokens]
    starts = torch.tensor(offsets[:-1], device=positions.device)
    document = torch.searchsorted(starts, positions, right=True) - 1  # empty ones skipped
    return document, positions - starts[document]


def _as_int_list(values: Union[torch.Tensor, Sequence[int]]) -> List[int]:
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.tolist()]
    return [int(v) for v in values]


def get_batch_on_this_cp_rank(
    batch: Dict[str, Any], cp_group: Optional[dist.ProcessGroup] = None
) -> Dict[str, Any]:
    """A new dict holding this CP rank's shard of every [b, s, ...] tensor of ``batch``.

    Tensors with ndim >= 2 (tokens, labels, loss_mask, position_ids) are sliced along dim 1
    to ``cp_shard_positions``; an ``attention_mask`` [b, 1, s, s] along dim 2 (its queries),
    as megatron-core does; other entries pass through. The input dict is never modified.
    ``cp_group=None`` is the MPU fallback of ``resolve_group("cp", ...)``
    (``parallel_state``'s CP group when initialized, else C = 1: the batch is returned
    unchanged).
    """
    cp_group = resolve_group("cp", cp_group)
    return slice_batch_for_cp_rank(batch, get_pg_size(cp_group), get_pg_rank(cp_group))


def get_thd_batch_on_this_cp_rank(
    batch: Dict[str, Any],
    cu_seqlens: Any,
    cu_seqlens_padded: Any,
    max_seqlen: Any,
    cp_size: Optional[int] = None,
    cp_rank: Optional[int] = None,
) -> Tuple[Dict[str, Any], PackedSeqParams]:
    """This CP rank's share of a packed (THD) batch, and its ``PackedSeqParams``.

    megatron-core 0.16.1's signature (``megatron.core.utils``). Every [1, t] entry of
    ``batch`` except ``attention_mask``, ``cu_seqlens``, ``cu_seqlens_padded`` and
    ``max_seqlen`` keeps the positions ``thd_partitioned_indices(cu_seqlens_padded, t, C, r)``
    (each padded document split into 2C chunks, chunks r and 2C-1-r kept).
    ``cp_size``/``cp_rank`` None: the MPU fallback (``resolve_group("cp")``: C = 1 without
    parallel state). Returns a new dict (the input is not modified) and the parameters
    (``qkv_format="thd"``).
    """
    longest = int(max_seqlen.reshape(-1)[0]) if torch.is_tensor(max_seqlen) else int(max_seqlen)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    if cp_size is None or cp_rank is None:
        group = resolve_group("cp")
        cp_size = get_pg_size(group) if cp_size is None else cp_size
        cp_rank = get_pg_rank(group) if cp_rank is None else cp_rank
    skip = {"attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen"}
    out = dict(batch)
    if cp_size > 1:
        index = None
        for key, value in batch.items():
            if key in skip or not torch.is_tensor(value) or value.dim() < 2:
                continue
            if index is None:
                index = thd_partitioned_indices(cu_seqlens_padded, value.shape[1], cp_size, cp_rank)
                index = index.to(value.device)
            out[key] = value.index_select(1, index)
    return out, params


def slice_batch_for_cp_rank(batch: Dict[str, Any], cp_size: int, cp_rank: int) -> Dict[str, Any]:
    """``get_batch_on_this_cp_rank`` for an explicit CP size and rank (no group needed).

    Returns a new dict; entry ``x`` with ndim >= 2 becomes ``x.index_select(dim, positions)``.
    """
    sliced = {}
    for key, value in batch.items():
        if cp_size == 1 or not isinstance(value, torch.Tensor) or value.dim() < 2:
            sliced[key] = value
            continue
        seq_dim = 2 if key == "attention_mask" and value.dim() >= 3 else 1
        positions = cp_shard_positions(value.shape[seq_dim], cp_size, cp_rank)
        sliced[key] = value.index_select(seq_dim, positions.to(value.device))
    return sliced


def gather_from_context_parallel_region(
    tensor: torch.Tensor, cp_group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """All-gather a [s_local, ...] tensor over ``cp_group`` along dim 0, differentiably.

    Forward: y = cat_r x_r (rank order). Backward: dL/dx_r = sum over ranks q of the
    gradient rank q holds for block r of y. No group, or a group of one, is the identity.
    """
    if get_pg_size(cp_group) == 1:
        return tensor
    return _GatherFromContextParallelRegion.apply(tensor, cp_group)


class _GatherFromContextParallelRegion(torch.autograd.Function):
    """Autograd wrapper of the CP all-gather along dim 0.

    The backward is a reduce-scatter: sum the full gradient over ranks, keep block r
    (``megatron.core.communication``'s collectives).
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """y = cat over ranks of x_r along dim 0."""
        ctx.group = group
        return all_gather_along_first_dim(tensor, group)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """dL/dx_r = block r of sum over ranks of dL/dy."""
        return reduce_scatter_along_first_dim(grad_output, ctx.group), None
