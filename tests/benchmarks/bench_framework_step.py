"""The framework's own cost of a dense GPT training step, CP=2 x PP=2 on 4 CPU ranks, with
this repository or with megatron-core 0.16.1 (whichever ``megatron`` the interpreter has).

    torchrun --standalone --nproc-per-node 4 tests/benchmarks/bench_framework_step.py
    /work/mcore-venv/bin/torchrun --standalone --nproc-per-node 4 \\
        tests/benchmarks/bench_framework_step.py                      # megatron-core
    python tests/benchmarks/run_framework_step.py --repeats 3         # both, A B A B

One step through the public API only: ``GPTModel`` with ``get_gpt_layer_local_spec()``,
``DistributedDataParallel``, ``finalize_model_grads`` as ``config.finalize_model_grads_func``,
``get_forward_backward_func()`` (1F1B), an SGD update of ``main_grad``; the groups are
``parallel_state``'s (MPU fallback: ``pg_collection`` not passed), the batches sharded by
``get_batch_on_this_cp_rank``. Two models, alternated step by step:

- ``framework``: so small (hidden 16, sequence 32, vocabulary 64) that compute is negligible:
  its step time is the framework's cost (schedule, p2p, DDP, groups, bookkeeping).
- ``compute``: hidden 256, sequence 512, vocabulary 1024: mostly GEMMs and attention.

megatron-core's local ``DotProductAttention`` refuses CP > 1 (it needs Transformer Engine,
absent on the CPU). For megatron-core the benchmark puts ``GatherCPAttention`` (below: one
all-gather of K and V over the CP group, a causal mask by global position, the gradient
all-reduced back) in the spec's ``core_attention``; ours uses its own. The CPU shim of
``bench_common.install_mcore_cpu_shim`` lets megatron-core's schedules and DDP run on gloo.

A step's time is the slowest rank's wall time (barrier before, garbage collector paused).
``--profile DIR`` instead runs the framework model under cProfile on every rank and counts
the collectives of one step (calls of ``torch.distributed``'s functions, and bytes).
"""

import argparse
import cProfile
import functools
import gc
import io
import os
import pstats
import time
from collections import Counter
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
    quartiles,
    say,
)

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import get_batch_on_this_cp_rank

MODELS = {
    "framework": dict(layers=4, hidden=16, heads=2, seq=32, vocab=64, microbatches=16),
    "compute": dict(layers=4, hidden=256, heads=4, seq=512, vocab=1024, microbatches=4),
}


def _gather(tensor, group):
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


class GatherCPAttention(MegatronModule):
    """megatron-core's core-attention constructor; exact causal attention of this rank's
    load-balanced shard (chunks r and 2C-1-r of 2C) over the gathered K and V.

    Like Transformer Engine's all-gather CP attention, nothing of the full length is saved:
    the backward gathers K and V again and reduces their gradients (here: one all-gather of
    the stacked K and V each way, the gradient summed by an all-reduce and sliced)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        super().__init__(config=config)
        self.scale = config.kv_channels**-0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, **kwargs):
        group = parallel_state.get_context_parallel_group()
        cp, rank = group.size(), group.rank()
        chunk = query.shape[0] // 2
        pos = [torch.arange(chunk) + chunk * c for r in range(cp) for c in (r, 2 * cp - 1 - r)]
        k_pos, q_pos = torch.cat(pos), torch.cat([pos[2 * rank], pos[2 * rank + 1]])
        mask = q_pos[:, None] < k_pos[None, :]
        return _GatheredAttention.apply(query, key, value, group, mask, self.scale)


class _GatheredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, mask, scale):
        ctx.save_for_backward(query, key, value)
        ctx.group, ctx.mask, ctx.scale = group, mask, scale
        with torch.no_grad():
            return _attend(query, key, value, group, mask, scale)

    @staticmethod
    def backward(ctx, grad):
        query, key, value = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        group = ctx.group
        with torch.enable_grad():
            kv = _gather(torch.stack([key, value], dim=1), group).requires_grad_()
            out = _local_attend(query, kv, ctx.mask, ctx.scale)
            dq, dkv = torch.autograd.grad(out, (query, kv), grad)
        dist.all_reduce(dkv, group=group)
        dkv = dkv.chunk(group.size())[group.rank()]
        return dq, dkv[:, 0], dkv[:, 1], None, None, None


def _attend(query, key, value, group, mask, scale):
    kv = _gather(torch.stack([key, value], dim=1), group)  # [C*s, 2, b, n, d]
    return _local_attend(query, kv, mask, scale)


def _local_attend(query, kv, mask, scale):
    scores = torch.einsum("sbnd,tbnd->bnst", query, kv[:, 0]) * scale
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    context = torch.einsum("bnst,tbnd->sbnd", probs, kv[:, 1])
    return context.reshape(context.shape[0], context.shape[1], -1)


def build(model: Dict[str, int], mcore: bool):
    """This rank's DDP-wrapped GPT stage and its config."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    config = TransformerConfig(
        num_layers=model["layers"],
        hidden_size=model["hidden"],
        num_attention_heads=model["heads"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        deallocate_pipeline_outputs=True,
        use_cpu_initialization=True,
    )
    spec = get_gpt_layer_local_spec()
    if mcore:
        spec.submodules.self_attention.submodules.core_attention = GatherCPAttention
    torch.manual_seed(1234)
    gpt = GPTModel(
        config,
        spec,
        vocab_size=model["vocab"],
        max_sequence_length=model["seq"],
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
    )
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt
    )
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddp, config


