"""The one place that decides which device tensors of a collective live on.

gloo works on CPU tensors; nccl on the current CUDA device. Everything else asks here.
"""

from typing import Optional

import torch
import torch.distributed as dist


def comm_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Device for tensors exchanged over ``group`` (or the default group).

    nccl -> ``torch.cuda.current_device()``; gloo or no distributed init -> CPU.
    """
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend(group)
        if "nccl" in str(backend).lower():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def supports_avg(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether ``ReduceOp.AVG`` works on ``group`` (nccl has it, gloo does not)."""
    return comm_device(group).type != "cpu"
