"""Long-context CP attention on GPUs: ours against PyTorch's own context parallel and one GPU.

Run with torchrun on 2 GPUs (nccl); every measurement is taken in the same run:

    torchrun --nproc-per-node 2 tests/benchmarks/bench_cp_attention.py attention --out DIR
    torchrun --nproc-per-node 2 tests/benchmarks/bench_cp_attention.py train --out DIR
    python tests/benchmarks/bench_cp_attention.py probe --out DIR      (one GPU)

``attention``: one causal attention op (16 heads of 128, bf16, batch 1), forward + backward,
at each length: (1) one GPU, the full sequence, ``F.scaled_dot_product_attention`` with the
kernel pinned (the kernel's own rate); (2) one GPU through ``context_parallel_attention``
(C = 1); (3) ours on 2 GPUs, cp_comm_type all_gather, p2p, a2a (and a2a+p2p, which needs
4 GPUs to differ from a2a); (4) PyTorch's
``torch.distributed.tensor.experimental.context_parallel`` (ring attention over the same
SDPA kernel, load-balanced) on the same 2 GPUs. ``train``: a whole training step (forward,
backward, CP gradient all-reduce, fused AdamW) of a ~1.07B-parameter GPT (4 layers, hidden
4096, 32 heads of 128, FFN 16384, vocabulary 32768, sinusoidal positions, bf16) with the same
three attention variants; with ``--packed-docs N`` each sequence holds N packed documents
(THD, new cu_seqlens tensors every step; ours only), and a variant named with the suffix
``_uncached`` builds its packed plan in every attention call, as before the plan cache
(the A/B of ``cp_attention.plans.cached``). ``probe``: each SDPA aten op's bottom-right causal
semantics, LSE shape and speed, checked against a float64 reference.

Reported per configuration: seconds per iteration (median), tokens/s (global sequence
tokens per second), peak allocated memory per GPU (max over ranks), and for attention the
achieved TFLOP/s per GPU counting the causal work only: fwd = 2 s^2 d h (half of 4 s^2 d h),
fwd + bwd = 3.5 x fwd. Results are appended as JSON lines to DIR/<what>.jsonl.
"""

import argparse
import contextlib
import faulthandler
import functools
import json
import math
import os
import random
import signal
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import megatron.core.transformer.cp_attention.kernels as fk  # noqa: E402
import megatron.core.transformer.cp_attention.varlen as fv  # noqa: E402
from megatron.core.context_parallel import (  # noqa: E402
    cp_shard_positions,
    thd_document_positions,
    thd_partitioned_indices,
)
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.cp_attention import context_parallel_attention, plans  # noqa: E402

BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["attention", "train", "probe", "profile"])
    parser.add_argument("--out", default="bench-cp-attention")
    parser.add_argument("--lengths", default="8192,16384,32768,65536,131072")
    parser.add_argument("--kernel", default="flash", choices=sorted(BACKENDS))
    parser.add_argument("--variants", default="one_gpu_sdpa,one_gpu_ours,all_gather,p2p,torch_cp")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds timed per config")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument(
        "--rounds", type=int, default=1, help="variants measured in turn, this many times"
    )
    parser.add_argument("--max-iters", type=int, default=20, help="timed calls per config, at most")
    parser.add_argument(
        "--packed-docs",
        type=int,
        default=0,
        help="train: pack this many documents per sequence (THD; our variants only)",
    )
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: where a rank hangs
    os.makedirs(args.out, exist_ok=True)
    if args.what == "probe":
        probe(args)
        return
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    lengths = [int(x) for x in args.lengths.split(",")]
    variants = args.variants.split(",")
    if args.what == "profile":
        profile(args, lengths, variants)
        dist.destroy_process_group()
        return
    run = bench_attention if args.what == "attention" else bench_train
    results: Dict = {}
    for length in lengths:
        for _ in range(args.rounds):
            for variant in variants:
                record = measure(run, args, length, variant)
                results.setdefault((length, variant), []).append(record.get("seconds"))
                if dist.get_rank() == 0:
                    with open(os.path.join(args.out, f"{args.what}.jsonl"), "a") as f:
                        f.write(json.dumps(record) + "\n")
                    print(format_record(record), flush=True)
    if dist.get_rank() == 0 and args.rounds > 1:
        print(summary(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- harness


def measure(run: Callable, args, length: int, variant: str) -> Dict:
    """Run one configuration on every rank; OOM (on any rank) is recorded, not fatal."""
    world = dist.get_world_size()
    one_gpu = variant.startswith("one_gpu")
    record = dict(what=args.what, variant=variant, seq=length, kernel=args.kernel)
    record["gpus"] = 1 if one_gpu else world
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    status, times = "ok", []
    if not one_gpu or dist.get_rank() == 0:
        try:
            times = run(args, length, variant)
        except torch.cuda.OutOfMemoryError:
            status = "OOM"
        except Exception as error:  # noqa: BLE001 - recorded, the run goes on
            status = f"error: {type(error).__name__}: {str(error)[:300]}"
    torch.cuda.synchronize()
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    flag = torch.tensor([0 if status == "ok" else 1], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and status == "ok" and not one_gpu:
        status = "failed on another rank"
    record.update(status=status, peak_gib=round(peak.item(), 2))
    if status == "ok" and times:
        seconds = statistics.median(times)
        record.update(seconds=seconds, iters=len(times), tokens_per_s=length / seconds)
        if args.what == "attention":
            heads, dim = 16, 128
            flops = 3.5 * 2 * length**2 * dim * heads
            record["tflops_per_gpu"] = flops / record["gpus"] / seconds / 1e12
    return record


def summary(results: Dict) -> str:
    """Per length and variant: the median over rounds of each round's median, and its ratio
    to PyTorch's context parallel (time of torch_cp / time of the variant: > 1 is faster)."""
    lines = ["summary (median over rounds)"]
    for (length, variant), times in results.items():
        times = [t for t in times if t is not None]
        if not times:
            continue
        seconds = statistics.median(times)
        line = f"s={length:>6d} {variant:14s} {seconds * 1e3:9.3f} ms"
        ref = [t for t in results.get((length, "torch_cp"), []) if t is not None]
        if ref and variant != "torch_cp":
            line += f"  x{statistics.median(ref) / seconds:.3f} vs torch_cp"
        spread = f" (rounds {', '.join(f'{t * 1e3:.2f}' for t in times)})"
        lines.append(line + spread)
    return "\n".join(lines)


def timed(
    step: Callable[[], None], min_time: float, sync_group: bool, max_iters: int = 20
) -> List[float]:
    """One warm-up call, then calls until ``min_time`` seconds are spent (2 to
    ``max_iters``); with ``sync_group`` every rank runs as many calls as the rank that would
    run the most."""

    def one_call() -> float:
        if sync_group:
            dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def more() -> bool:
        """Another call? With ``sync_group`` every rank decides alike before each call (the
        calls hold collectives: a rank that stopped one call early would pair its next
        collective with another rank's barrier and hang, as 64k launches did until run 9)."""
        go = len(times) < 2 or (sum(times) < min_time and len(times) < max_iters)
        if sync_group:
            flag = torch.tensor([int(go)], device="cuda")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            go = bool(flag.item())
        return go

    step()
    torch.cuda.synchronize()
    times: List[float] = []
    while more():
        times.append(one_call())
    return times


def sdpa_backend(kernel: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, BACKENDS[kernel]))


def format_record(r: Dict) -> str:
    if r["status"] != "ok":
        head = f"{r['what']:9s} s={r['seq']:>6d} {r['variant']:14s}"
        return f"{head} {r['status']} peak {r['peak_gib']} GiB"
    extra = f" {r['tflops_per_gpu']:6.1f} TFLOP/s/GPU" if "tflops_per_gpu" in r else ""
    return (
        f"{r['what']:9s} s={r['seq']:>6d} {r['variant']:14s} {r['seconds'] * 1e3:9.2f} ms "
        f"{r['tokens_per_s']:12.0f} tok/s peak {r['peak_gib']:7.2f} GiB{extra}"
    )


# ----------------------------------------------------------------------------- attention


OURS = ("all_gather", "p2p", "a2a", "a2a+p2p")  # our cp_comm_types over all ranks


@functools.lru_cache(maxsize=None)
def our_group(variant: str):
    """The CP group of one of OURS: the world, or for a2a+p2p the pair [all-to-all group of
    2 consecutive ranks, ring over every 2nd rank] (hierarchical sizes [2, world / 2]; on 2
    GPUs that is a2a with an extra reordering, so it means something from 4 GPUs on)."""
    if variant != "a2a+p2p":
        return dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = []
    for level in (
        [[r, r + 1] for r in range(0, world, 2)],
        [list(range(i, world, 2)) for i in (0, 1)],
    ):
        for ranks in level:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine.append(group)
    return mine


def bench_attention(args, length: int, variant: str, timer: Callable = None) -> List[float]:
    """Time one attention op (``timer``, default ``timed``, gets the step to run)."""
    timed_ = timer or timed
    heads, dim = 16, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    world, rank = dist.get_world_size(), dist.get_rank()

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    if variant == "one_gpu_sdpa":
        q, k, v, dout = (rand(1, heads, length, dim) for _ in range(4))
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))

        def step():
            with sdpa_backend(args.kernel):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(dout)

        return timed_(step, args.min_time, sync_group=False, max_iters=args.max_iters)

    if variant == "one_gpu_ours" or variant in OURS or variant.startswith("all_gather_g"):
        group = None if variant == "one_gpu_ours" else our_group(variant)
        cp = 1 if group is None else world
        local = length // cp
        q, k, v, dout = (rand(local, 1, heads, dim) for _ in range(4))
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))
        # all_gather_gN: N head groups (default: the module's choice)
        groups = int(variant[len("all_gather_g") :]) if variant.startswith("all_gather_g") else None
        comm = "all_gather" if group is None or groups else variant

        def step():
            out = context_parallel_attention(
                q, k, v, cp_group=group, cp_comm_type=comm, kernel=args.kernel,
                num_head_groups=groups,
            )  # fmt: skip
            out.backward(dout)

        return timed_(step, args.min_time, sync_group=group is not None, max_iters=args.max_iters)

    if variant == "torch_cp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cuda", (world,))
        q, k, v, dout = (rand(1, heads, length, dim) for _ in range(4))
        buffers = [q, k, v, dout]
        with context_parallel(
            mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)
        ):
            torch.cuda.reset_peak_memory_stats()
            ql, kl, vl = (x.detach().requires_grad_(True) for x in (q, k, v))

            def step():
                with sdpa_backend(args.kernel):
                    out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
                out.backward(dout)

            return timed_(step, args.min_time, sync_group=True, max_iters=args.max_iters)
    raise ValueError(f"unknown variant {variant!r} (rank {rank})")


