"""A PP=2, CP=2 1F1B step on 4 ranks in which one rank raises inside forward_step_func.

Launched by ``tests/unit_tests/test_fault_launch.py`` as
``torchrun --nproc-per-node 4 -m tests.unit_tests.fault_scripts.forward_raises_mid_schedule``
from the repository root. Rank ``FAULT_RANK`` raises at microbatch ``FAULT_MICROBATCH``
while its peers wait for it in pipeline messages and reductions; the launch must end with
a non-zero exit. Blocked peers also fail on their own after the 30 s gloo timeout.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from tests.unit_tests import parity
from tests.unit_tests.parity import Case, run_step

FAULT_RANK, FAULT_MICROBATCH = 1, 2
MESSAGE = "injected fault: forward_step_func failed on rank {rank} at microbatch {microbatch}"


def failing_schedules(rank: int):
    """``get_forward_backward_func`` whose schedules wrap ``forward_step_func`` so that it
    raises on ``FAULT_RANK`` at its ``FAULT_MICROBATCH``-th call."""
    real = parity.get_forward_backward_func

    def get(pp_size=None, vp_size=None):
        schedule = real(pp_size, vp_size)

        def run(*, forward_step_func, **kwargs):
            calls = [0]

            def forward(data_iterator, model):
                microbatch, calls[0] = calls[0], calls[0] + 1
                if rank == FAULT_RANK and microbatch == FAULT_MICROBATCH:
                    raise RuntimeError(MESSAGE.format(rank=rank, microbatch=microbatch))
                return forward_step_func(data_iterator, model)

            return schedule(forward_step_func=forward, **kwargs)

        return run

    return get


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=2, context_parallel_size=2
    )
    rank = dist.get_rank()
    parity.get_forward_backward_func = failing_schedules(rank)
    run_step(Case(cp=2, pp=2, microbatches=4, mask="uneven"))
    print(f"rank {rank}: step finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
