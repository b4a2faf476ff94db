"""The collectives every parallel region is built from (no autograd), in one place.

Sync and asynchronous all-reduce, all-gather and reduce-scatter along dim 0, the ring
exchange of context-parallel attention (send to the next rank, receive from the previous
one) and the all-to-all. The differentiable mappings (``tensor_parallel.mappings``,
``context_parallel``) and the CP attention call these; nothing else calls
``torch.distributed`` collectives on tensors of a parallel region.

Conventions:

* ``group`` is an already resolved group (see ``process_groups_config.resolve_group``);
  ``None`` or a group of one rank is the identity: the input itself comes back (no copy).
* Tensors travel on ``device.comm_device(group)`` (the one place that maps a backend to a
  device: nccl, and the lazy "undefined" backend with CUDA, are GPU; gloo is CPU) and the
  result comes back on the input's device. The caller's tensor is never modified unless it
  says so with ``overwrite_input=True`` (then it may be reduced in place when it already
  lives on the group's device).
* gloo has no ``reduce_scatter_tensor`` and, on some torch versions, no
  ``all_gather_into_tensor``: there a reduce-scatter is an all-reduce of a private copy that
  keeps this rank's block (same numbers, T times the traffic), and an all-gather writes into
  the T row blocks of one output tensor through the list form.
* ``start_*`` return a ``Pending``: the collective runs while the caller computes;
  ``Pending.wait()`` returns the result. On the GPU this overlaps communication with work.
* Functions ending in ``_`` work in place on the caller's tensor (gradient buckets,
  parameter buffers, statistics): ``all_reduce_``, ``broadcast_`` (and
  ``broadcast_from_last_``, from the group's last rank: the last pipeline stage),
  ``start_reduce_scatter_shard_`` and ``start_all_gather_shards_`` (a flat buffer cut into
  T equal shards, rank r owning shard r, as the distributed optimizer lays it out).
  ``ReduceOp.AVG`` is emulated where the backend lacks it (SUM, then division by T).
* Object collectives (``all_gather_object``, ``gather_object``, ``broadcast_object``,
  ``barrier``) take ``world_group()`` for the default group: ``None`` still means one rank.
* Point-to-point: ``p2p_op`` builds one send or receive, ``run_p2p`` posts a list of them
  (batched, or one by one in a deadlock-free order) and waits.

Block order is rank order within ``group``: block r of a gathered tensor is rank r's.
Nothing else in ``megatron`` (the core and the trainer) calls a ``torch.distributed``
collective (``tests/unit_tests/test_import_graph.py`` keeps it so, with a short allow-list).
"""

from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.device import comm_device, supports_avg
from megatron.core.process_groups_config import get_pg_rank, get_pg_size


class Pending:
    """A collective in flight; ``wait()`` blocks until it is done and returns its result."""

    def __init__(self, works: Sequence, finish: Callable[[], torch.Tensor]) -> None:
        self._works = [w for w in works if w is not None]
        self._finish = finish

    def wait(self) -> torch.Tensor:
        """Wait for the communication and return the result tensor."""
        for work in self._works:
            work.wait()
        self._works = []
        return self._finish()


