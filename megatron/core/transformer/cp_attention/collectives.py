"""Every collective of CP attention, in one module.

The strategies start these and overlap them with kernel calls: an all-gather and a
reduce-scatter of K/V heads (all_gather), a ring exchange with the next and previous rank
(p2p), heads all-to-all exchanges as autograd functions (a2a), and a max over the group (the
bf16 rescaling). The backend question (nccl's tensor collectives, or gloo's list forms) goes
to ``megatron.core.device``. Kept apart so that it can be pointed at a shared communication
module without touching the strategies.
"""

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.device import comm_device
from megatron.core.tensor_parallel.mappings import adjoint_pair


class Pending:
    """An asynchronous collective and how to turn its buffers into the result."""

    def __init__(self, work, finish: Callable[[], torch.Tensor]):
        self.work, self.finish = work, finish

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish()


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
    world = dist.get_world_size(group=group)
    if _tensor_collectives(group):
        out = local.new_empty((world * local.shape[0],) + tuple(local.shape[1:]))
        work = dist.all_gather_into_tensor(out, local, group=group, async_op=True)
        return Pending(work, lambda: out)
    parts = [torch.empty_like(local) for _ in range(world)]
    work = dist.all_gather(parts, local, group=group, async_op=True)
    return Pending(work, lambda: torch.cat(parts, dim=0))


def start_reduce_scatter(full: torch.Tensor, group) -> Pending:
    """Start summing the float32 K/V gradients (rank order) over ranks, keeping this rank's."""
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    if _tensor_collectives(group):
        out = full.new_empty((full.shape[0] // world,) + tuple(full.shape[1:]))
        work = dist.reduce_scatter_tensor(out, full, group=group, async_op=True)
        return Pending(work, lambda: out)
    work = dist.all_reduce(full, group=group, async_op=True)  # gloo has no reduce-scatter
    return Pending(work, lambda: full.chunk(world, dim=0)[rank])


def ring_exchange(tensor: torch.Tensor, group, tag: int) -> Pending:
    """Start sending ``tensor`` to the next rank of the ring and receiving the previous one's."""
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    ranks = dist.get_process_group_ranks(group)
    nxt, prv = ranks[(rank + 1) % world], ranks[(rank - 1) % world]
    recv = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, nxt, group, tag),
        dist.P2POp(dist.irecv, recv, prv, group, tag),
    ]
    works = dist.batch_isend_irecv(ops)
    return Pending(_WaitAll(works), lambda: recv)


def max_over_group(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """x = max of x over ``group``, in place (nothing for no group or one rank)."""
    if group is not None and dist.get_world_size(group=group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    c = dist.get_world_size(group=group)
    s, b, n, d = x.shape
    send = x.reshape(s, b, c, n // c, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.view(c * s, b, n // c, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    c = dist.get_world_size(group=group)
    s_total, b, m, d = x.shape
    send = x.contiguous().view(c, s_total // c, b, m, d)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(s_total // c, b, c * m, d)


SeqToHeads = adjoint_pair(
    "SeqToHeads",
    "[s_local, b, n, d] sequence shard -> [C * s_local, b, n / C, d] (rank order) for this "
    "rank's heads n/C * r .. n/C * (r + 1); backward is the inverse exchange.",
    _seq_to_heads,
    _heads_to_seq,
)
HeadsToSeq = adjoint_pair("HeadsToSeq", "Inverse of ``SeqToHeads``.", _heads_to_seq, _seq_to_heads)


def _tensor_collectives(group) -> bool:
    """nccl's single-tensor all-gather and reduce-scatter: the group's tensors live on a GPU
    (``comm_device``: nccl, or the lazy backend that creates nccl for CUDA tensors)."""
    return comm_device(group).type == "cuda"


class _WaitAll:
    def __init__(self, works: List):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()
