"""Main-thread CPU time of the 1F1B schedule, per pipeline stage, with or without cProfile.

    torchrun --standalone --nproc-per-node 4 tests/benchmarks/profile_schedule.py [--profile]
    /opt/mcore/bin/torchrun --standalone --nproc-per-node 4 \\
        tests/benchmarks/profile_schedule.py [--profile]      # megatron-core 0.16.1

The model, data and schedule call are ``bench_schedules.py``'s (a near-zero-compute stage,
M = 64, no DDP). After 5 warm-up steps, ``--steps`` steps run back to back; each rank
prints the main thread's CPU time (``time.thread_time``) and the process's (all threads,
gloo's included) per microbatch and, with
``--profile``, the 25 functions with the most internal time (cProfile adds a cost per
Python call, so the profiled time favours the side that makes fewer calls).
"""

import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.distributed as dist
from bench_common import framework, init_distributed, install_mcore_cpu_shim
from bench_schedules import build, make_forward_step, run_schedule

from megatron.core import parallel_state

MICROBATCHES, SEQ, HIDDEN = 64, 8, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_distributed("gloo")
    fw = framework()
    if fw["name"] == "megatron-core":
        install_mcore_cpu_shim()
    pp = dist.get_world_size()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    forward_step = make_forward_step((SEQ, 1, HIDDEN))
    _, chunks = build(pp, None, HIDDEN, ddp=False)
    for _ in range(5):
        run_schedule(chunks, None, forward_step, MICROBATCHES, SEQ)
    dist.barrier()
    profiler = cProfile.Profile() if args.profile else None
    start, process_start = time.thread_time(), time.process_time()
    if profiler:
        profiler.enable()
    for _ in range(args.steps):
        run_schedule(chunks, None, forward_step, MICROBATCHES, SEQ)
    if profiler:
        profiler.disable()
    scale = 1e6 / (args.steps * MICROBATCHES)
    main_us = (time.thread_time() - start) * scale
    process_us = (time.process_time() - process_start) * scale
    report = (
        f"{fw['name']} stage {dist.get_rank()}: main-thread CPU {main_us:.0f} us/mb, "
        f"process CPU (all threads) {process_us:.0f} us/mb"
    )
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        report += " (under cProfile)\n" + text.getvalue()
    for rank in range(pp):  # one rank at a time, in order
        if rank == dist.get_rank():
            print(report, flush=True)
        dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
