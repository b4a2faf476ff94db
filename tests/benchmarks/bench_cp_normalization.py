"""What the context-parallel loss normalization costs in a GPT training step (A/B, CPU).

    torchrun --standalone --nproc-per-node 4 tests/benchmarks/bench_cp_normalization.py

For every layout (C, PP, D) with C in {2, 4} and PP in {1, 2} that fits the world size
(4 ranks: C2-PP1-D2, C4-PP1-D1, C2-PP2-D1; 8 ranks add C4-PP2-D1 and D=2 variants), one GPT
training step (M microbatches through the schedule, DDP, finalize_model_grads, an SGD
update) runs alternately as

- A: ``reduce_loss_across_cp`` as shipped (one scalar all-reduce of the valid-token count
  over the CP group per microbatch, on the last pipeline stage);
- B: the same step with ``schedules.reduce_loss_across_cp`` replaced (monkeypatched) by a
  version that uses the local count, ``loss_sum * C / max(N_c, 1)``, with no collective.

Steps alternate A,B,B,A,A,B,... after a warm-up; each step starts after a barrier, with
Python's garbage collector paused inside it (as ``timeit`` does), and its time is the slowest
rank's. The table gives, per layout, the medians and interquartile ranges, the ratio of the
medians, the median of the ratios of adjacent A/B pairs (less sensitive to slow drifts of
the machine's load), and the isolated cost of one count all-reduce (a tight loop of calls
over the CP group) with what M such calls are of a B step. The last line is
``RESULT overhead_ratio=<max over layouts of median(A) / median(B)>`` (target <= 1.02);
each ratio comes with a bootstrap 95% interval. Two CPU columns price where the time goes:
A/B of the process CPU time of all ranks together per step (work done, gloo's threads
included), and the share of the machine's cores B kept busy (the rest waited). The data
are SFT-like: a random-length prompt of each sequence is masked out of the loss, so the CP
shards hold unequal numbers of valid tokens.

Step size. The default (8 layers, sequence 1024: 17 CP collectives and 0.85-1.7 s per
microbatch on 2 shared cores) replaced ``--layers 4 --seq 512`` (9 collectives, 0.2-0.35 s)
on the hypothesis that the extra meeting of the CP peers costs a fixed scheduler delay and
so matters less in a larger step. The 24-step runs did not bear that out for C4-PP1-D1 on
2 cores (+1.0-3.6% at L4, L8 and L16 alike); a 100-step run (``--steps 100``, 50 minutes)
put every layout at 0.99-1.00. docs/performance.md has every run.

GPUs: ``--backend nccl`` puts each rank on its own GPU (bf16 parameters, fp32 ``main_grad``)
and brackets each step with ``torch.cuda.synchronize``; there the all-reduce is enqueued on
a stream and the host does not wait for it. Example (2 GPUs, C2-PP1-D1)::

    torchrun --standalone --nproc-per-node 2 tests/benchmarks/bench_cp_normalization.py \
        --backend nccl --hidden 2048 --heads 16 --seq 8192 --vocab 32768
"""

import argparse
import gc
import json
import os
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from bench_common import (
    all_max,
    all_sum,
    git_commit,
    gpt_forward_step,
    init_distributed,
    machine,
    median,
    quartiles,
    ratio_interval,
    say,
    synchronize,
    table,
)

from megatron.core import parallel_state
from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.device import comm_device
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

SHIPPED = schedules.reduce_loss_across_cp
LOCAL_CALLS = [0]


def reduce_loss_local_count(loss_sum, num_tokens, cp_group):
    """B: ``loss_sum * C / max(N_c, 1)`` with this shard's count; no collective."""
    LOCAL_CALLS[0] += 1
    cp_size = 1 if cp_group is None else cp_group.size()
    count = torch.clamp(num_tokens.detach().to(loss_sum.dtype), min=1.0)
    return loss_sum * cp_size / count


def layouts(world: int) -> List[Tuple[int, int, int]]:
    """(C, PP, D) with C in {2, 4}, PP in {1, 2}, D = world / (C * PP) a whole number."""
    found = []
    for pp in (1, 2):
        for cp in (2, 4):
            if world % (cp * pp) == 0:
                found.append((cp, pp, world // (cp * pp)))
    return found


def build(args, cp: int, pp: int):
    """This rank's DDP-wrapped GPT chunk, its config and the explicit groups."""
    groups = ProcessGroupCollection.use_mpu_process_groups()
    pp_rank = groups.pp.rank()
    dtype = torch.bfloat16 if args.backend == "nccl" else torch.float32
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        context_parallel_size=cp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        deallocate_pipeline_outputs=True,
    )
    gpt = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        pg_collection=groups,
        pp_rank=pp_rank,
    )
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt, pg_collection=groups
    )
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddp, config, groups


