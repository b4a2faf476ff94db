"""Contiguous gradient buffers split into buckets that are reduced as one tensor each.

With the distributed optimizer (``use_distributed_optimizer=True``) a buffer also holds the
parameters: ``param.data`` becomes a view of a contiguous parameter buffer with the same
layout as the gradient buffer. Every bucket is padded to a multiple of the data-parallel size
D (the dp x cp group), and rank r owns the r-th of the D equal pieces of each bucket, its
*shard*: the bucket's gradients are reduce-scattered (the shard receives the sum over the
group) and, after the optimizer has updated the shards, the parameters are all-gathered.
A parameter marked ``shared_embedding`` (tied word embeddings) gets a bucket of its own, so
its shard is the same element range on the first and the last pipeline stage (their
gradients are summed elementwise over the embedding group after the reduce-scatter).
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.communication import (
    Pending,
    start_all_gather_shards_,
    start_all_reduce_,
    start_reduce_scatter_shard_,
)
from megatron.core.process_groups_config import get_pg_size


class GradBucket:
    """A slice ``[start, end)`` of a buffer holding the ``main_grad`` (and, with the
    distributed optimizer, the parameters) of some parameters.

    Reduction: ``grad <- op_{dp_cp}(grad * pre_scale)`` (AVG emulated where the backend
    lacks it, in ``communication``); with the distributed optimizer only this rank's shard
    ``[start + r * n / D, start + (r + 1) * n / D)`` is guaranteed to hold the result.
    """

    def __init__(
        self,
        params: List[torch.nn.Parameter],
        grad_data: torch.Tensor,
        index: int,
        start: int = 0,
        param_data: Optional[torch.Tensor] = None,
    ):
        self.params, self.grad_data, self.index = params, grad_data, index
        self.start, self.end = start, start + grad_data.numel()
        self.param_data = param_data
        self.buffer: Optional["GradBuffer"] = None  # set by the buffer that holds it
        self.ready: set = set()
        self.handle: Optional[Pending] = None
        self.launched = False
        self.gather_handle: Optional[Pending] = None

    def reset(self) -> None:
        """Forget readiness and in-flight reductions (start of a new iteration)."""
        self.ready.clear()
        self.handle, self.launched = None, False

    def shard_range(self, rank: int, size: int) -> Tuple[int, int]:
        """Buffer coordinates ``[lo, hi)`` of rank ``rank``'s shard (bucket split in ``size``)."""
        piece = self.grad_data.numel() // size
        return self.start + rank * piece, self.start + (rank + 1) * piece


class GradBuffer:
    """One contiguous buffer per (parameter dtype, gradient dtype); parameters are laid out
    in reverse order of registration (roughly the order their gradients arrive) and cut into
    buckets of at least ``bucket_size`` elements (one bucket when None).

    ``shard_size`` (the size of the buffer's data-parallel group, distributed optimizer
    only): buckets padded to a multiple of it, parameters moved into ``param_data``,
    ``shared_embedding`` parameters in a bucket of their own. ``param_ranges[p] = (start,
    end)`` in buffer coordinates.

    A buffer carries the group its buckets reduce over (``data_parallel_group``: dp x cp for
    dense parameters; an expert buffer would carry the expert-data-parallel group) and the
    factor its gradients are pre-scaled by (``gradient_scaling_factor``); DDP reduces and the
    distributed optimizer shards each buffer over its own group.
    """

    def __init__(
        self,
        params: List[torch.nn.Parameter],
        grad_dtype: torch.dtype,
        bucket_size: Optional[int],
        shard_size: Optional[int] = None,
        data_parallel_group: Optional[dist.ProcessGroup] = None,
        gradient_scaling_factor: float = 1.0,
    ) -> None:
        if shard_size is not None and shard_size != get_pg_size(data_parallel_group):
            raise ValueError(
                f"GradBuffer: shard_size={shard_size} differs from the size of its "
                f"data_parallel_group ({get_pg_size(data_parallel_group)}); expected equal"
            )
        self.data_parallel_group = data_parallel_group
        self.gradient_scaling_factor = gradient_scaling_factor
        self.params = list(reversed(params))
        self.grad_dtype = grad_dtype
        self.param_dtype = self.params[0].dtype
        self.shard_size = shard_size
        layout = _bucket_layout(self.params, bucket_size, shard_size)
        numel = layout[-1][1] if layout else 0
        device = self.params[0].device
        self.data = torch.zeros(numel, dtype=grad_dtype, device=device)
        self.param_data: Optional[torch.Tensor] = None
        if shard_size is not None:
            self.param_data = torch.zeros(numel, dtype=self.param_dtype, device=device)
        self.buckets: List[GradBucket] = []
        self.param_to_bucket: Dict[torch.nn.Parameter, GradBucket] = {}
        self.param_ranges: Dict[torch.nn.Parameter, Tuple[int, int]] = {}
        for start, end, members in layout:
            offset = start
            for param in members:
                lo, hi = offset, offset + param.numel()
                self.param_ranges[param] = (lo, hi)
                param.main_grad = self.data[lo:hi].view(param.shape)
                if self.param_data is not None:
                    view = self.param_data[lo:hi].view(param.shape)
                    view.copy_(param.data)
                    param.data = view
                offset = hi
            bucket = GradBucket(
                members,
                self.data[start:end],
                len(self.buckets),
                start,
                None if self.param_data is None else self.param_data[start:end],
            )
            bucket.buffer = self
            self.buckets.append(bucket)
            self.param_to_bucket.update({p: bucket for p in members})


