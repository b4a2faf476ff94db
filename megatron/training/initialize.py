"""Process groups of a run: torch.distributed, the model-parallel layout, and the groups of
the one-process comparison run.

Groups are handed to the model, DDP, the schedule and the optimizer explicitly, as a
``ProcessGroupCollection`` (SPEC section 3); a run without torch.distributed (one process,
no torchrun) has no groups at all (``None``).
"""

import gc
import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.device import choose_backend
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe import moe_utils
from megatron.training.arguments import Layout, TrainingConfig

TIMEOUT = timedelta(minutes=10)


def launched_world_size() -> Optional[int]:
    """WORLD_SIZE when started by torchrun (or already initialized), else None."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def initialize_distributed(config: TrainingConfig, layout: Layout) -> bool:
    """Start torch.distributed for a torchrun launch; returns True when this call created
    the default group (the caller then destroys it).

    Backend (``device.choose_backend``): nccl when asked, or with ``auto`` when every local
    process has its own GPU (``torch.cuda.set_device(LOCAL_RANK)``); gloo otherwise, with
    ``cpu_count / LOCAL_WORLD_SIZE`` threads per process. An existing default group is
    reused.
    """
    if dist.is_initialized():
        return False
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
    backend = choose_backend(config.distributed_backend, local_world)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(backend, timeout=TIMEOUT)
    return True


def initialize_single_gpu(config: TrainingConfig) -> bool:
    """A run without torchrun: when ``--distributed-backend`` (``auto`` with a GPU, or
    ``nccl``) means the GPU, start a one-process nccl group (an in-memory store, no
    rendezvous) so that the run computes on ``cuda:0``; returns True when it did (the
    caller destroys the group). With gloo, or ``auto`` without a GPU, nothing is started:
    the run stays on the CPU without torch.distributed."""
    if dist.is_initialized() or choose_backend(config.distributed_backend, 1) != "nccl":
        return False
    if not torch.cuda.is_available():
        raise ValueError(
            "--distributed-backend nccl needs a CUDA GPU, and torch.cuda.is_available() is "
            "False; use --distributed-backend gloo (or auto) on this machine"
        )
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=TIMEOUT)
    return True


def tear_down_distributed(created_group: bool) -> None:
    """The end of a run: forget the model-parallel state and, when the run created the
    default group, destroy it (the groups cached for it go too:
    ``parallel_state.destroy_model_parallel``); then free, while the interpreter is whole,
    the run's objects that still hold groups (the MoE aux-loss tracker keeps its entries'
    groups). A gloo group's threads stop only when its last reference goes; left to
    interpreter exit, they can meet a half-finalized interpreter and abort the process
    after a successful run."""
    if created_group:
        dist.destroy_process_group()
    parallel_state.destroy_model_parallel()
    moe_utils.reset_aux_losses_tracker()
    gc.collect()


def initialize_model_parallel_groups(layout: Layout) -> ProcessGroupCollection:
    """``initialize_model_parallel`` for ``layout``; returns its groups as a collection."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        hierarchical_context_parallel_sizes=layout.hierarchical_sizes,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
        distributed_timeout_minutes=int(TIMEOUT.total_seconds() // 60),
    )
    return ProcessGroupCollection.use_mpu_process_groups()


def single_process_groups(rank: int = 0) -> Optional[ProcessGroupCollection]:
    """Groups for a one-process run on global rank ``rank`` inside a larger world.

    Every rank must call this (``new_group`` is collective); ``rank`` gets a collection
    whose groups all hold only itself (no embedding groups: one stage holds everything),
    the others get None. Without torch.distributed it returns None: no groups are needed.
    """
    if not dist.is_initialized():
        return None
    group = dist.new_group([rank], timeout=TIMEOUT)
    if dist.get_rank() != rank:
        return None
    names = ("tp", "pp", "mp", "cp", "tp_cp", "tp_dp_cp", "dp", "dp_cp", "intra_dp_cp")
    names += ("ep", "expt_tp", "tp_ep", "tp_ep_pp", "expt_dp", "intra_expt_dp")
    return ProcessGroupCollection(**{name: group for name in names})


def is_rank_zero() -> bool:
    """True on global rank 0, or without torch.distributed."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only (megatron's name)."""
    if is_rank_zero():
        print(message, flush=True)