def microbatches(args, groups) -> List[Dict[str, torch.Tensor]]:
    """This rank's shards of its data-parallel replica's M microbatches (SFT-like masks)."""
    dp_rank = parallel_state.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(1234 + dp_rank)
    batches = []
    for _ in range(args.microbatches):
        tokens = torch.randint(0, args.vocab, (1, args.seq), generator=gen)
        labels = torch.randint(0, args.vocab, (1, args.seq), generator=gen)
        prompt = int(torch.randint(args.seq // 8, args.seq // 2, (1,), generator=gen))
        mask = (torch.arange(args.seq) >= prompt).float().view(1, -1)
        positions = torch.arange(args.seq).view(1, -1)
        batch = {"tokens": tokens, "labels": labels, "loss_mask": mask, "positions": positions}
        shard = get_batch_on_this_cp_rank(batch, groups.cp)
        batches.append({k: v.to(comm_device()) for k, v in shard.items()})
    return batches


def train_step(args, model, data) -> Tuple[float, float]:
    """One step (zero grads, schedule, finalize, SGD); returns this rank's wall seconds and
    its process CPU seconds (all threads, gloo's included)."""
    schedule = get_forward_backward_func()
    gc.collect()  # as timeit does: no garbage-collection pauses inside the timed step
    gc.disable()
    synchronize()
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    model.zero_grad_buffer()
    schedule(
        forward_step_func=gpt_forward_step,
        data_iterator=iter(data),
        model=model,
        num_microbatches=args.microbatches,
        seq_length=args.seq,
        micro_batch_size=1,
    )
    with torch.no_grad():
        for param in model.parameters():
            param.add_(param.main_grad.to(param.dtype), alpha=-1e-4)
    synchronize()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    gc.enable()
    return seconds, cpu_seconds


def count_allreduce_cost(groups, calls: int = 200) -> Tuple[float, float]:
    """Seconds per call of the shipped and the local-count normalization, back to back on
    every rank of each CP group (a tight loop: the isolated cost of the all-reduce)."""
    device = comm_device()
    loss_sum = torch.tensor(3.0, device=device, requires_grad=True)
    num_tokens = torch.tensor(7, device=device)
    seconds = []
    for fn in (SHIPPED, reduce_loss_local_count):
        per_call = []
        for _ in range(5):
            synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                fn(loss_sum, num_tokens, groups.cp)
            synchronize()
            per_call.append((time.perf_counter() - start) / calls)
        seconds.append(median(all_max(per_call)))
    return seconds[0], seconds[1]


def reduce_loss_local_count_synced(loss_sum, num_tokens, cp_group):
    """C (control, ``--sync-control``): B plus the same scalar all-reduce over the CP group,
    its result unused: prices the synchronization point alone."""
    if cp_group is not None and cp_group.size() > 1:
        dist.all_reduce(num_tokens.detach().clone(), group=cp_group)
    return reduce_loss_local_count(loss_sum, num_tokens, cp_group)


VARIANTS = {"A": SHIPPED, "B": reduce_loss_local_count, "C": reduce_loss_local_count_synced}


def bench_layout(args, cp: int, pp: int) -> dict:
    """A/B (and C) step times of one layout."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp, context_parallel_size=cp
    )
    model, config, groups = build(args, cp, pp)
    data = microbatches(args, groups)
    names = "ABC" if args.sync_control else "AB"
    times = {name: [] for name in names}
    cpu = {name: [] for name in names}  # process CPU seconds of all ranks together
    calls_before = LOCAL_CALLS[0]
    for step in range(args.warmup + args.steps):
        for variant in names if step % 2 == 0 else names[::-1]:
            schedules.reduce_loss_across_cp = VARIANTS[variant]
            try:
                seconds, cpu_seconds = train_step(args, model, data)
            finally:
                schedules.reduce_loss_across_cp = SHIPPED
            if step >= args.warmup:
                times[variant].append(all_max([seconds])[0])
                cpu[variant].append(all_sum(cpu_seconds))
    is_last = groups.pp.rank() == pp - 1
    expected_calls = (len(names) - 1) * (args.warmup + args.steps) * args.microbatches
    if LOCAL_CALLS[0] - calls_before != (expected_calls if is_last else 0):
        raise RuntimeError(
            f"the local-count replacement ran {LOCAL_CALLS[0] - calls_before} times, "
            f"expected {expected_calls if is_last else 0}"
        )
    shipped_call, local_call = count_allreduce_cost(groups)
    a, b = median(times["A"]), median(times["B"])
    result = {
        "layout": f"C{cp}-PP{pp}-D{parallel_state.get_data_parallel_world_size()}",
        "a": a,
        "a_q": quartiles(times["A"]),
        "b": b,
        "b_q": quartiles(times["B"]),
        "ratio": a / b,
        "ratio_ci": ratio_interval(times["A"], times["B"]),
        "paired": median([x / y for x, y in zip(times["A"], times["B"])]),
        "allreduce_us": (shipped_call - local_call) * 1e6,
        "expected": args.microbatches * (shipped_call - local_call) / b,
        "times": times,
        "cpu": cpu,
        "cpu_ratio": median(cpu["A"]) / median(cpu["B"]),
        "busy": median(cpu["B"]) / (b * (os.cpu_count() or 1)),
    }
    if args.sync_control:
        result["c_ratio"] = median(times["C"]) / b
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("--layouts", default=None, help="e.g. C2-PP1,C4-PP1 (default: all)")
    parser.add_argument("--json", default=None, help="write the raw step times here")
    parser.add_argument(
        "--backend", default="gloo", choices=["gloo", "nccl"], help="nccl: one GPU per rank"
    )
    parser.add_argument(
        "--sync-control",
        action="store_true",
        help="add variant C: B plus an unused all-reduce at the same place",
    )
    args = parser.parse_args()

    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    init_distributed(args.backend)
    world = dist.get_world_size()
    threads = "bf16 on one GPU each" if args.backend == "nccl" else "1 thread each"
    say(f"# load average at the start: {os.getloadavg()[0]:.2f} (1 min)")
    say(f"# bench_cp_normalization: {world} {args.backend} ranks, {threads}; {machine()}")
    say(f"# commit {git_commit()}")
    if args.sync_control:
        say("# C = B plus an unused count all-reduce at the same place (prices the sync alone)")
    say(
        f"# GPT hidden={args.hidden} heads={args.heads} layers={args.layers} seq={args.seq} "
        f"vocab={args.vocab}, micro batch 1, M={args.microbatches}; {args.steps} timed steps "
        f"per variant after {args.warmup}; A = shipped, B = local count (no all-reduce)"
    )
    results = []
    for cp, pp, _ in layouts(world):
        if args.layouts and f"C{cp}-PP{pp}" not in args.layouts.split(","):
            continue
        results.append(bench_layout(args, cp, pp))
        r = results[-1]
        say(f"# {r['layout']}: A {r['a'] * 1e3:.1f} ms, B {r['b'] * 1e3:.1f} ms")
    rows = [
        [
            r["layout"],
            f"{r['a'] * 1e3:.1f}",
            f"{r['a_q'][0] * 1e3:.1f}-{r['a_q'][1] * 1e3:.1f}",
            f"{r['b'] * 1e3:.1f}",
            f"{r['b_q'][0] * 1e3:.1f}-{r['b_q'][1] * 1e3:.1f}",
            f"{r['ratio']:.4f}",
            f"{r['ratio_ci'][0]:.3f}-{r['ratio_ci'][1]:.3f}",
            f"{r['paired']:.4f}",
            f"{r['cpu_ratio']:.4f}",
            f"{100 * r['busy']:.0f}%",
            f"{r['allreduce_us']:.0f}",
            f"{100 * r['expected']:.2f}%",
        ]
        + ([f"{r['c_ratio']:.4f}"] if args.sync_control else [])
        for r in results
    ]
    say(
        table(
            [
                "layout",
                "A step ms (median)",
                "A IQR",
                "B step ms (median)",
                "B IQR",
                "A/B (medians)",
                "A/B 95% interval",
                "median of paired A/B",
                "A/B CPU time (all ranks)",
                "B: cores busy",
                "count all-reduce us/call",
                "M x call / B step",
            ]
            + (["C/B (medians)"] if args.sync_control else []),
            rows,
        )
    )
    say(f"# load average at the end: {os.getloadavg()[0]:.2f} (1 min)")
    say(f"RESULT overhead_ratio={max(r['ratio'] for r in results):.4f}")
    if args.json and dist.get_rank() == 0:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "machine": machine(), "layouts": results}, handle)
    dist.barrier()  # every rank done before any tears its groups down
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