# ----------------------------------------------------------------------------- training step


class Block(nn.Module):
    """Pre-norm transformer block on [s, b, h]; attention supplied per call."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor, attend: Callable) -> torch.Tensor:
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, self.heads, h // self.heads).unbind(2)
        x = x + self.proj(attend(q, k, v).reshape(s, b, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, max_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        half = torch.arange(0, hidden, 2, dtype=torch.float32) / hidden
        self.register_buffer("freq", torch.exp(-math.log(10000.0) * half), persistent=False)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens, positions, labels, attend) -> torch.Tensor:
        angles = positions.unsqueeze(-1).float() * self.freq  # sinusoidal positions
        x = self.embed(tokens) + torch.cat([angles.sin(), angles.cos()], -1).to(
            self.ln.weight.dtype
        )
        x = x.transpose(0, 1)  # [s, b, h]
        for block in self.blocks:
            x = block(x, attend)
        logits = self.out(self.ln(x)).transpose(0, 1)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


UNCACHED = "_uncached"  # variant suffix: every attention call builds its packed plan


@contextlib.contextmanager
def plans_uncached():
    """The A/B of the packed-plan cache: each call reads cu_seqlens and builds its plan anew,
    as before the cache (``cp_attention.plans.cached`` replaced by a plain call)."""
    saved = plans.cached
    plans.cached = lambda packed, key, build: build()
    try:
        yield
    finally:
        plans.cached = saved


def packed_documents(length: int, docs: int, cp: int) -> tuple:
    """Cumulative (real, padded) lengths of ``docs`` documents filling ``length`` tokens:
    lengths 0.5-1.5x the mean (seeded), each padded to a multiple of 2 * cp, the real
    length 0 to 2 * cp - 1 tokens shorter (SFT-like padding)."""
    unit, gen = 2 * cp, random.Random(0)
    weights = [gen.uniform(0.5, 1.5) for _ in range(docs)]
    sizes = [max(unit, int(length * w / sum(weights)) // unit * unit) for w in weights[:-1]]
    sizes.append(length - sum(sizes))
    if sizes[-1] < unit:
        raise ValueError(f"--packed-docs {docs} does not fit {length} tokens at C = {cp}")
    real, padded = [0], [0]
    for size in sizes:
        padded.append(padded[-1] + size)
        real.append(real[-1] + size - gen.randrange(unit))
    return real, padded


def bench_train(args, length: int, variant: str) -> List[float]:
    if variant.endswith(UNCACHED):
        with plans_uncached():
            return bench_train(args, length, variant[: -len(UNCACHED)])
    world = dist.get_world_size()
    heads, vocab = args.hidden // 128, 32768
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(args.layers, args.hidden, heads, vocab, length).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, vocab, (1, length + 1), device="cuda", generator=gen)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(length, device="cuda").unsqueeze(0)
    params = [p for p in model.parameters()]
    if dist.get_rank() == 0 and length == int(args.lengths.split(",")[0]):
        print(f"GPT parameters: {sum(p.numel() for p in params) / 1e9:.3f} B", flush=True)

    def sync_grads():
        grads = [p.grad for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    def sdpa(q, k, v):  # [s, b, n, d] -> SDPA's [b, n, s, d]
        with sdpa_backend(args.kernel):
            out = F.scaled_dot_product_attention(
                *(x.permute(1, 2, 0, 3) for x in (q, k, v)), is_causal=True
            )
        return out.permute(2, 0, 1, 3)

    packed = [None]  # this step's PackedSeqParams (--packed-docs)
    cp = world if variant in OURS else 1
    if args.packed_docs:
        if variant not in OURS + ("one_gpu_ours",):
            raise ValueError(f"--packed-docs: variant {variant!r} has no packed sequences")
        real, padded = packed_documents(length, args.packed_docs, cp)
        starts = torch.tensor(padded, device="cuda")
        positions = thd_document_positions(positions[0], starts, length)[1].unsqueeze(0)
        host = [torch.tensor(x, dtype=torch.int32).pin_memory() for x in (real, padded)]
        longest = max(b - a for a, b in zip(padded[:-1], padded[1:]))

    def new_batch():
        """Each step's cu_seqlens arrive as a data loader brings them: new device tensors,
        copied from pinned memory without a synchronization."""
        if args.packed_docs:
            cu, cu_padded = (x.to("cuda", non_blocking=True) for x in host)
            packed[0] = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                cu_seqlens_kv_padded=cu_padded, max_seqlen_q=longest, max_seqlen_kv=longest,
            )  # fmt: skip

    def make_step(attend, tok, pos, lab, cp: int):
        def step():
            new_batch()
            optimizer.zero_grad(set_to_none=False)
            loss = model(tok, pos, lab, attend) / length
            loss.backward()
            if cp > 1:
                sync_grads()
            optimizer.step()

        return step

    if variant.startswith("one_gpu"):
        attend = sdpa if variant == "one_gpu_sdpa" else (
            lambda q, k, v: context_parallel_attention(
                q, k, v, kernel=args.kernel, packed_seq_params=packed[0]
            )
        )  # fmt: skip
        return timed(
            make_step(attend, inputs, positions, labels, 1), args.min_time, False, args.max_iters
        )
    if variant in OURS:
        if args.packed_docs:
            shard = thd_partitioned_indices(padded, length, world, dist.get_rank()).cuda()
        else:
            shard = cp_shard_positions(length, world, dist.get_rank()).cuda()
        group = our_group(variant)

        def attend(q, k, v):
            return context_parallel_attention(
                q, k, v, cp_group=group, cp_comm_type=variant, kernel=args.kernel,
                packed_seq_params=packed[0],
            )  # fmt: skip

        tok, pos, lab = (x[:, shard] for x in (inputs, positions, labels))
        return timed(make_step(attend, tok, pos, lab, world), args.min_time, True, args.max_iters)
    if variant == "torch_cp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cuda", (world,))
        buffers = [inputs, positions.clone(), labels]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1]):
            step = make_step(sdpa, buffers[0], buffers[1], buffers[2], world)
            return timed(step, args.min_time, True, args.max_iters)
    raise ValueError(f"unknown variant {variant!r}")


# ----------------------------------------------------------------------------- profile


def profile(args, lengths: List[int], variants: List[str]) -> None:
    """Where the time of one attention op goes: ``torch.profiler`` over 3 calls per variant
    and length (after 3 warm-up calls), rank 0's trace saved as
    DIR/trace_<variant>_<kernel>_<s>.json and its top operators by self CPU time printed;
    the trace's GPU-busy time against the calls' wall time tells a CPU-bound variant from a
    GPU-bound one."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for length in lengths:
        for variant in variants:

            def profiled(step, min_time, sync_group, max_iters=0, length=length, variant=variant):
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
                with torch_profile(activities=activities) as prof:
                    for _ in range(3):
                        if sync_group:
                            dist.barrier()
                        torch.cuda.synchronize()
                        step()
                        torch.cuda.synchronize()
                if dist.get_rank() == 0:
                    name = f"trace_{variant}_{args.kernel}_{length}.json"
                    prof.export_chrome_trace(os.path.join(args.out, name))
                    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                    print(f"== {variant} {args.kernel} s={length}\n{table}", flush=True)
                return []

            bench_attention(args, length, variant, timer=profiled)
            dist.barrier()


