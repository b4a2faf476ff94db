"""The collectives of CP attention, on ``megatron.core.communication``.

The strategies start these and overlap them with kernel calls: an all-gather and a
reduce-scatter of K/V heads (all_gather), a ring exchange with the next and previous rank
(p2p), heads all-to-all exchanges as autograd functions (a2a), and a max over the group (the
bf16 rescaling). What is specific to attention lives here (which heads, which layout); the
exchanges themselves, their gloo fallbacks and the backend question are the shared
communication module's.
"""

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.communication import (
    Pending,
    all_reduce,
    all_to_all_single,
    ring_exchange,
    start_all_gather_along_first_dim,
    start_reduce_scatter_along_first_dim,
)
from megatron.core.process_groups_config import get_pg_size
from megatron.core.tensor_parallel.mappings import adjoint_pair

__all__ = [
    "HeadsToSeq",
    "Pending",
    "SeqToHeads",
    "max_over_group",
    "ring_exchange",
    "start_gather",
    "start_reduce_scatter",
]


def start_gather(kv: torch.Tensor, heads: Tuple[int, int], group) -> Pending:
    """Start all-gathering K/V heads h0:h1 of ``kv`` ([s_local, b, 2 n_kv, d], keys then
    values) as one [C * s_local, b, 2 (h1 - h0), d] tensor (rank order: rows
    [j s_local, (j + 1) s_local) are rank j's)."""
    h0, h1 = heads
    n_kv = kv.shape[2] // 2
    if h1 - h0 == n_kv:
        local = kv
    else:
        local = torch.cat([kv[:, :, h0:h1], kv[:, :, n_kv + h0 : n_kv + h1]], dim=2)
    return start_all_gather_along_first_dim(local, group)


def start_reduce_scatter(full: torch.Tensor, group) -> Pending:
    """Start summing the float32 K/V gradients (rank order) over ranks, keeping this rank's
    block; ``full`` is scratch (gloo reduces it in place)."""
    return start_reduce_scatter_along_first_dim(full, group, overwrite_input=True)


def max_over_group(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """x = max of x over ``group``, in place (nothing for no group or one rank)."""
    reduced = all_reduce(x, group, dist.ReduceOp.MAX, overwrite_input=True)
    if reduced is not x:
        x.copy_(reduced)


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    c = get_pg_size(group)
    s, b, n, d = x.shape
    send = x.reshape(s, b, c, n // c, d).permute(2, 0, 1, 3, 4).contiguous()
    return all_to_all_single(send, group).view(c * s, b, n // c, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    c = get_pg_size(group)
    s_total, b, m, d = x.shape
    send = x.contiguous().view(c, s_total // c, b, m, d)
    recv = all_to_all_single(send, group)
    return recv.permute(1, 2, 0, 3, 4).reshape(s_total // c, b, c * m, d)


SeqToHeads = adjoint_pair(
    "SeqToHeads",
    "[s_local, b, n, d] sequence shard -> [C * s_local, b, n / C, d] (rank order) for this "
    "rank's heads n/C * r .. n/C * (r + 1); backward is the inverse exchange.",
    _seq_to_heads,
    _heads_to_seq,
)
HeadsToSeq = adjoint_pair("HeadsToSeq", "Inverse of ``SeqToHeads``.", _heads_to_seq, _seq_to_heads)
