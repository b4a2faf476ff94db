"""Our trainer's step against a bare PyTorch loop of the same model, eager and compiled, on
one GPU, in one launch (issue 23).

    python tests/benchmarks/bench_trainer_gpu.py [--variants ...] [--json out.json]

Model (the issue's): Llama-style, 16 layers, hidden 2048, 16 heads, 4 query groups (GQA),
SwiGLU (FFN 8192), RMSNorm, RoPE, no biases, untied embeddings, vocabulary 32000 (~1.1B
parameters); sequence 8192, 4 microbatches of 1 sequence per step (32768 tokens).

Variants:

- ``bare``: the ~150-line loop below: fp32 parameters, ``torch.autocast`` bf16, SDPA
  (PyTorch's own kernel choice), masked token-mean cross-entropy per microbatch, fused
  AdamW, gradient clipping at 1.0 (the trainer's default, so both do the same math).
- ``bare-compiled``: the same model under ``torch.compile``.
- ``ours``: ``megatron.training``'s ``pretrain`` with ``--bf16`` (Float16Module, fp32
  main_grad and main parameters, fused AdamW over them, clipping), one process without
  torchrun (the one-process nccl group), on the trainer's generated SFT data (prompt-masked).
  ``ours-fused``: plus megatron-core's fusion switches (``bias_activation_fusion``,
  ``bias_dropout_fusion``, ``apply_rope_fusion``, ``persist_layer_norm``,
  ``cross_entropy_loss_fusion``) and ``gradient_accumulation_fusion``; ``ours-compile``:
  the trainer's ``--compile``. ``ours-recompute``: ``--recompute-granularity full
  --recompute-method uniform --recompute-num-layers 1``; ``ours-selective``:
  ``--recompute-granularity selective`` (core attention); both eager ``--bf16``.
  ``ours-lora``: ``--lora-dim 8 --lora-alpha 16`` (adapters on linear_qkv, linear_proj,
  linear_fc1, linear_fc2; the base frozen, fp32 adapters), ``ours-lora-compile`` with
  ``--compile``: against ``ours`` (full fine-tuning) in the same launch. ``ours-dpo`` /
  ``ours-lora-dpo``: ``--dpo`` on generated preference pairs, 2 pairs of 8k-token sequences
  per step (the same 32768 policy tokens; the reference's forward on top).
  ``ours-fp8``: ``--fp8-format hybrid --fp8-recipe tensorwise`` (FP8 GEMMs in the attention
  and MLP linears, every scale from the global amax; docs/fp8.md), ``ours-fp8-compile`` with
  ``--compile`` (issue 41: at least 1.07x ``ours-compile``); ``ours-fp8-compile-cached`` /
  ``-uncached``: with the FP8 weight cache traced into the compiled layers or not
  (``fp8.cache.CACHE_WHEN_COMPILED``; without the suffix, as shipped).
- ``bare-fp8-compiled``: the bare loop under ``torch.compile`` with torchao's float8 training
  (``convert_to_float8_training``, the "tensorwise" recipe, every linear but the output
  head), when torchao is installed (issue 41: ``ours-fp8-compile`` at least as fast).

Each variant runs ``--warmup`` untimed steps then ``--steps`` timed ones; the trainer's
steps are its own ``iteration_time_s`` (data, schedule, optimizer, logging). tokens/s =
32768 / median step; model TFLOP/s = tokens/s x (6 P + 6 L h s) (P all parameters, causal
attention counted half, the issue's formula); peak = ``torch.cuda.max_memory_allocated``
during the variant. ``--profile V ...`` adds a ``torch.profiler`` table of two steps of each
variant V and its GPU kernel time by kind.
"""

import argparse
import dataclasses
import json
import os
import statistics
import time
import traceback
from typing import Callable, Dict

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------- bare loop


@dataclasses.dataclass
class Shape:
    layers: int = 16
    hidden: int = 2048
    heads: int = 16
    groups: int = 4
    ffn: int = 8192
    vocab: int = 32000
    seq: int = 8192
    microbatches: int = 4


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-5)