def is_nccl(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether ``group`` exchanges GPU tensors (nccl, or the lazy "undefined" backend with
    CUDA available): ``device.comm_device`` decides."""
    return comm_device(group).type == "cuda"


def all_reduce(
    tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    op=dist.ReduceOp.SUM,
    *,
    overwrite_input: bool = False,
) -> torch.Tensor:
    """``op`` (default: sum) of ``tensor`` over ``group``: y = x_0 + ... + x_{T-1}."""
    return start_all_reduce(tensor, group, op, overwrite_input=overwrite_input).wait()


def start_all_reduce(
    tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    op=dist.ReduceOp.SUM,
    *,
    overwrite_input: bool = False,
) -> Pending:
    """Start ``all_reduce``; with ``overwrite_input`` a contiguous ``tensor`` on the group's
    device is reduced in place (and is the result)."""
    if get_pg_size(group) == 1:
        return Pending((), lambda: tensor)
    device = comm_device(group)
    if overwrite_input and tensor.device == device and tensor.is_contiguous():
        buf = tensor
    else:
        buf = tensor.to(device, copy=True).contiguous()
    work = dist.all_reduce(buf, op=op, group=group, async_op=True)
    return Pending((work,), lambda: buf.to(tensor.device))


def all_gather_along_first_dim(
    tensor: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """cat over ranks (rank order) of every rank's ``tensor`` along dim 0 (equal shapes):
    [s, ...] -> [T s, ...]."""
    return start_all_gather_along_first_dim(tensor, group).wait()


def start_all_gather_along_first_dim(
    tensor: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> Pending:
    """Start ``all_gather_along_first_dim``."""
    size = get_pg_size(group)
    if size == 1:
        return Pending((), lambda: tensor)
    device = comm_device(group)
    local = tensor.to(device).contiguous()
    out = local.new_empty((local.shape[0] * size,) + tuple(local.shape[1:]))
    if is_nccl(group):
        work = dist.all_gather_into_tensor(out, local, group=group, async_op=True)
    else:  # gloo: the list form, writing into the row blocks of ``out``
        work = dist.all_gather(list(out.chunk(size, dim=0)), local, group=group, async_op=True)
    return Pending((work,), lambda: out.to(tensor.device))


def reduce_scatter_along_first_dim(
    tensor: torch.Tensor, group: Optional[dist.ProcessGroup], *, overwrite_input: bool = False
) -> torch.Tensor:
    """Block r (of T equal blocks along dim 0) of the sum of ``tensor`` over ``group``:
    [T s, ...] -> [s, ...]."""
    return start_reduce_scatter_along_first_dim(
        tensor, group, overwrite_input=overwrite_input
    ).wait()


def start_reduce_scatter_along_first_dim(
    tensor: torch.Tensor, group: Optional[dist.ProcessGroup], *, overwrite_input: bool = False
) -> Pending:
    """Start ``reduce_scatter_along_first_dim``. ``tensor`` must stay alive (and, with
    ``overwrite_input``, untouched) until ``wait()``."""
    return reduce_scatter_along_first_dim_start(tensor, group, overwrite_input)


def reduce_scatter_along_first_dim_start(
    tensor: torch.Tensor, group: Optional[dist.ProcessGroup], overwrite_input: bool
) -> Pending:
    size, rank = get_pg_size(group), get_pg_rank(group)
    if size == 1:
        return Pending((), lambda: tensor)
    if tensor.shape[0] % size != 0:
        raise ValueError(
            f"reduce-scatter along dim 0: size {tensor.shape[0]} (shape {tuple(tensor.shape)}) "
            f"must be divisible by the group size ({size})"
        )
    if not is_nccl(group):  # gloo has no reduce-scatter: all-reduce, keep this rank's block
        reduced = start_all_reduce(tensor, group, overwrite_input=overwrite_input)
        return Pending((), lambda: reduced.wait().chunk(size, dim=0)[rank].contiguous())
    full = tensor.to(comm_device(group)).contiguous()
    out = full.new_empty((full.shape[0] // size,) + tuple(full.shape[1:]))
    work = dist.reduce_scatter_tensor(out, full, group=group, async_op=True)
    return Pending((work, _KeepAlive(full)), lambda: out.to(tensor.device))


def ring_exchange(
    tensor: torch.Tensor, group: Optional[dist.ProcessGroup], tag: int = 0
) -> Pending:
    """Start sending ``tensor`` to the next rank of the ring (rank r + 1 mod T of ``group``)
    and receiving the previous rank's tensor of the same shape and dtype, which ``wait()``
    returns. With one rank the tensor comes back."""
    size, rank = get_pg_size(group), get_pg_rank(group)
    if size == 1:
        return Pending((), lambda: tensor)
    ranks = dist.get_process_group_ranks(group)
    nxt, prv = ranks[(rank + 1) % size], ranks[(rank - 1) % size]
    recv = torch.empty_like(tensor)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, tensor, nxt, group, tag),
            dist.P2POp(dist.irecv, recv, prv, group, tag),
        ]
    )
    return Pending(works, lambda: recv)


def all_to_all_single(
    tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    output_split_sizes: Optional[List[int]] = None,
    input_split_sizes: Optional[List[int]] = None,
) -> torch.Tensor:
    """All-to-all along dim 0: block j of rank i's ``tensor`` becomes block i of rank j's
    result (equal blocks, or the given split sizes)."""
    if get_pg_size(group) == 1:
        return tensor
    local = tensor.to(comm_device(group)).contiguous()
    if output_split_sizes is None:
        out = torch.empty_like(local)
    else:
        out = local.new_empty((sum(output_split_sizes),) + tuple(local.shape[1:]))
    dist.all_to_all_single(
        out,
        local,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=group,
    )
    return out.to(tensor.device)


class _KeepAlive:
    """Holds a buffer a pending collective reads until the collective is waited for."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self) -> None:
        self.tensor = None


# ---------------------------------------------------------------------------------------------
# in place: statistics, gradient buckets, parameter buffers


def all_reduce_(
    tensor: torch.Tensor, group: Optional[dist.ProcessGroup], op=dist.ReduceOp.SUM
) -> torch.Tensor:
    """``tensor <- op over group of tensor``, in place (through the group's device when the
    tensor lives elsewhere); returns ``tensor``."""
    return start_all_reduce_(tensor, group, op).wait()


def start_all_reduce_(
    tensor: torch.Tensor, group: Optional[dist.ProcessGroup], op=dist.ReduceOp.SUM
) -> Pending:
    """Start ``all_reduce_``; ``wait()`` leaves the result in ``tensor`` (AVG emulated as SUM
    then ``/ T`` where the backend lacks it) and returns it."""
    size = get_pg_size(group)
    if size == 1:
        return Pending((), lambda: tensor)
    op, divisor = _native_op(op, group, size)
    buf, copy_back = _on_comm_device(tensor, group)
    work = dist.all_reduce(buf, op=op, group=group, async_op=True)
    return Pending((work,), lambda: _finish_in_place(tensor, buf, copy_back, divisor))


def start_reduce_scatter_shard_(
    flat: torch.Tensor, group: Optional[dist.ProcessGroup], op=dist.ReduceOp.SUM
) -> Pending:
    """Start reducing the 1-D ``flat`` (T equal shards) so that shard r of this rank (rank r
    of ``group``) holds ``op`` over the group of everyone's shard r; ``wait()`` returns the
    shard. The rest of ``flat`` is scratch: gloo has no reduce-scatter, so there all of
    ``flat`` is all-reduced (the same sums, T times the traffic)."""
    size, rank = get_pg_size(group), get_pg_rank(group)
    if flat.numel() % size != 0:
        raise ValueError(
            f"reduce-scatter of a flat buffer: {flat.numel()} elements are not divisible by "
            f"the group size {size}"
        )
    shard = flat.view(size, -1)[rank]
    if size == 1:
        return Pending((), lambda: shard)
    if not is_nccl(group) or flat.device != comm_device(group):
        reduced = start_all_reduce_(flat, group, op)
        return Pending((), lambda: (reduced.wait(), shard)[1])
    op, divisor = _native_op(op, group, size)
    work = dist.reduce_scatter_tensor(shard, flat, op=op, group=group, async_op=True)
    return Pending((work,), lambda: shard.div_(divisor) if divisor != 1 else shard)


def start_all_gather_shards_(flat: torch.Tensor, group: Optional[dist.ProcessGroup]) -> Pending:
    """Start filling every shard of the 1-D ``flat`` (T equal shards) with its owner's shard:
    afterwards ``flat`` is the same on every rank; ``wait()`` returns it."""
    size, rank = get_pg_size(group), get_pg_rank(group)
    if size == 1:
        return Pending((), lambda: flat)
    pieces = flat.view(size, -1)
    if is_nccl(group) and flat.device == comm_device(group):
        work = dist.all_gather_into_tensor(flat, pieces[rank], group=group, async_op=True)
        return Pending((work,), lambda: flat)
    if flat.device == comm_device(group):  # gloo: the list form, the input not an output
        local = pieces[rank].clone()
        work = dist.all_gather(list(pieces.unbind(0)), local, group=group, async_op=True)
        return Pending((work, _KeepAlive(local)), lambda: flat)
    gathered = start_all_gather_along_first_dim(pieces[rank], group)
    return Pending((), lambda: flat.copy_(gathered.wait().view(-1)))


def broadcast_(
    tensor: torch.Tensor, group: Optional[dist.ProcessGroup], src: int = 0
) -> torch.Tensor:
    """``tensor <- rank src's tensor`` (``src``: a rank of ``group``), in place; returns it."""
    if get_pg_size(group) == 1:
        return tensor
    buf, copy_back = _on_comm_device(tensor, group)
    dist.broadcast(buf, src=dist.get_global_rank(group, src), group=group)
    return _finish_in_place(tensor, buf, copy_back, 1)


def broadcast_from_last_(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``tensor <- the last rank of group's tensor``, in place (the last pipeline stage holds
    the loss and the logits; the other stages take its values); returns it."""
    return broadcast_(tensor, group, src=get_pg_size(group) - 1)


# ---------------------------------------------------------------------------------------------
# objects and synchronization


def world_group() -> Optional[dist.ProcessGroup]:
    """The default group when torch.distributed is initialized, else None (one rank)."""
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def all_gather_object(obj: Any, group: Optional[dist.ProcessGroup]) -> List[Any]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` for one rank."""
    size = get_pg_size(group)
    if size == 1:
        return [obj]
    out: List[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: Any, group: Optional[dist.ProcessGroup], dst: int = 0) -> Optional[list]:
    """Every rank's ``obj`` on rank ``dst`` of ``group`` (None on the others)."""
    size = get_pg_size(group)
    if size == 1:
        return [obj]
    out = [None] * size if get_pg_rank(group) == dst else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, dst), group=group)
    return out


