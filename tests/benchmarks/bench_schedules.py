"""Framework cost of the pipeline schedules and their activation memory, on CPU (gloo).

Run it with torchrun; the world size is the pipeline size (1: no pipelining)::

    torchrun --standalone --nproc-per-node 1 tests/benchmarks/bench_schedules.py  # no pipelining
    torchrun --standalone --nproc-per-node 2 tests/benchmarks/bench_schedules.py  # 1F1B, PP=2
    torchrun --standalone --nproc-per-node 4 tests/benchmarks/bench_schedules.py  # 1F1B, PP=4
    torchrun --standalone --nproc-per-node 2 tests/benchmarks/bench_schedules.py --vpp 2

The same script measures megatron-core 0.16.1 when run with its interpreter, by path (so that
this repository is not on ``sys.path``): ``/opt/mcore/bin/torchrun --standalone --nproc-per-node 2
tests/benchmarks/bench_schedules.py``. megatron-core hard-codes CUDA in a few places; the
documented CPU shim of ``bench_common.install_mcore_cpu_shim`` is installed for it.
Only public API common to both is used (parallel_state, get_forward_backward_func,
TransformerConfig, DistributedDataParallel, finalize_model_grads).

Two measurements:

1. Time. A near-zero-compute model (each stage multiplies an [8, 1, 16] activation by a
   16-element weight) runs M = 64 microbatches per step. Three variants alternate step by
   step: ``bare`` (world 1 only: a plain forward/backward loop, no framework), ``schedule``
   (the schedule on the plain module) and ``schedule+ddp`` (DDP-wrapped chunks, no_sync and
   finalize_model_grads, as a training loop runs it). Reported per microbatch per stage:
   the median over steps of the slowest rank's wall time / M, and of its process CPU time /
   M (all threads; excludes time blocked in waits, so it is the framework's own work
   without the OS's scheduling noise), and of its main thread's CPU time / M (the
   schedule's Python and the ops it runs, without gloo's communication threads).
2. Memory. The same model with [1024, 1, 256] float32 activations (A = 1 MiB) and
   M = 8: each stage saves its input and one intermediate (2A per microbatch in flight) and
   sends a fresh output (A). Reported per stage: the peak growth of live CPU bytes during one
   step (``bench_common.peak_cpu_bytes``: torch allocator events from the profiler), with
   ``deallocate_pipeline_outputs`` off and on.
"""

import argparse
import gc
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
from bench_common import (
    all_max,
    append_json,
    framework,
    init_distributed,
    install_mcore_cpu_shim,
    machine,
    median,
    peak_cpu_bytes,
    quartiles,
    say,
    table,
)

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig


class TinyStage(torch.nn.Module):
    """One pipeline chunk: ``out = (x * w) * w`` on [s, b, h] (x from data on the first
    stage, else the received activation); saves x and x * w for the backward."""

    def __init__(self, config, pre_process: bool, post_process: bool) -> None:
        super().__init__()
        self.config, self.pre_process, self.post_process = config, pre_process, post_process
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False
        self.weight = torch.nn.Parameter(torch.ones(config.hidden_size))
        self.input_tensor = None

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, x):
        h = x if self.pre_process else self.input_tensor
        return (h * self.weight) * self.weight


def loss_func(output):
    """Three values: this stage's loss sum, its token count, and a reported entry."""
    loss_sum = output.sum()
    return loss_sum, torch.tensor(output.shape[0], dtype=torch.int), {"loss": loss_sum.detach()}


def make_forward_step(shape):
    def forward_step(data_iterator, model):
        next(data_iterator)
        x = torch.ones(shape)  # the first stage's input, made per microbatch
        return model(x), loss_func

    return forward_step


