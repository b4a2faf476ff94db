"""Multi-latent attention (MLA) speed (issue 39, "Speed"): one attention layer's forward +
backward against megatron-core 0.16.1's and a bare PyTorch MLA, and the trainer on a few
layers of DeepSeek-V2-Lite's shape.

    python tests/benchmarks/bench_mla.py [--part layer|trainer|all] [--json out.json]
    python tests/benchmarks/bench_mla.py --cpu --tiny        # the CPU smoke test

**Layer** (``--part layer``): ``MLASelfAttention`` at DeepSeek-V2-Lite's shape (hidden 2048,
16 heads, ``q_lora_rank`` None, ``kv_lora_rank`` 512, ``qk_head_dim`` 128,
``qk_pos_emb_head_dim`` 64, ``v_head_dim`` 128, YaRN rope as its config: factor 40, original
4096 positions, beta 32 / 1, mscale = mscale_all_dim = 0.707, rope base 10000, norm eps
1e-6), ``--seq`` tokens (4096) x ``--batch`` (1), bf16, causal. Variants:

- ``ours`` / ``ours-compiled``: this repository's layer (local spec), eager / ``torch.compile``;
- ``bare`` / ``bare-compiled``: the same maths written plainly below (``BareMLA``: the
  projections, RMSNorm of the kv latent, de-interleaving YaRN rope, SDPA with q/k head dim 192
  and v head dim 128, the output projection);
- ``mcore-local`` (``-compiled``; ``-fused-rope``: ``apply_rope_fusion``, its Triton MLA rope,
  CUDA only): megatron-core 0.16.1's ``MLASelfAttention`` from
  ``get_gpt_layer_local_spec(multi_latent_attention=True)``, run in a child process of the
  same launch by ``--mcore-python`` (default ``$MCORE_PYTHON``, else this interpreter) with
  ``PYTHONPATH`` = ``--mcore-path`` (default: none) and the working directory ``/``, so that
  this repository is not imported (where megatron-core is not installed, e.g. a lent GPU
  machine with no registry: copy its package folder, ``site-packages/megatron``, 17 MB, pure
  Python for this layer, numpy and packaging its only other needs, into a folder DIR that
  travels, and pass ``--mcore-path DIR``). Without Transformer Engine 0.16.1's local MLA does not
  build as shipped, nor run on the CPU (smoke test only): the child applies the shims of
  ``mcore_shims.py`` (which says what and why; shared with the megatron-core checkpoint test's
  save script) and passes the causal mask explicitly (its default is made on ``"cuda"``).

Every variant starts from the same weights (each parameter drawn N(0, 0.02) from a generator
seeded by its name, norms 1) and the same input, so ``out`` / ``dx`` (the output and the
input gradient of the first step, each dotted with a fixed random probe) must agree across
variants up to bf16 rounding: the table prints the difference of the dots to the first
variant's over the norm of its tensor (about ||a - b|| / ||a||; bf16: ~3e-3, wrong maths:
~1). Timing: ``--warmup`` steps, then the median of ``--steps`` (each bracketed by
``torch.cuda.synchronize``); peak = ``torch.cuda.max_memory_allocated`` over the timed steps.
TFLOP/s = 3 x forward FLOPs / time, forward FLOPs = b (2 s P + s^2 n (d_qk + d_v)) with P the
layer's projection weights, n heads, d_qk = 192, d_v = 128 (causal attention counted half;
backward = 2 x forward).

**Trainer** (``--part trainer``): ``megatron.training``'s ``pretrain`` (one process, bf16) on
``--trainer-layers`` (4) layers of DeepSeek-V2-Lite's shape: the MLA above, vocabulary 102400
(untied), the first layer dense (FFN 10944), the others MoE (64 experts of FFN 1408, top-6,
softmax over all experts before the top-k as V2-Lite, 2 shared experts = one shared FFN of
2816, GroupedMLP, alltoall, sequence aux loss 1e-3), sequence ``--trainer-seq`` (4096), 4
micro-batches of one sequence per step. The config is built as ``bench_trainer_gpu.py`` does,
with megatron's field names; a field ``TrainingConfig`` does not have yet (the DeepSeek flags
are being added) makes the variant FAILED, naming it. tokens/s = tokens per step / median
``iteration_time_s``; model TFLOP/s = tokens/s x (6 P_mm + 3 L s n (d_qk + d_v)) with P_mm
the active parameters a token multiplies with (every parameter but the input embedding, the
routed experts counted k/E: ``active_params`` minus the embedding) and the causal attention
term of every layer; ``active_params`` = all parameters with the routed experts counted k/E
(the embedding included, as DeepSeek counts "2.4B active").

Variants (``--trainer-variants``): ``trainer`` (eager), ``trainer-mha`` (the same model with
plain multi-head attention of 128 channels instead of MLA: the MLA cost in the trainer, and a
run that needs none of the new flags) and, opt-in, ``-compile`` of either (the trainer's
``--compile``; the MoE experts compile once whatever the split of tokens over the experts:
docs/moe.md).

Each variant runs in its own ``try``: one that fails prints ``FAILED`` and the others go on.
On a machine with a 10-minute limit per command, run ``--part layer`` and ``--part trainer``
as two commands.
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
import zlib
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from bench_moe import init_single_process  # noqa: E402


@dataclasses.dataclass
class MLAShape:
    """An MLA layer (DeepSeek-V2-Lite's by default) and a V2-Lite-like MoE model around it."""

    hidden: int = 2048
    heads: int = 16
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rotary_base: float = 10000.0
    rotary_scaling_factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.707
    mscale_all_dim: float = 0.707
    eps: float = 1e-6
    vocab: int = 102400
    dense_ffn: int = 10944
    experts: int = 64
    topk: int = 6
    moe_ffn: int = 1408
    shared_ffn: int = 2816  # 2 shared experts of 1408


TINY = MLAShape(
    hidden=64, heads=4, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
    vocab=512, dense_ffn=128, experts=8, topk=2, moe_ffn=32, shared_ffn=64,
)  # fmt: skip


def mla_fields(c: MLAShape) -> dict:
    """The ``MLATransformerConfig`` fields of the layer (the same names in megatron-core)."""
    return dict(
        hidden_size=c.hidden,
        num_attention_heads=c.heads,
        kv_channels=c.v_head_dim,
        q_lora_rank=None,
        kv_lora_rank=c.kv_lora_rank,
        qk_head_dim=c.qk_head_dim,
        qk_pos_emb_head_dim=c.qk_pos_emb_head_dim,
        v_head_dim=c.v_head_dim,
        rope_type="yarn",
        rotary_base=c.rotary_base,
        rotary_scaling_factor=c.rotary_scaling_factor,
        original_max_position_embeddings=c.original_max_position_embeddings,
        beta_fast=c.beta_fast,
        beta_slow=c.beta_slow,
        mscale=c.mscale,
        mscale_all_dim=c.mscale_all_dim,
        layernorm_epsilon=c.eps,
        normalization="RMSNorm",
        qk_layernorm=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def init_by_name(module: torch.nn.Module) -> None:
    """Norm weights 1, every other parameter N(0, 0.02) from a generator seeded by its name
    (the same weights in every implementation that uses megatron-core's names)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "layernorm" in name:
                p.fill_(1.0)
                continue
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


# ----------------------------------------------------------------------------- bare MLA


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_cos_sin(c: MLAShape, seq: int, device, dtype) -> tuple:
    """cos, sin [s, 1, 1, d] of YaRN rope (DeepSeek's formulas, computed in float32)."""
    d, base, factor = c.qk_pos_emb_head_dim, c.rotary_base, c.rotary_scaling_factor
    extra = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)

    def correction_dim(rotations: float) -> float:
        ratio = c.original_max_position_embeddings / (rotations * 2 * math.pi)
        return d * math.log(ratio) / (2 * math.log(base))

    low = max(math.floor(correction_dim(c.beta_fast)), 0)
    high = min(math.ceil(correction_dim(c.beta_slow)), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = extra / factor * ramp + extra * (1 - ramp)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    scale = _yarn_mscale(factor, c.mscale) / _yarn_mscale(factor, c.mscale_all_dim)
    return (angles.cos() * scale).to(device, dtype), (angles.sin() * scale).to(device, dtype)


class BareMLA(torch.nn.Module):
    """MLA written plainly (megatron-core's parameter names and layouts; [s, b, h] in and
    out): q per head [nope | rope], the kv latent [c_kv | k_pe], k_nope and v per head from
    the normed latent, de-interleaving rope on the rope parts (one k_pe for every head),
    SDPA (causal), the output projection."""

    def __init__(self, c: MLAShape, seq: int, device, dtype) -> None:
        super().__init__()
        self.c = c
        n, dn, dr, dv = c.heads, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim

        def linear(i: int, o: int) -> torch.nn.Linear:
            return torch.nn.Linear(i, o, bias=False, device=device, dtype=dtype)

        self.linear_q_proj = linear(c.hidden, n * (dn + dr))
        self.linear_kv_down_proj = linear(c.hidden, c.kv_lora_rank + dr)
        self.kv_layernorm = torch.nn.RMSNorm(c.kv_lora_rank, c.eps, device=device, dtype=dtype)
        self.linear_kv_up_proj = linear(c.kv_lora_rank, n * (dn + dv))
        self.linear_proj = linear(n * dv, c.hidden)
        self.cos, self.sin = yarn_cos_sin(c, seq, device, dtype)
        self.scale = _yarn_mscale(c.rotary_scaling_factor, c.mscale_all_dim) ** 2
        self.scale /= math.sqrt(dn + dr)

    def _rope(self, t: torch.Tensor) -> torch.Tensor:
        t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
        t1, t2 = t.chunk(2, dim=-1)
        return t * self.cos + torch.cat((-t2, t1), dim=-1) * self.sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        s, b, _ = x.shape
        n, dn, dr, dv = c.heads, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
        q_nope, q_pe = self.linear_q_proj(x).view(s, b, n, dn + dr).split([dn, dr], dim=-1)
        c_kv, k_pe = self.linear_kv_down_proj(x).split([c.kv_lora_rank, dr], dim=-1)
        kv = self.linear_kv_up_proj(self.kv_layernorm(c_kv)).view(s, b, n, dn + dv)
        k_nope, v = kv.split([dn, dv], dim=-1)
        q = torch.cat((q_nope, self._rope(q_pe)), dim=-1)
        k = torch.cat((k_nope, self._rope(k_pe.unsqueeze(2)).expand(-1, -1, n, -1)), dim=-1)
        # [b, n, s, d], contiguous: inductor's CPU SDPA fails on the permuted views (torch 2.13)
        q, k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.linear_proj(o.permute(2, 0, 1, 3).reshape(s, b, n * dv))


# ----------------------------------------------------------------------------- layer timing


def layer_flops(c: MLAShape, seq: int, batch: int) -> float:
    """Forward + backward FLOPs of one layer (module docstring)."""
    n, dqk, dv = c.heads, c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim
    weights = c.hidden * n * dqk + c.hidden * (c.kv_lora_rank + c.qk_pos_emb_head_dim)
    weights += c.kv_lora_rank * n * (c.qk_head_dim + dv) + n * dv * c.hidden
    return 3 * batch * (2 * seq * weights + seq * seq * n * (dqk + dv))


def _probe(t: torch.Tensor, seed: int) -> tuple:
    """(t dotted with a fixed N(0, 1) probe, ||t||), the same probe in every process: the
    dots of two tensors a, b differ by about ||a - b||."""
    t = t.detach().double().cpu()
    probe = torch.randn(t.shape, generator=torch.Generator().manual_seed(seed))
    return float((t * probe).sum()), float(t.norm())


def time_layer(
    forward: Callable[[torch.Tensor], torch.Tensor], c: MLAShape, args, device, dtype
) -> Dict[str, float]:
    """Median forward + backward time of ``forward`` ([s, b, h] -> [s, b, h]), TFLOP/s, peak
    memory and the probes of the first step's output and input gradient."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.seq, args.batch, c.hidden, generator=gen).to(device, dtype)
    grad = torch.randn(args.seq, args.batch, c.hidden, generator=gen).to(device, dtype)
    x.requires_grad_(True)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, probes = [], {}
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = forward(x)
        out.backward(grad)
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        if i == 0:
            (out_dot, out_norm), (dx_dot, dx_norm) = _probe(out, 2), _probe(x.grad, 3)
            probes = dict(out=out_dot, out_norm=out_norm, dx=dx_dot, dx_norm=dx_norm)
        x.grad = None
        del out
    median = statistics.median(times)
    return {
        "ms": 1e3 * median,
        "tflops": layer_flops(c, args.seq, args.batch) / median / 1e12,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        **probes,
    }


def build_ours(c: MLAShape, device, dtype) -> torch.nn.Module:
    """``MLASelfAttention`` from the local spec of whichever ``megatron.core`` is imported."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=1,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_cpu_initialization=device.type == "cpu",
        **mla_fields(c),
    )
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
    attention = spec.submodules.self_attention
    layer = MLASelfAttention(config, attention.submodules, layer_number=1, **attention.params)
    layer = layer.to(device)
    init_by_name(layer)
    return layer


def layer_forward(name: str, c: MLAShape, args, device, dtype, build=build_ours, mask=None):
    """The forward of variant ``name`` (its ``-compiled`` suffix: under ``torch.compile``)."""
    if name.startswith("bare"):
        module = BareMLA(c, args.seq, device, dtype)
        init_by_name(module)
        call = module
    else:
        module = build(c, device, dtype)

        def call(x):
            return module(x, mask)[0]

    if name.endswith("-compiled"):
        call = torch.compile(call)
    return call


def _one_line(error: BaseException) -> str:
    """The error's type and the first lines of its message, on one line (for the table)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {' / '.join(lines[:2])}"[:300]


def run_layer_variants(names: List[str], c: MLAShape, args, device, dtype, **build) -> dict:
    """Time each variant in this process; a failure is recorded and printed, not raised."""
    out = {}
    for name in names:
        try:
            forward = layer_forward(name, c, args, device, dtype, **build)
            out[name] = time_layer(forward, c, args, device, dtype)
            print(f"# {name}: {out[name]['ms']:.2f} ms", flush=True)
        except Exception as error:  # noqa: BLE001 - reported per variant
            traceback.print_exc()
            out[name] = {"error": _one_line(error)}
            print(f"# {name}: FAILED ({out[name]['error']})", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------- megatron-core


def mcore_child(args, names: List[str]) -> Dict[str, dict]:
    """Run ``--mcore-worker`` with ``--mcore-python`` (``--mcore-path`` on its path)."""
    python = args.mcore_python or os.environ.get("MCORE_PYTHON") or sys.executable
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MASTER_PORT")}
    if args.mcore_path:
        env["PYTHONPATH"] = args.mcore_path
    cmd = [python, os.path.abspath(__file__), "--mcore-worker", "--variants", *names]
    cmd += ["--seq", str(args.seq), "--batch", str(args.batch)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--cpu"] * args.cpu + ["--tiny"] * args.tiny
    cmd += ["--mcore-timeout", str(args.mcore_timeout)]
    try:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, cwd="/", timeout=args.mcore_timeout
        )
    except subprocess.TimeoutExpired as late:  # the child dumps its stacks before this
        for stream in (late.stdout, late.stderr):
            text = stream.decode(errors="replace") if isinstance(stream, bytes) else stream
            sys.stdout.write("".join(f"#   child: {line}\n" for line in (text or "").splitlines()))
        return {n: {"error": f"timed out after {args.mcore_timeout} s"} for n in names}
    sys.stdout.write("".join(f"#   child: {line}\n" for line in done.stdout.splitlines()))
    for line in done.stdout.splitlines():
        if line.startswith("MCORE_RESULT "):
            return json.loads(line[len("MCORE_RESULT ") :])
    tail = (done.stderr or "").splitlines()[-60:]
    sys.stdout.write("".join(f"#   child (stderr): {line}\n" for line in tail))
    why = " | ".join((done.stderr or done.stdout).strip().splitlines()[-4:])
    return {n: {"error": f"{python}: {why}"[:400]} for n in names}


def build_mcore(c: MLAShape, device, dtype, rope_fusion: bool = False) -> torch.nn.Module:
    """megatron-core 0.16.1's local-spec ``MLASelfAttention``, its core attention without the
    ``k_channels`` / ``v_channels`` arguments its local ``DotProductAttention`` rejects."""
    from mcore_shims import local_core_attention

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=1,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_cpu_initialization=device.type == "cpu",
        apply_rope_fusion=rope_fusion,
        **mla_fields(c),
    )
    spec = get_gpt_layer_local_spec(
        multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm"
    )
    attention = spec.submodules.self_attention
    core = local_core_attention()
    submodules = dataclasses.replace(attention.submodules, core_attention=core)
    layer = MLASelfAttention(config, submodules, layer_number=1, **attention.params).to(device)
    init_by_name(layer)
    return layer


def mcore_worker(args) -> None:
    """The child: time megatron-core's layer variants, print ``MCORE_RESULT {json}``; a child
    still running shortly before the parent's timeout prints every thread's stack and exits."""
    import faulthandler

    faulthandler.dump_traceback_later(max(args.mcore_timeout - 20, 5), exit=True)
    try:
        from megatron.core import package_info
    except ImportError as error:
        import megatron.core

        where = os.path.dirname(megatron.core.__file__)
        raise SystemExit(f"not megatron-core (set MCORE_PYTHON / --mcore-path): {where}") from error
    device, dtype, c = setup(args)
    from mcore_shims import apply_shims

    shims = apply_shims(args.cpu)
    if not args.cpu:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    mask = None
    if args.cpu:  # its default causal mask is made on "cuda"
        mask = torch.ones(args.seq, args.seq, dtype=torch.bool).triu(1)[None, None]
    out = {}
    for name in args.variants:
        fusion = name.endswith("fused-rope")

        def build(*a, fusion=fusion):
            return build_mcore(*a, rope_fusion=fusion)

        out.update(run_layer_variants([name], c, args, device, dtype, build=build, mask=mask))
        out[name]["version"] = package_info.__version__
        out[name]["shims"] = shims
    print("MCORE_RESULT " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------- trainer


MLA_FIELDS = (
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
    "v_head_dim", "qk_layernorm", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
)  # fmt: skip


def trainer_fields(c: MLAShape, layers: int, mla: bool = True) -> dict:
    """The V2-Lite-shaped model as ``TrainingConfig`` fields (megatron's flag names); ``mla``
    False: plain multi-head attention of ``v_head_dim`` channels instead."""
    fields = dict(
        num_layers=layers,
        hidden_size=c.hidden,
        num_attention_heads=c.heads,
        ffn_hidden_size=c.dense_ffn,
        normalization="RMSNorm",
        norm_epsilon=c.eps,
        swiglu=True,
        position_embedding_type="rope",
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True,
        vocab_size=c.vocab,
        multi_latent_attention=True,
        q_lora_rank=None,
        kv_lora_rank=c.kv_lora_rank,
        qk_head_dim=c.qk_head_dim,
        qk_pos_emb_head_dim=c.qk_pos_emb_head_dim,
        v_head_dim=c.v_head_dim,
        qk_layernorm=True,
        rope_type="yarn",
        rotary_base=c.rotary_base,
        rotary_scaling_factor=c.rotary_scaling_factor,
        mscale=c.mscale,
        mscale_all_dim=c.mscale_all_dim,
        num_experts=c.experts,
        moe_router_topk=c.topk,
        moe_ffn_hidden_size=c.moe_ffn,
        moe_shared_expert_intermediate_size=c.shared_ffn,
        moe_layer_freq=[0] + [1] * (layers - 1),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=True,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-3,
        moe_grouped_gemm=True,
        moe_token_dispatcher_type="alltoall",
    )
    if not mla:
        fields = {k: v for k, v in fields.items() if k not in MLA_FIELDS}
        fields["kv_channels"] = c.v_head_dim
    return fields


def model_params(c: MLAShape, layers: int, mla: bool = True) -> Dict[str, int]:
    """Parameter counts of the trainer's model: total, active (routed experts k/E) and the
    input embedding."""
    n, dn, dr, dv, h = c.heads, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim, c.hidden
    attention = h + h * n * (dn + dr) + h * (c.kv_lora_rank + dr) + c.kv_lora_rank
    attention += c.kv_lora_rank * n * (dn + dv) + n * dv * h
    if not mla:
        attention = h + 4 * h * n * dv
    dense = h + 3 * h * c.dense_ffn
    routed = 3 * h * c.moe_ffn * c.experts
    moe = h + c.experts * h + 3 * h * c.shared_ffn
    moe_layers = max(layers - 1, 0)
    embedding = c.vocab * h
    total = layers * attention + (layers - moe_layers) * dense + moe_layers * (moe + routed)
    total += 2 * embedding + h
    active = total - moe_layers * routed * (c.experts - c.topk) // c.experts
    return {"total": total, "active": active, "embedding": embedding}


def check_param_count(c: MLAShape, layers: int, mla: bool = True) -> Optional[str]:
    """``model_params`` against the GPTModel the library builds from the same fields (the
    tiny shape, on the CPU); None when equal, else what differs."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    attention = mla_fields(c)
    if not mla:
        keep = ("hidden_size", "num_attention_heads", "kv_channels", "normalization")
        keep += ("hidden_dropout", "attention_dropout")
        attention = {k: attention[k] for k in keep} | {"add_bias_linear": False}
    config = (MLATransformerConfig if mla else TransformerConfig)(
        num_layers=layers,
        ffn_hidden_size=c.dense_ffn,
        gated_linear_unit=True,
        num_moe_experts=c.experts,
        moe_router_topk=c.topk,
        moe_ffn_hidden_size=c.moe_ffn,
        moe_shared_expert_intermediate_size=c.shared_ffn,
        moe_layer_freq=[0] + [1] * (layers - 1),
        moe_grouped_gemm=True,
        use_cpu_initialization=True,
        **attention,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    gpt = GPTModel(
        config, spec, c.vocab, 64, share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )  # fmt: skip
    built = sum(p.numel() for p in gpt.parameters())
    counted = model_params(c, layers, mla)["total"]
    return None if built == counted else f"built {built} parameters, counted {counted}"


def run_trainer(c: MLAShape, args, variant: str, bf16: bool) -> dict:
    """``pretrain`` of the V2-Lite-shaped model; tokens/s, TFLOP/s, peak (docstring)."""
    from megatron.training import TrainingConfig
    from megatron.training.training import pretrain

    mla = "mha" not in variant
    fields = trainer_fields(c, args.trainer_layers, mla)
    known = {f.name for f in dataclasses.fields(TrainingConfig)}
    missing = sorted(set(fields) - known)
    if missing:
        raise TypeError(f"TrainingConfig has no field(s) {', '.join(missing)} (not merged yet?)")
    if "compile" in variant:
        fields["compile"] = True
    config = TrainingConfig(
        **fields, seq_length=args.trainer_seq, micro_batch_size=1, global_batch_size=4,
        train_iters=args.warmup + args.steps, lr=1e-4, bf16=bf16, progress=False,
    )  # fmt: skip
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    result = pretrain(config)
    median = statistics.median(r["iteration_time_s"] for r in result.records[args.warmup :])
    tokens = 4 * args.trainer_seq
    params = model_params(c, args.trainer_layers, mla)
    attention = 3 * args.trainer_layers * args.trainer_seq * c.heads
    attention *= c.qk_head_dim + c.qk_pos_emb_head_dim + c.v_head_dim if mla else 2 * c.v_head_dim
    flops = tokens / median * (6 * (params["active"] - params["embedding"]) + attention)
    return {
        "step_s": median,
        "tokens_per_s": tokens / median,
        "model_tflops": flops / 1e12,
        "active_params": params["active"],
        "total_params": params["total"],
        "peak_gib": (
            torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        ),
        "loss_last": result.records[-1].get("loss"),
    }


def trainer_part(c: MLAShape, args) -> dict:
    """Every ``--trainer-variants`` entry, each in its own try."""
    out = {}
    if args.tiny:
        try:
            checks = [check_param_count(c, args.trainer_layers, mla) for mla in (True, False)]
            out["param_count_check"] = "; ".join(filter(None, checks)) or "ok"
        except Exception as error:  # noqa: BLE001 - reported, the runs go on
            out["param_count_check"] = f"FAILED ({_one_line(error)})"
        print(f"# parameter count check: {out['param_count_check']}", flush=True)
    for variant in args.trainer_variants:
        try:
            out[variant] = run_trainer(c, args, variant, bf16=not args.cpu)
            print(f"# {variant}: {json.dumps(out[variant])}", flush=True)
        except Exception as error:  # noqa: BLE001 - reported per variant
            traceback.print_exc()
            out[variant] = {"error": _one_line(error)}
            print(f"# {variant}: FAILED ({out[variant]['error']})", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------- main


def setup(args):
    """(device, dtype, shape) of the run, with the one-process group initialized."""
    device = torch.device("cpu" if args.cpu else "cuda")
    if args.cpu:
        torch.set_num_threads(args.threads or max(1, min(2, torch.get_num_threads())))
    else:
        torch.cuda.set_device(0)
    init_single_process("gloo" if args.cpu else "nccl")
    dtype = torch.float32 if args.cpu and not args.bf16 else torch.bfloat16
    return device, dtype, TINY if args.tiny else MLAShape()


def teardown() -> None:
    """Release the layer part's process group before ``pretrain`` makes its own."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def print_layer_table(results: dict, c: MLAShape, args, dtype) -> None:
    print(
        f"\nMLA layer, hidden {c.hidden}, {c.heads} heads, kv_lora_rank {c.kv_lora_rank}, "
        f"s {args.seq} x b {args.batch}, {str(dtype)[6:]}, forward + backward, "
        f"{layer_flops(c, args.seq, args.batch) / 1e12:.3f} TFLOP/step"
    )
    print("| variant | ms | TFLOP/s | peak GiB | out rel. diff | dx rel. diff |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    ref = next((r for r in results.values() if "error" not in r), None)
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | FAILED: {r['error']} | | | | |")
            continue
        d_out = abs(r["out"] - ref["out"]) / max(ref["out_norm"], 1e-30)
        d_dx = abs(r["dx"] - ref["dx"]) / max(ref["dx_norm"], 1e-30)
        print(
            f"| {name} | {r['ms']:.2f} | {r['tflops']:.1f} | {r['peak_gib']:.2f} | "
            f"{d_out:.1e} | {d_dx:.1e} |"
        )


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("layer", "trainer", "all"), default="all")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--bf16", action="store_true", help="bf16 on the CPU too")
    parser.add_argument("--seq", type=int, default=None, help="layer: tokens (4096; tiny 64)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="CPU: torch threads")
    parser.add_argument("--variants", nargs="+", default=None, help="layer variants")
    parser.add_argument("--no-mcore", action="store_true", help="skip megatron-core's layer")
    parser.add_argument("--mcore-python", default=None, help="default: $MCORE_PYTHON")
    parser.add_argument("--mcore-path", default=None, help="PYTHONPATH of the child")
    parser.add_argument("--mcore-timeout", type=int, default=480)
    parser.add_argument("--mcore-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trainer-layers", type=int, default=4)
    parser.add_argument("--trainer-seq", type=int, default=None, help="4096; tiny 64")
    parser.add_argument("--trainer-variants", nargs="+", default=["trainer", "trainer-mha"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.seq = args.seq or (64 if args.tiny else 4096)
    args.trainer_seq = args.trainer_seq or (64 if args.tiny else 4096)
    if args.mcore_worker:
        return mcore_worker(args)
    ours = ["ours", "ours-compiled", "bare", "bare-compiled"]
    mcore = ["mcore-local", "mcore-local-compiled"] + ["mcore-local-fused-rope"] * (not args.cpu)
    names = args.variants or ours + mcore
    record: Dict[str, object] = {"torch": torch.__version__, "args": vars(args)}
    if not args.cpu:
        record["device"] = torch.cuda.get_device_name(0)
    print(f"# {record.get('device', 'cpu')}, torch {torch.__version__}", flush=True)
    device, dtype, c = setup(args)
    if args.part in ("layer", "all"):
        own = [n for n in names if not n.startswith("mcore")]
        layers = run_layer_variants(own, c, args, device, dtype)
        wanted = [n for n in names if n.startswith("mcore")]
        if wanted and not args.no_mcore:
            for name in wanted:  # one child each: a hang costs one variant
                layers.update(mcore_child(args, [name]))
        record["layer"] = layers
        print_layer_table(layers, c, args, dtype)
    if args.part in ("trainer", "all"):
        teardown()
        record["trainer"] = trainer_part(c, args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()