# ----------------------------------------------------------------------------- probe


def probe(args) -> None:
    """Each kernel: forward/backward against float64 for square and bottom-right causal
    blocks, GQA, the varlen op; then fwd+bwd TFLOP/s at 16k on one GPU."""
    torch.cuda.set_device(0)
    lines = [
        f"torch {torch.__version__}, cuda {torch.version.cuda}, {torch.cuda.get_device_name()}"
    ]
    names = [
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_efficient_attention_forward", "_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
        "_flash_attention_forward", "_flash_attention_backward", "_cudnn_attention_forward",
    ]  # fmt: skip
    lines.append("aten ops: " + ", ".join(f"{n}={hasattr(torch.ops.aten, n)}" for n in names))
    lines.append(f"varlen_available={fv.varlen_available()}")
    device = torch.device("cuda", 0)
    for kernel in ("flash", "efficient", "cudnn"):
        aligned = fk.bottom_right_causal(fk.kernel_spec(kernel), device)
        lines.append(f"{kernel}: causal s_q < s_k bottom-right natively: {aligned}")
    for kernel in ("flash", "efficient", "cudnn"):
        for s_q, s_k, n_q, n_kv in ((256, 256, 4, 4), (128, 384, 4, 4), (256, 256, 8, 2)):
            try:
                err = kernel_error(kernel, s_q, s_k, n_q, n_kv)
                lines.append(f"{kernel} causal s_q={s_q} s_k={s_k} heads {n_q}/{n_kv}: {err}")
            except Exception as error:  # noqa: BLE001
                lines.append(
                    f"{kernel} s_q={s_q} s_k={s_k}: FAILED {type(error).__name__}: {error}"
                )
    try:
        lines.append(f"varlen: {varlen_error()}")
    except Exception as error:  # noqa: BLE001
        lines.append(f"varlen FAILED {type(error).__name__}: {error}")
    for kernel in ("flash", "efficient", "cudnn"):
        for length in (16384,):
            try:
                lines.append(f"speed {kernel} s={length}: {kernel_speed(kernel, length)}")
            except Exception as error:  # noqa: BLE001
                lines.append(f"speed {kernel}: FAILED {type(error).__name__}: {error}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "probe.txt"), "w") as f:
        f.write(text + "\n")


def kernel_error(kernel: str, s_q: int, s_k: int, n_q: int, n_kv: int) -> str:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, s_q, n_q, 64, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(2, s_k, n_kv, 64, device="cuda", generator=gen).bfloat16() for _ in "kv")
    dout = torch.randn(2, s_q, n_q, 64, device="cuda", generator=gen).bfloat16()
    scale = 0.125
    out, lse = fk.attention_forward(q, k, v, True, fk.Kernel(kernel, scale))
    grads = fk.attention_backward(dout, q, k, v, out, lse, True, fk.Kernel(kernel, scale))
    qr, kr, vr = (x.double().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    kr2, vr2 = (x.repeat_interleave(n_q // n_kv, dim=1) for x in (kr, vr))
    allowed = torch.ones(s_q, s_k, dtype=torch.bool, device="cuda").tril(s_k - s_q)
    scores = (qr @ kr2.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
    ref = (torch.softmax(scores, -1) @ vr2).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref * dout.double()).sum(), (qr, kr, vr))

    def rel(a, b):
        return f"{((a.double() - b).norm() / b.norm()).item():.2e}"

    parts = [f"out {rel(out, ref)}", f"lse {rel(lse, torch.logsumexp(scores, -1))}"]
    parts += [f"d{n} {rel(g, r.transpose(1, 2))}" for n, g, r in zip("qkv", grads, ref_grads)]
    return " ".join(parts) + f" (lse shape {tuple(lse.shape)})"


def varlen_error() -> str:
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens_q, lens_k = [64, 0, 128, 32], [192, 64, 128, 96]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).int()
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).int()
    q = torch.randn(sum(lens_q), 4, 64, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(sum(lens_k), 4, 64, device="cuda", generator=gen).bfloat16() for _ in "kv")
    lengths, kernel = fv.SeqLens(cu_q, cu_k, max(lens_q), max(lens_k)), fk.Kernel(None, 0.125)
    out, lse = fv.varlen_forward(q, k, v, lengths, True, kernel)
    dout = torch.randn_like(out)
    grads = fv.varlen_backward(dout, q, k, v, out, lse, lengths, True, kernel)
    # reference: the loop over sequences with the dense kernel
    name = fk.Kernel("efficient", 0.125)
    ref_out = torch.zeros_like(out)
    ref_grads = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    for i in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[i].item(), cu_q[i + 1].item(), cu_k[i].item(), cu_k[i + 1].item()
        if q1 == q0:
            continue
        o, l_ = fk.attention_forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], True, name)
        ref_out[q0:q1] = o[0]
        g = fk.attention_backward(
            dout[None, q0:q1],
            q[None, q0:q1],
            k[None, k0:k1],
            v[None, k0:k1],
            o,
            l_,
            True,
            name,
        )
        ref_grads[0][q0:q1] = g[0][0]
        ref_grads[1][k0:k1] = g[1][0]
        ref_grads[2][k0:k1] = g[2][0]

    def rel(a, b):
        return f"{((a.double() - b.double()).norm() / b.double().norm()).item():.2e}"

    return (
        f"used_varlen_op={fv.varlen_available()} out {rel(out, ref_out)} "
        + " ".join(f"d{n} {rel(g, r)}" for n, g, r in zip("qkv", grads, ref_grads))
        + f" finite={bool(torch.isfinite(out).all() and torch.isfinite(grads[0]).all())}"
    )


def kernel_speed(kernel: str, length: int) -> str:
    heads, dim = 16, 128
    q, k, v, dout = (
        torch.randn(1, length, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )

    def ours():
        out, lse = fk.attention_forward(q, k, v, True, fk.Kernel(kernel, dim**-0.5))
        fk.attention_backward(dout, q, k, v, out, lse, True, fk.Kernel(kernel, dim**-0.5))

    qs, ks, vs = (x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v))

    def sdpa():
        with sdpa_backend(kernel):
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        out.backward(dout.transpose(1, 2))

    flops = 3.5 * 2 * length**2 * dim * heads
    result = []
    for name, fn in (("aten-ops", ours), ("sdpa", sdpa)):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / 5
        result.append(f"{name} {seconds * 1e3:.2f} ms {flops / seconds / 1e12:.0f} TFLOP/s")
    return ", ".join(result)


if __name__ == "__main__":
    main()
