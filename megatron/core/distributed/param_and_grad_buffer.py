"""Contiguous gradient buffers split into buckets that are reduced as one tensor each."""

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core.device import supports_avg


class GradBucket:
    """A slice of a gradient buffer holding the ``main_grad`` of some parameters.

    Reduction: ``grad <- op_{dp_cp}(grad * pre_scale)``, then ``/ size`` where AVG must be
    emulated (gloo has no AVG).
    """

    def __init__(self, params: List[torch.nn.Parameter], grad_data: torch.Tensor, index: int):
        self.params, self.grad_data, self.index = params, grad_data, index
        self.ready: set = set()
        self.handle: Optional[dist.Work] = None
        self.launched, self.post_divisor = False, 1

    def reset(self) -> None:
        """Forget readiness and in-flight reductions (start of a new iteration)."""
        self.ready.clear()
        self.handle, self.launched, self.post_divisor = None, False, 1


class GradBuffer:
    """One contiguous buffer per gradient dtype; parameters are laid out in reverse order of
    registration (roughly the order their gradients arrive) and cut into buckets of at least
    ``bucket_size`` elements (one bucket when None)."""

    def __init__(
        self,
        params: List[torch.nn.Parameter],
        grad_dtype: torch.dtype,
        bucket_size: Optional[int],
    ) -> None:
        self.params = list(reversed(params))
        numel = sum(p.numel() for p in self.params)
        self.data = torch.zeros(numel, dtype=grad_dtype, device=self.params[0].device)
        self.buckets: List[GradBucket] = []
        self.param_to_bucket: Dict[torch.nn.Parameter, GradBucket] = {}
        start, offset, members = 0, 0, []
        for i, param in enumerate(self.params):
            param.main_grad = self.data[offset : offset + param.numel()].view(param.shape)
            offset += param.numel()
            members.append(param)
            last = i == len(self.params) - 1
            if last or (bucket_size is not None and offset - start >= bucket_size):
                bucket = GradBucket(members, self.data[start:offset], len(self.buckets))
                self.buckets.append(bucket)
                self.param_to_bucket.update({p: bucket for p in members})
                start, members = offset, []


def reduce_bucket(
    bucket: GradBucket,
    group: Optional[dist.ProcessGroup],
    pre_scale: float,
    average: bool,
    async_op: bool,
) -> None:
    """Start reducing ``bucket`` over ``group``: SUM of pre-scaled grads, or AVG.

    AVG runs in the collective where the backend has it, else as SUM then division.
    """
    bucket.launched = True
    if pre_scale != 1.0:
        bucket.grad_data.mul_(pre_scale)
    if group is None or group.size() == 1:
        return
    op = dist.ReduceOp.SUM
    if average:
        if supports_avg(group):
            op = dist.ReduceOp.AVG
        else:
            bucket.post_divisor = group.size()
    bucket.handle = dist.all_reduce(bucket.grad_data, op=op, group=group, async_op=async_op)


def wait_bucket(bucket: GradBucket) -> None:
    """Wait for the bucket's reduction and apply any division left to do."""
    if bucket.handle is not None and hasattr(bucket.handle, "wait"):
        bucket.handle.wait()
    if bucket.post_divisor != 1:
        bucket.grad_data.div_(bucket.post_divisor)
