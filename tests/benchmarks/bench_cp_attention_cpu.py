"""CP attention on CPUs: seconds and aten operations per forward+backward call.

The A/B check for refactors of ``megatron.core.transformer.cp_attention`` (the GPU benchmark
is ``bench_cp_attention.py``): at short sequences a call is bound by how many operations the
CPU issues, so the count of aten operations per call (exact, noise-free) and the median time
per call show whether a change costs anything. Run the same command with ``PYTHONPATH`` at
each tree, alternating, on an otherwise idle machine:

    OMP_NUM_THREADS=1 PYTHONPATH=TREE python tests/benchmarks/bench_cp_attention_cpu.py
    OMP_NUM_THREADS=1 PYTHONPATH=TREE torchrun --nproc-per-node 2 \
        tests/benchmarks/bench_cp_attention_cpu.py

It prints one line per (cp_comm_type, dtype): ops per call, median wall and process-CPU ms per
call (rank 0; the CPU time is the steadier one on a shared machine).
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.transformer.cp_attention import context_parallel_attention


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def one_call(q, k, v, group, comm):
    """Forward and backward of one attention call."""
    out = context_parallel_attention(q, k, v, cp_group=group, cp_comm_type=comm)
    out.sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=512, help="local sequence length")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    group = None
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        group = dist.group.WORLD
    comms = ["all_gather", "p2p", "a2a"] if group is not None else ["all_gather"]
    for comm in comms:
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(0)
            shape = (args.seq, 1, args.heads, args.dim)
            q, k, v = (
                torch.randn(shape, generator=gen).to(dtype).requires_grad_(True) for _ in range(3)
            )
            one_call(q, k, v, group, comm)  # warm-up
            counter = _CountOps()
            with counter:
                one_call(q, k, v, group, comm)
            wall, cpu = [], []
            for _ in range(args.iters):
                if group is not None:
                    dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                one_call(q, k, v, group, comm)
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            if group is None or dist.get_rank() == 0:
                name = str(dtype).replace("torch.", "")
                ms, cpu_ms = (1e3 * statistics.median(x) for x in (wall, cpu))
                print(
                    f"{comm:10s} {name:8s} ops/call {counter.count:4d}  ms/call {ms:8.2f}  "
                    f"cpu ms/call {cpu_ms:8.2f}"
                )
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