def config_for(pp: int, vpp, hidden: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=pp * (vpp or 1),
        hidden_size=hidden,
        num_attention_heads=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def build(pp: int, vpp, hidden: int, ddp: bool):
    """This rank's chunks (DDP-wrapped or plain) and their config, hooks set."""
    config = config_for(pp, vpp, hidden)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for v in range(vpp or 1):
        stage = v * pp + rank
        chunk = TinyStage(config, stage == 0, stage == pp * (vpp or 1) - 1)
        if ddp:
            chunk = DistributedDataParallel(config, DistributedDataParallelConfig(), chunk)
        chunks.append(chunk)
    if ddp:
        config.no_sync_func = [c.no_sync for c in chunks] if vpp else chunks[0].no_sync
        config.finalize_model_grads_func = finalize_model_grads
    return config, chunks


def run_schedule(chunks, vpp, forward_step, microbatches: int, seq: int) -> None:
    """One step of the schedule for this layout."""
    schedule = get_forward_backward_func()
    iterators = [iter(range(microbatches)) for _ in chunks]
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        else:
            chunk.zero_grad(set_to_none=True)
    schedule(
        forward_step_func=forward_step,
        data_iterator=iterators if vpp else iterators[0],
        model=chunks if vpp else chunks[0],
        num_microbatches=microbatches,
        seq_length=seq,
        micro_batch_size=1,
    )


def run_bare(model, shape, microbatches: int) -> None:
    """The floor: the same model and loss in a plain loop, no framework."""
    model.zero_grad(set_to_none=True)
    for _ in range(microbatches):
        output = model(torch.ones(shape))
        loss_sum, num_tokens, _ = loss_func(output)
        (loss_sum / num_tokens.clamp(min=1) / microbatches).backward()


def time_variants(args, pp: int, vpp) -> Dict[str, Dict[str, float]]:
    """Alternate the variants step by step; per microbatch per stage wall and CPU times."""
    seq, hidden = 8, 16
    shape = (seq, 1, hidden)
    forward_step = make_forward_step(shape)
    variants = {}
    if pp == 1:
        bare_config = config_for(1, None, hidden)
        bare_model = TinyStage(bare_config, True, True)
        variants["bare"] = lambda: run_bare(bare_model, shape, args.microbatches)
    for name, ddp in (("schedule", False), ("schedule+ddp", True)):
        _, chunks = build(pp, vpp, hidden, ddp)
        variants[name] = lambda chunks=chunks: run_schedule(
            chunks, vpp, forward_step, args.microbatches, seq
        )
    samples: Dict[str, List[List[float]]] = {name: [] for name in variants}
    for step in range(args.warmup + args.steps):
        for name, fn in variants.items():
            gc.collect()  # as timeit does: no garbage-collection pauses inside a timed step
            gc.disable()
            dist.barrier()
            wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
            fn()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            main = time.thread_time() - main
            gc.enable()
            if step >= args.warmup:
                samples[name].append([wall, cpu, main])
    results = {}
    for name, values in samples.items():
        maxed = [all_max(v) for v in values]  # the slowest rank of each step
        per_mb = 1e6 / args.microbatches
        walls = [w * per_mb for w, _, _ in maxed]
        cpus = [c * per_mb for _, c, _ in maxed]
        mains = [t * per_mb for _, _, t in maxed]
        calls = all_max(count_calls(variants[name]))
        results[name] = {
            "wall_us": median(walls),
            "wall_q": quartiles(walls),
            "cpu_us": median(cpus),
            "cpu_q": quartiles(cpus),
            "main_us": median(mains),
            "main_q": quartiles(mains),
            "py_calls": calls[0] / args.microbatches,
            "c_calls": calls[1] / args.microbatches,
        }
    return results


def count_calls(fn) -> List[float]:
    """[Python function calls, C function calls made from Python] during ``fn()``: the
    framework's interpreted work, counted exactly (no timing noise)."""
    counts = [0, 0]

    def profiler(frame, event, arg):
        if event == "call":
            counts[0] += 1
        elif event == "c_call":
            counts[1] += 1

    dist.barrier()
    sys.setprofile(profiler)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return [float(c) for c in counts]


def measure_memory(args, pp: int, vpp) -> Dict[str, List[float]]:
    """Peak live CPU MiB per stage during one step, deallocation off and on."""
    seq, hidden = 1024, 256
    shape = (seq, 1, hidden)
    forward_step = make_forward_step(shape)
    config, chunks = build(pp, vpp, hidden, ddp=True)
    results = {}
    for dealloc in (False, True):
        config.deallocate_pipeline_outputs = dealloc
        step = lambda: run_schedule(  # noqa: E731
            chunks, vpp, forward_step, args.memory_microbatches, seq
        )
        step()  # warm-up (first-call allocations)
        dist.barrier()
        peak = peak_cpu_bytes(step) / 2**20
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, peak)
        results["dealloc" if dealloc else "no-dealloc"] = everyone
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline size")
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--memory-microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", default=None, help="append one JSON line of results here")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    args = parser.parse_args()

    torch.set_num_threads(1)
    init_distributed("gloo")
    fw = framework()
    shim = install_mcore_cpu_shim() if fw["name"] == "megatron-core" else []
    pp = dist.get_world_size()
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=args.vpp
    )
    schedule = get_forward_backward_func().__name__
    say(f"# bench_schedules: {fw['name']} {fw['version']}, PP={pp}, VPP={args.vpp}, {schedule}")
    say(f"# machine: {machine()}")
    if shim:
        say(f"# CPU shim for megatron-core: {'; '.join(shim)}")
    say(f"# M={args.microbatches}, {args.steps} timed steps per variant after {args.warmup}")

    times = time_variants(args, pp, args.vpp)
    rows = []
    for name, r in times.items():
        rows.append(
            [
                name,
                f"{r['wall_us']:.0f}",
                f"{r['wall_q'][0]:.0f}-{r['wall_q'][1]:.0f}",
                f"{r['cpu_us']:.0f}",
                f"{r['cpu_q'][0]:.0f}-{r['cpu_q'][1]:.0f}",
                f"{r['main_us']:.0f}",
                f"{r['py_calls']:.1f}",
                f"{r['c_calls']:.1f}",
            ]
        )
    say(
        table(
            [
                "variant",
                "wall us/mb/stage",
                "wall IQR",
                "CPU us/mb/stage",
                "CPU IQR",
                "main-thread CPU us/mb/stage",
                "Python calls/mb",
                "C calls/mb",
            ],
            rows,
        )
    )
    memory = {} if args.no_memory else measure_memory(args, pp, args.vpp)
    if memory:
        say(
            f"# peak live CPU MiB per stage (A = 1 MiB activation, "
            f"M={args.memory_microbatches})"
        )
        say(
            table(
                ["deallocate_pipeline_outputs"] + [f"stage {r}" for r in range(pp)],
                [[k] + [f"{v:.1f}" for v in vals] for k, vals in memory.items()],
            )
        )
    append_json(
        args.json,
        {
            "framework": fw["name"],
            "schedule": schedule,
            "pp": pp,
            "vpp": args.vpp,
            "microbatches": args.microbatches,
            "steps": args.steps,
            "times": times,
            "memory_mib": memory,
        },
    )
    dist.barrier()  # every rank done before any tears its groups down
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
