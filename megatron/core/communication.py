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

Block order is rank order within ``group``: block r of a gathered tensor is rank r's.
"""

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.device import comm_device
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