def microbatches(model: Dict[str, int]) -> List[Dict[str, torch.Tensor]]:
    """This rank's CP shards of M SFT-like microbatches (a masked prompt of random length)."""
    gen = torch.Generator().manual_seed(4321)
    seq, batches = model["seq"], []
    for _ in range(model["microbatches"]):
        tokens = torch.randint(0, model["vocab"], (1, seq), generator=gen)
        labels = torch.randint(0, model["vocab"], (1, seq), generator=gen)
        prompt = int(torch.randint(seq // 8, seq // 2, (1,), generator=gen))
        mask = (torch.arange(seq) >= prompt).float().view(1, -1)
        batch = {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": mask,
            "position_ids": torch.arange(seq).view(1, -1),
        }
        batches.append(get_batch_on_this_cp_rank(batch))
    return batches


def forward_step(data_iterator, model):
    """The training callback: (loss sum, valid-token count, reported)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"]
        loss_sum = (output_tensor.float() * mask).sum()
        num_tokens = mask.sum().to(torch.int)
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}

    return output, loss_func


def train_step(ddp, model: Dict[str, int], data) -> None:
    """Zero the gradient buffer, run the schedule, apply SGD to ``main_grad``."""
    ddp.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(data),
        model=ddp,
        num_microbatches=model["microbatches"],
        seq_length=model["seq"],
        micro_batch_size=1,
    )
    with torch.no_grad():
        for param in ddp.parameters():
            param.add_(param.main_grad.to(param.dtype), alpha=-1e-3)


def timed(fn) -> List[float]:
    """[wall, process CPU, main-thread CPU] seconds of ``fn()`` on this rank, after a
    barrier, GC paused."""
    gc.collect()
    gc.disable()
    dist.barrier()
    wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
    fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    main = time.thread_time() - main
    gc.enable()
    return [wall, cpu, main]


def measure(args, variants) -> Dict[str, dict]:
    """Alternate the models step by step; medians over steps of the slowest rank's wall,
    process CPU (all threads, gloo's included) and main-thread CPU times."""
    samples: Dict[str, List[List[float]]] = {name: [] for name in variants}
    for step in range(args.warmup + args.steps):
        for name, fn in variants.items():
            values = all_max(timed(fn))
            if step >= args.warmup:
                samples[name].append(values)
    results = {}
    for name, values in samples.items():
        walls, cpus, mains = ([v[i] * 1e3 for v in values] for i in range(3))
        results[name] = {
            "wall_ms": median(walls),
            "wall_q": quartiles(walls),
            "cpu_ms": median(cpus),
            "main_ms": median(mains),
            "walls": walls,
            "cpus": cpus,
        }
    return results


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "barrier",
    "batch_isend_irecv",
)  # isend/irecv are not wrapped: P2POp checks their identity (both frameworks batch p2p)


def count_collectives(fn) -> Counter:
    """{"name": calls, "name bytes": bytes} of ``torch.distributed``'s collectives during
    ``fn()`` (the functions are wrapped for the call, then restored)."""
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, original):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            counts[name] += 1
            tensors = args[0] if args else kwargs.get("tensor", kwargs.get("p2p_op_list"))
            if name == "batch_isend_irecv":
                for op in tensors:
                    counts[f"batch_isend_irecv:{op.op.__name__}"] += 1
                    counts[f"{name} bytes"] += op.tensor.numel() * op.tensor.element_size()
            elif isinstance(tensors, torch.Tensor):
                counts[f"{name} bytes"] += tensors.numel() * tensors.element_size()
            return original(*args, **kwargs)

        return counted

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    try:
        fn()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return counts


def profile(args, fn, fw: str) -> None:
    """cProfile of ``--profile-steps`` steps and the collectives of one, per rank."""
    rank = dist.get_rank()
    counts = count_collectives(fn)
    profiler = cProfile.Profile()
    dist.barrier()
    profiler.enable()
    for _ in range(args.profile_steps):
        fn()
    profiler.disable()
    os.makedirs(args.profile, exist_ok=True)
    profiler.dump_stats(os.path.join(args.profile, f"{fw}_rank{rank}.prof"))
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(args.profile_top)
    calls = sum(c for c, _, _, _ in [v[:4] for v in stats.stats.values()])
    with open(os.path.join(args.profile, f"{fw}_rank{rank}.txt"), "w") as handle:
        handle.write(
            f"# {fw} rank {rank}: collectives of one step {dict(sorted(counts.items()))}\n"
        )
        handle.write(f"# Python-level calls per step: {calls / args.profile_steps:.0f}\n")
        handle.write(out.getvalue())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [dict(counts), calls / args.profile_steps, stats.total_tt])
    for r, (c, n, tt) in enumerate(everyone):
        say(f"# rank {r}: {n:.0f} calls/step, {1e3 * tt / args.profile_steps:.1f} ms profiled")
        say(f"#   collectives/step: {dict(sorted(c.items()))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--models", default="framework,compute")
    parser.add_argument("--json", default=None, help="append one JSON line of results here")
    parser.add_argument("--profile", default=None, help="write per-rank profiles here")
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--profile-top", type=int, default=40)
    args = parser.parse_args()

    torch.set_num_threads(1)
    init_distributed("gloo")
    fw = framework()
    mcore = fw["name"] == "megatron-core"
    if mcore:
        install_mcore_cpu_shim()
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=2, context_parallel_size=dist.get_world_size() // 2
    )
    variants = {}
    for name in args.models.split(","):
        model = MODELS[name]
        ddp, _ = build(model, mcore)
        data = microbatches(model)
        variants[name] = functools.partial(train_step, ddp, model, data)
    say(f"# bench_framework_step: {fw['name']} {fw['version']}, CP=2 x PP=2, 4 ranks")
    say(f"# machine: {machine()}")
    if args.profile:
        for _ in range(args.warmup):
            variants["framework"]()
        profile(args, variants["framework"], fw["name"])
    else:
        results = measure(args, variants)
        for name, r in results.items():
            say(
                f"| {fw['name']} | {name} | {r['wall_ms']:.1f} | "
                f"{r['wall_q'][0]:.1f}-{r['wall_q'][1]:.1f} | {r['cpu_ms']:.1f} | "
                f"{r['main_ms']:.1f} |"
            )
        append_json(args.json, {"framework": fw["name"], "models": MODELS, "times": results})
    dist.barrier()
    variants.clear()  # the models and their groups freed now, not at interpreter exit (where
    gc.collect()  # gloo's threads can abort a half-finalized process: docs/troubleshooting.md)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