def broadcast_object(obj: Any, group: Optional[dist.ProcessGroup], src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (picklable) on every rank of ``group``."""
    if get_pg_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src), group=group)
    return box[0]


def barrier(group: Optional[dist.ProcessGroup]) -> None:
    """Wait until every rank of ``group`` gets here."""
    if get_pg_size(group) > 1:
        dist.barrier(group=group)


# ---------------------------------------------------------------------------------------------
# point to point


def p2p_op(
    tensor: torch.Tensor,
    peer: int,
    group: Optional[dist.ProcessGroup],
    tag: int = 0,
    *,
    is_send: bool,
) -> dist.P2POp:
    """One send of ``tensor`` to (or receive into it from) global rank ``peer``; a
    non-contiguous tensor is sent from a contiguous copy."""
    if is_send and not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return dist.P2POp(dist.isend if is_send else dist.irecv, tensor, peer, group, tag=tag)


def is_send(op: dist.P2POp) -> bool:
    """Whether ``op`` (from ``p2p_op``) is a send."""
    return op.op is dist.isend


def run_p2p(
    ops: Sequence[dist.P2POp], *, batched: bool, sends_first: bool, synchronize: bool = False
) -> None:
    """Post ``ops`` and wait for all of them: batched (one ``batch_isend_irecv``), or one by
    one, sends before receives when ``sends_first`` else receives first (neighbours choose
    opposite orders, so backends whose sends block until matched cannot deadlock).
    ``synchronize``: after a batch on the GPU, wait for the device too."""
    if not ops:
        return
    if batched:
        works = dist.batch_isend_irecv(list(ops))
    else:
        sends = [op for op in ops if is_send(op)]
        recvs = [op for op in ops if not is_send(op)]
        ordered = sends + recvs if sends_first else recvs + sends
        works = [op.op(op.tensor, op.peer, group=op.group, tag=op.tag) for op in ordered]
    for work in works:
        work.wait()
    if batched and synchronize:
        device = ops[0].tensor.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------


def _native_op(op, group: Optional[dist.ProcessGroup], size: int):
    """(the op the backend runs, the divisor left to apply): AVG -> (SUM, T) without AVG."""
    if op == dist.ReduceOp.AVG and not supports_avg(group):
        return dist.ReduceOp.SUM, size
    return op, 1


def _on_comm_device(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]):
    """(a contiguous tensor on the group's device to reduce in place, whether the result
    must be copied back into ``tensor``)."""
    if tensor.device == comm_device(group) and tensor.is_contiguous():
        return tensor, False
    return tensor.to(comm_device(group), copy=True).contiguous(), True


def _finish_in_place(tensor, buf, copy_back: bool, divisor: int) -> torch.Tensor:
    if divisor != 1:
        buf.div_(divisor)
    if copy_back:
        tensor.copy_(buf)
    return tensor
