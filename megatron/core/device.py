"""The one place that decides which device tensors of a collective live on.

gloo works on CPU tensors; nccl on the current CUDA device. Everything else asks here.
A group initialized without a backend (``init_process_group()``: torch's lazy "undefined"
backend, as megatron-core's simple example does) creates nccl for CUDA tensors on first use,
so it counts as nccl when CUDA is available.
"""

from typing import Optional

import torch
import torch.distributed as dist


def comm_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Device for tensors exchanged over ``group`` (or the default group).

    nccl (or the lazy "undefined" backend with CUDA available) ->
    ``torch.cuda.current_device()``; gloo or no distributed init -> CPU.
    """
    if dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend(group)).lower()
        if "nccl" in backend or (backend == "undefined" and torch.cuda.is_available()):
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def choose_backend(requested: str, local_processes: int = 1) -> str:
    """The backend a launch of ``local_processes`` processes per node gets for ``requested``:
    "gloo" and "nccl" as asked; "auto" -> nccl when CUDA is available with a GPU for each
    local process, else gloo."""
    if requested not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend {requested!r}: expected 'auto', 'gloo' or 'nccl'")
    if requested != "auto":
        return requested
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= local_processes
    return "nccl" if enough else "gloo"


def describe_device(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H200)`` or ``cpu``: the device a run computes on, for its log."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def supports_avg(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether ``ReduceOp.AVG`` works on ``group`` (nccl has it, gloo does not)."""
    return comm_device(group).type != "cpu"