def _bucket_layout(
    params: List[torch.nn.Parameter], bucket_size: Optional[int], shard_size: Optional[int]
) -> List[Tuple[int, int, List[torch.nn.Parameter]]]:
    """``(start, end, params)`` per bucket: a bucket closes once it holds ``bucket_size``
    elements (or at the end); with ``shard_size`` its end is padded up to a multiple of it and
    a ``shared_embedding`` parameter closes the bucket before and after itself."""
    layout: List[Tuple[int, int, List[torch.nn.Parameter]]] = []
    start, offset, members = 0, 0, []

    def close() -> None:
        nonlocal start, offset, members
        if not members:
            return
        end = offset
        if shard_size is not None:
            end = -(-offset // shard_size) * shard_size
        layout.append((start, end, members))
        start = offset = end
        members = []

    for param in params:
        alone = shard_size is not None and getattr(param, "shared_embedding", False)
        if alone:
            close()
        members.append(param)
        offset += param.numel()
        if alone or (bucket_size is not None and offset - start >= bucket_size):
            close()
    close()
    return layout


def reduce_bucket(
    bucket: GradBucket,
    group: Optional[dist.ProcessGroup],
    pre_scale: float,
    average: bool,
    async_op: bool,
    scatter: bool = False,
) -> None:
    """Start reducing ``bucket`` over ``group``: SUM of pre-scaled grads, or AVG.

    ``scatter`` (distributed optimizer): only this rank's shard of the bucket is guaranteed
    to hold the result (``communication.start_reduce_scatter_shard_``; on gloo the whole
    bucket is all-reduced). AVG where the backend lacks it is SUM then division
    (``communication``).
    """
    bucket.launched = True
    if pre_scale != 1.0:
        bucket.grad_data.mul_(pre_scale)
    if get_pg_size(group) == 1:
        return
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    start = start_reduce_scatter_shard_ if scatter else start_all_reduce_
    bucket.handle = start(bucket.grad_data, group, op)
    if not async_op:
        wait_bucket(bucket)


def wait_bucket(bucket: GradBucket) -> None:
    """Wait for the bucket's reduction (if one is in flight)."""
    if bucket.handle is not None:
        bucket.handle.wait()
    bucket.handle = None


def gather_bucket_params(
    bucket: GradBucket, group: Optional[dist.ProcessGroup], async_op: bool
) -> None:
    """Start all-gathering the bucket's parameter shards over ``group`` (distributed
    optimizer): afterwards every rank's ``param_data`` slice holds every rank's shard."""
    bucket.gather_handle = None
    if get_pg_size(group) == 1:
        return
    bucket.gather_handle = start_all_gather_shards_(bucket.param_data, group)
    if not async_op:
        wait_param_gather(bucket)


def wait_param_gather(bucket: GradBucket) -> None:
    """Wait for the bucket's parameter all-gather (if one is in flight)."""
    if bucket.gather_handle is not None:
        bucket.gather_handle.wait()
    bucket.gather_handle = None