def rope(x, cos, sin):
    """x [b, n, s, d]; rotate pairs (i, i + d/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(torch.nn.Module):
    def __init__(self, c: Shape) -> None:
        super().__init__()
        self.c, self.d = c, c.hidden // c.heads
        self.norm1, self.norm2 = RMSNorm(c.hidden), RMSNorm(c.hidden)
        self.qkv = torch.nn.Linear(c.hidden, (c.heads + 2 * c.groups) * self.d, bias=False)
        self.proj = torch.nn.Linear(c.hidden, c.hidden, bias=False)
        self.fc1 = torch.nn.Linear(c.hidden, 2 * c.ffn, bias=False)
        self.fc2 = torch.nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.c.heads * self.d, self.c.groups * self.d, self.c.groups * self.d], dim=-1
        )
        q = q.view(b, s, self.c.heads, self.d).transpose(1, 2)
        k = k.view(b, s, self.c.groups, self.d).transpose(1, 2)
        v = v.view(b, s, self.c.groups, self.d).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


class Llama(torch.nn.Module):
    def __init__(self, c: Shape) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(c.vocab, c.hidden)
        self.blocks = torch.nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)
        self.head = torch.nn.Linear(c.hidden, c.vocab, bias=False)
        d = c.hidden // c.heads
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = torch.outer(torch.arange(c.seq, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)

    def forward(self, tokens, labels, mask):
        x = self.embed(tokens)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return (losses * mask.flatten()).sum() / mask.sum().clamp(min=1)


def bare_runner(
    c: Shape, compiled: bool, device: torch.device, fp8: bool = False
) -> Callable[[], None]:
    """One training step of the bare loop: M microbatches, clip, fused AdamW (``fp8``:
    torchao float8 tensorwise linears, the head excepted)."""
    model = Llama(c).to(device)
    if fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name("tensorwise"),
            module_filter_fn=lambda module, fqn: fqn != "head",
        )
    step_model = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    gen = torch.Generator().manual_seed(0)
    shape = (1, c.seq)
    data = []
    for _ in range(c.microbatches):
        prompt = int(torch.randint(c.seq // 8, c.seq // 2, (), generator=gen))
        data.append(
            (
                torch.randint(0, c.vocab, shape, generator=gen).to(device),
                torch.randint(0, c.vocab, shape, generator=gen).to(device),
                (torch.arange(c.seq) >= prompt).float().expand(shape).contiguous().to(device),
            )
        )

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for tokens, labels, mask in data:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = step_model(tokens, labels, mask) / len(data)
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        return float(total)  # one host read per step, as a training loop logs its loss

    step.params = sum(p.numel() for p in model.parameters())
    step.release = lambda: None
    return step


def time_bare(c: Shape, compiled: bool, args, device, fp8: bool = False) -> Dict:
    torch.cuda.reset_peak_memory_stats()
    step = bare_runner(c, compiled, device, fp8)
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"times": times, "params": step.params, "loss": loss}


# ----------------------------------------------------------------------------- our trainer


def trainer_config(c: Shape, args, **extra):
    from megatron.training import TrainingConfig

    settings = dict(micro_batch_size=1, global_batch_size=c.microbatches)
    if extra.get("dpo"):  # batch sizes count pairs (2 sequences): the same tokens per step
        settings["global_batch_size"] = c.microbatches // 2
    return TrainingConfig(
        num_layers=c.layers,
        hidden_size=c.hidden,
        num_attention_heads=c.heads,
        num_query_groups=c.groups,
        ffn_hidden_size=c.ffn,
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True,
        vocab_size=c.vocab,
        seq_length=c.seq,
        **settings,
        train_iters=args.warmup + args.steps,
        lr=1e-4,
        bf16=True,
        progress=False,
        **extra,
    )


FUSION_FIELDS = dict(
    bias_activation_fusion=True,
    bias_dropout_fusion=True,
    apply_rope_fusion=True,
    persist_layer_norm=True,
    cross_entropy_loss_fusion=True,
)


def run_ours(c: Shape, args, variant: str, warmup: int, steps: int):
    """``pretrain`` of ``variant`` for warmup + steps iterations; its result."""
    from megatron.training import model as trainer_model
    from megatron.training.training import pretrain

    extra = {}
    if "fused" in variant or "compile" in variant:
        extra["gradient_accumulation_fusion"] = True
    if "compile" in variant:
        extra["compile"] = True
    if "recompute" in variant:  # issue 24: whole layers recomputed, one checkpoint each
        extra.update(recompute_granularity="full", recompute_method="uniform")
        extra["recompute_num_layers"] = 1
    if "selective" in variant:  # megatron-core's default selective module: core attention
        extra["recompute_granularity"] = "selective"
    if "lora" in variant:  # issue 32: rank-8 adapters on every linear layer, base frozen
        extra.update(lora_dim=8, lora_alpha=16.0)
    if "fp8" in variant:  # issue 41: FP8 GEMMs, scales from the global amax
        extra.update(fp8_format="hybrid", fp8_recipe="tensorwise")
    if "dpo" in variant:  # issue 40: DPO (policy forward + backward, reference forward)
        extra["dpo"] = True
    original = trainer_model.transformer_config_from
    if "fused" in variant:  # the library's switches (the trainer has no flag for each)

        def with_fusions(config, layout):
            return dataclasses.replace(original(config, layout), **FUSION_FIELDS)

        trainer_model.transformer_config_from = with_fusions
    from megatron.core.fp8 import cache

    traced_cache = cache.CACHE_WHEN_COMPILED
    if "cached" in variant:  # "-cached" / "-uncached": the weight cache traced or not
        cache.CACHE_WHEN_COMPILED = "uncached" not in variant
    run_args = argparse.Namespace(**{**vars(args), "warmup": warmup, "steps": steps})
    try:
        return pretrain(trainer_config(c, run_args, **extra))
    finally:
        trainer_model.transformer_config_from = original
        cache.CACHE_WHEN_COMPILED = traced_cache


def time_ours(c: Shape, args, variant: str) -> Dict:
    """The timed steps' own ``iteration_time_s``."""
    torch.cuda.reset_peak_memory_stats()
    result = run_ours(c, args, variant, args.warmup, args.steps)
    records = result.records[args.warmup :]
    return {
        "times": [r["iteration_time_s"] for r in records],
        "loss": result.records[-1]["loss"],
    }


def profile_ours(c: Shape, args, variant: str) -> str:
    """A ``torch.profiler`` table (CUDA time) over iterations 2-3 of a 3-iteration run of
    ``variant`` (``prof.step()`` at the end of each iteration, where the trainer logs)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from megatron.training import loop

    original = loop.logged_loss
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        schedule=schedule(wait=1, warmup=0, active=2),
    ) as prof:

        def stepped(*a, **k):
            value = original(*a, **k)
            prof.step()
            return value

        loop.logged_loss = stepped
        try:
            result = run_ours(c, args, variant, 1, 2)
        finally:
            loop.logged_loss = original
    times = ", ".join(f"{r['iteration_time_s'] * 1e3:.1f}" for r in result.records)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=60)
    kinds = _kernel_kinds(prof)
    return f"profile of {variant} (2 iterations; iteration ms: {times})\n{kinds}\n{table}"


KERNEL_KINDS = (
    ("fp8 gemm", ("e4m3", "e5m2", "_qrtst", "_qqtst", "_qrtss", "_qqtss")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("nccl", ("nccl",)),
    ("triton", ("triton",)),
)


def _kernel_kinds(prof) -> str:
    """The GPU kernels' time by kind (the first kind whose words a kernel's name holds)."""
    from torch.autograd import DeviceType

    totals: Dict[str, float] = {}
    for event in prof.events():
        name = event.name.lower()
        if event.device_type != DeviceType.CUDA or name.startswith(("profilerstep", "## ")):
            continue  # annotations, not kernels
        kind = next((k for k, words in KERNEL_KINDS if any(w in name for w in words)), "other")
        totals[kind] = totals.get(kind, 0.0) + event.device_time_total / 1e3
    rows = sorted(totals.items(), key=lambda kv: -kv[1])
    kinds = ", ".join(f"{k} {v:.1f}" for k, v in rows)
    return f"GPU kernel ms: {sum(totals.values()):.1f} ({kinds})"


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["bare", "bare-compiled", "ours", "ours-fused", "ours-compile"],
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--profile", nargs="*", default=[], metavar="VARIANT", help="profile them")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_trainer_gpu.py needs a CUDA GPU")
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    c = Shape(layers=args.layers, seq=args.seq)
    print(
        f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"MEGATRON_ATTENTION_KERNEL={os.environ.get('MEGATRON_ATTENTION_KERNEL')}",
        flush=True,
    )
    results = {}
    params = None
    for variant in args.variants:
        start = time.perf_counter()
        try:
            if variant.startswith("bare"):
                compiled = variant in ("bare-compiled", "bare-fp8-compiled")
                out = time_bare(c, compiled, args, device, fp8="fp8" in variant)
                params = out["params"]
            else:
                out = time_ours(c, args, variant)
        except Exception as exc:  # report it and go on with the other variants
            traceback.print_exc()
            print(f"# {variant}: FAILED ({type(exc).__name__}: {exc})", flush=True)
            torch.cuda.empty_cache()
            continue
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["wall_s"] = time.perf_counter() - start
        results[variant] = out
        torch.cuda.empty_cache()
        print(f"# {variant}: {statistics.median(out['times']) * 1e3:.1f} ms/step, "
              f"loss {out['loss']:.4f}, {out['wall_s']:.0f} s", flush=True)  # fmt: skip
    params = params or _count_params(c)
    tokens = c.microbatches * c.seq
    flops_per_token = 6 * params + 6 * c.layers * c.hidden * c.seq
    print(f"\nparameters {params / 1e9:.3f}B, {tokens} tokens/step, "
          f"{flops_per_token * tokens / 1e12:.1f} model TFLOP/step")  # fmt: skip
    print("| variant | step ms (median, min-max) | tokens/s | model TFLOP/s | peak GiB |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for variant, out in results.items():
        t = statistics.median(out["times"])
        print(
            f"| {variant} | {t * 1e3:.1f} ({min(out['times']) * 1e3:.1f}-"
            f"{max(out['times']) * 1e3:.1f}) | {tokens / t:,.0f} | "
            f"{tokens / t * flops_per_token / 1e12:.0f} | {out['peak_gib']:.1f} |"
        )
    for variant in args.profile:
        print(profile_ours(c, args, variant), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "params": params, "results": results}, handle)


def _count_params(c: Shape) -> int:
    d = c.hidden // c.heads
    per_layer = c.hidden * (c.heads + 2 * c.groups) * d + c.hidden * c.hidden
    per_layer += 3 * c.hidden * c.ffn + 2 * c.hidden
    return c.layers * per_layer + 2 * c.vocab * c.hidden + c.hidden


if __name__ == "__main__":
    main()
