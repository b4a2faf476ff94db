"""Mixture-of-experts benchmarks (issue 30).

CPU (default): a training step of a small MoE GPT against a dense GPT with the same ACTIVE
parameters (the dense FFN is k x the expert FFN), one process, our schedule, DDP, finalize
and Adam (fp32); variants interleaved step by step, wall and process CPU time (see
``cpu_step_benchmark``):

    python tests/benchmarks/bench_moe.py [--steps 10] [--threads 1] [--json out.json]

GPU (``--gpu``): one MoE layer's forward + backward in bf16 at Qwen3-30B-A3B's shape (E 128,
k 8, hidden 2048, expert FFN 768) and OLMoE's (E 64, k 8, hidden 2048, FFN 1024), EP = 1,
alltoall dispatcher, the aux loss (``--aux-loss-coeff``, 1e-3; 0 = none), on ``--tokens``
tokens ([s, b] = [tokens, 1]):

    python tests/benchmarks/bench_moe.py --gpu [--mcore-path DIR] [--json out.json]

Variants, each timed over ``--steps`` steps after ``--warmup`` (each step bracketed by
``torch.cuda.synchronize``; peak = ``torch.cuda.max_memory_allocated`` during the variant):
- ``ours-sequential``: our ``MoELayer`` with ``SequentialMLP`` (one GEMM per expert);
- ``ours-grouped``: our ``MoELayer`` with ``GroupedMLP`` (``torch._grouped_mm`` on CUDA);
- ``ours-grouped-fp8``: the same with FP8 experts (``fp8="hybrid"``, tensorwise, one
  ``torch._scaled_mm`` per expert, scales from the global amax; issue 41, docs/fp8.md);
- ``bare-grouped-mm``: the floor: ~30 lines of PyTorch (router, top-k, softmax, argsort,
  gather, two ``torch._grouped_mm`` with SwiGLU between, weighted ``index_add_``, and the
  same aux loss);
- ``mcore-sequential``: megatron-core 0.16.1's local-spec MoE layer (``SequentialMLP``;
  its ``GroupedMLP`` needs the ``grouped_gemm`` package, its ``TEGroupedMLP`` Transformer
  Engine), run in a child process of the same launch whose ``PYTHONPATH`` is
  ``--mcore-path`` (a directory holding megatron-core 0.16.1, e.g. made offline with
  ``pip install --no-deps --target DIR megatron_core-0.16.1-*.whl``); skipped, saying why,
  when it cannot import or run.
Every variant starts from weights drawn N(0, 0.02) with the same seed (routing balance is
then statistically the same); tokens/s = tokens / median step time.

Trainer (``--trainer``): ``megatron.training``'s ``pretrain`` (one process, ``--bf16``) on a
MoE model of ``--trainer-layers`` layers of Qwen3-30B-A3B's shape (hidden 2048, 32 heads,
4 query groups of 128 channels, 128 experts of FFN 768, top-8, vocabulary 151936,
GroupedMLP, alltoall; no q/k norm: the trainer has no flag for it), sequence
``--trainer-seq``, 4 micro-batches of one sequence per step;
tokens/s from the trainer's own ``iteration_time_s`` (median of the timed steps), model
TFLOP/s = tokens/s x (6 P_active + 6 L h s) (P_active: the non-expert parameters plus k/E
of the expert ones; causal attention counted half), peak = ``torch.cuda.max_memory_allocated``.
Extra trainer flags can follow ``--trainer-args``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")

SHAPES = {
    "qwen3-30b-a3b": dict(experts=128, topk=8, hidden=2048, ffn=768),
    "olmoe": dict(experts=64, topk=8, hidden=2048, ffn=1024),
    "tiny": dict(experts=8, topk=2, hidden=64, ffn=32),
}


# ----------------------------------------------------------------------------- MoE layer


def layer_config(config_cls, shape: dict, grouped: bool, bf16: bool, aux_coeff: float):
    """The same TransformerConfig for ours and megatron-core (same field names)."""
    return config_cls(
        num_layers=1,
        hidden_size=shape["hidden"],
        num_attention_heads=16,
        ffn_hidden_size=shape["ffn"],
        moe_ffn_hidden_size=shape["ffn"],
        num_moe_experts=shape["experts"],
        moe_router_topk=shape["topk"],
        moe_router_load_balancing_type="aux_loss" if aux_coeff else "none",
        moe_aux_loss_coeff=aux_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=grouped,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def build_moe_layer(
    grouped: bool,
    shape: dict,
    device: torch.device,
    bf16: bool,
    aux_coeff: float = 1e-3,
    fp8: bool = False,
):
    """``MoELayer`` from ``get_gpt_layer_local_spec(num_experts=...)`` of whichever
    ``megatron.core`` is imported (ours, or megatron-core in the child process); ``fp8``:
    hybrid tensorwise FP8 experts (ours)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_layer import MoELayer

    config = layer_config(TransformerConfig, shape, grouped, bf16, aux_coeff)
    if fp8:
        config.fp8, config.fp8_recipe = "hybrid", "tensorwise"
    spec = get_gpt_layer_local_spec(num_experts=shape["experts"], moe_grouped_gemm=grouped)
    layer = MoELayer(config, spec.submodules.mlp.submodules, layer_number=1).to(device)
    _init(layer.parameters())
    return layer


def _init(params) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in params:
            p.normal_(0.0, 0.02)


def moe_step(layer) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def step(x: torch.Tensor, grad: torch.Tensor) -> None:
        out, _ = layer(x)
        out.backward(grad)

    return step


class BareMoE(torch.nn.Module):
    """The floor: softmax-after-top-k routing, experts as two stacked weights,
    ``torch._grouped_mm`` over the tokens sorted by expert, and the same load-balancing
    loss as the layer's (aux_loss: E c / (k T^2) sum_e n_e sum_x p_e(x)) when
    ``aux_coeff`` is set. ``forward`` returns (output, aux loss or None)."""

    def __init__(self, shape: dict, dtype: torch.dtype, device: torch.device, aux_coeff: float):
        super().__init__()
        E, h, f = shape["experts"], shape["hidden"], shape["ffn"]
        self.topk, self.aux_coeff = shape["topk"], aux_coeff
        self.router = torch.nn.Parameter(torch.empty(E, h, dtype=dtype, device=device))
        self.w1 = torch.nn.Parameter(torch.empty(E, h, 2 * f, dtype=dtype, device=device))
        self.w2 = torch.nn.Parameter(torch.empty(E, f, h, dtype=dtype, device=device))
        _init(self.parameters())

    def forward(self, x: torch.Tensor):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = x @ self.router.t()
        top, idx = logits.topk(self.topk, dim=-1)
        probs = top.softmax(dim=-1)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // self.topk
        counts = torch.bincount(flat, minlength=self.router.shape[0])
        offs = counts.cumsum(0).to(torch.int32)
        hidden = torch._grouped_mm(x[token], self.w1, offs=offs)
        gate, up = hidden.chunk(2, dim=-1)
        act = F.silu(gate) * up * probs.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        out = torch._grouped_mm(act, self.w2, offs=offs)
        out = torch.zeros_like(x).index_add_(0, token, out).view(shape)
        aux = None
        if self.aux_coeff:
            experts, tokens = self.router.shape[0], x.shape[0]
            scale = experts * self.aux_coeff / (self.topk * tokens * tokens)
            aux = scale * (counts.to(logits.dtype) * logits.softmax(dim=-1).sum(dim=0)).sum()
        return out, aux


def bare_step(bare: BareMoE, x: torch.Tensor, grad: torch.Tensor) -> None:
    """The bare loop's forward + backward (its aux loss's gradient 1, as the layer's)."""
    out, aux = bare(x)
    if aux is None:
        out.backward(grad)
    else:
        torch.autograd.backward((out, aux), (grad, torch.ones_like(aux)))


def time_variant(
    step: Callable[[torch.Tensor, torch.Tensor], None],
    tokens: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    steps: int,
) -> Dict[str, float]:
    """Median step time, tokens/s and peak memory of ``step(x, grad)``."""
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, 1, hidden, dtype=dtype, device=device, generator=gen)
    x.requires_grad_(True)
    grad = torch.randn(tokens, 1, hidden, dtype=dtype, device=device, generator=gen)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(x, grad)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        x.grad = None
    median = statistics.median(times)
    return {
        "step_ms": 1e3 * median,
        "tokens_per_s": tokens / median,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
    }


def variant_step(
    name: str, shape: dict, device: torch.device, bf16: bool, aux_coeff: float
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``step(x, grad)``: one forward + backward of variant ``name`` ("ours-sequential",
    "ours-grouped", "ours-grouped-fp8", "mcore-sequential" in the child, "bare-grouped-mm")."""
    if name == "bare-grouped-mm":
        dtype = torch.bfloat16 if bf16 else torch.float32
        bare = BareMoE(shape, dtype, device, aux_coeff)
        return lambda x, grad: bare_step(bare, x, grad)
    grouped, fp8 = "grouped" in name, name.endswith("fp8")
    return moe_step(build_moe_layer(grouped, shape, device, bf16, aux_coeff, fp8))


def layer_variants(names: List[str], shape: dict, args, device) -> Dict[str, dict]:
    """Time our layers and the bare loop (in this process)."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    out = {}
    for name in names:
        try:
            step = variant_step(name, shape, device, args.bf16, args.aux_loss_coeff)
            out[name] = time_variant(
                step, args.tokens, shape["hidden"], dtype, device, args.warmup, args.steps
            )
        except Exception as error:  # noqa: BLE001 - reported per variant
            out[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
        print(f"# {name}: {out[name]}", flush=True)  # as it goes (a killed run shows these)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def init_single_process(backend: str) -> None:
    """A one-process torch.distributed group and parallel_state at size 1."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group(backend, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()


def mcore_child(args, shapes: List[str]) -> Dict[str, dict]:
    """Run ``--mcore-worker`` in a child process with megatron-core on its path."""
    if not args.mcore_path:
        return {s: {"mcore-sequential": {"error": "no --mcore-path given"}} for s in shapes}
    env = dict(os.environ, PYTHONPATH=args.mcore_path)
    env.pop("MASTER_PORT", None)  # the parent's group holds that port: the child picks its own
    cmd = [sys.executable, os.path.abspath(__file__), "--mcore-worker", "--shapes", *shapes]
    cmd += ["--tokens", str(args.tokens), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--aux-loss-coeff", str(args.aux_loss_coeff)]
    cmd += ["--bf16"] if args.bf16 else []
    done = subprocess.run(
        cmd, env=env, capture_output=True, text=True, cwd="/", timeout=args.mcore_timeout
    )
    for line in done.stdout.splitlines():
        if line.startswith("MCORE_RESULT "):
            return json.loads(line[len("MCORE_RESULT ") :])
    why = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {s: {"mcore-sequential": {"error": " | ".join(why)[:300]}} for s in shapes}


def mcore_worker(args) -> None:
    """The child: megatron-core 0.16.1's local-spec MoE layer (SequentialMLP).

    Without Transformer Engine, 0.16.1's router gate (``router_gating_linear``) reads the
    module global ``te_general_gemm``, which its failed TE import never defined (NameError);
    set to None it takes the function's own ``torch.mm`` branch, as that code intends."""
    import megatron.core
    from megatron.core.transformer.moe import moe_utils as mcore_moe_utils

    if not hasattr(mcore_moe_utils, "te_general_gemm"):
        mcore_moe_utils.te_general_gemm = None
    device = torch.device("cuda")
    init_single_process("nccl")
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    out = {}
    for name in args.shapes:
        result = layer_variants(["mcore-sequential"], SHAPES[name], args, device)
        result["mcore-sequential"]["version"] = getattr(megatron.core, "__version__", "?")
        out[name] = result
    print("MCORE_RESULT " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------- CPU step


def cpu_step_benchmark(args) -> Dict[str, dict]:
    """Train-step time of a small MoE GPT vs the dense GPT of the same active parameters.

    The variants are built first and their steps interleaved (round-robin, ``--warmup`` then
    ``--steps`` rounds), so a load change on a shared machine hits every variant alike. Each
    step is the forward + backward of our schedule, DDP and finalize, then the optimizer
    (Adam) step; it is timed twice: wall clock and this process's CPU time
    (``time.process_time``: with one thread, what the step cost whatever else the machine
    ran). Medians are reported, and the MoE / dense ratio of each."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    init_single_process("gloo")
    h, layers, seq, mbs, vocab = args.cpu_hidden, 4, args.cpu_seq, 2, 1024
    E, k, f = 8, 2, args.cpu_hidden
    variants = {
        "dense": dict(ffn_hidden_size=k * f),
        "moe-sequential": dict(num_moe_experts=E, moe_router_topk=k, moe_ffn_hidden_size=f),
        "moe-grouped": dict(
            num_moe_experts=E, moe_router_topk=k, moe_ffn_hidden_size=f, moe_grouped_gemm=True
        ),
    }
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (mbs, seq), generator=gen)
    batch = {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, 1),
        "position_ids": torch.arange(seq).expand(mbs, seq),
    }

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])

        def loss_func(output):
            return output.sum(), torch.tensor(output.numel()), {}

        return out, loss_func

    built = {}
    for name, extra in variants.items():
        config = TransformerConfig(
            num_layers=layers,
            hidden_size=h,
            num_attention_heads=4,
            ffn_hidden_size=extra.pop("ffn_hidden_size", k * f),
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            normalization="RMSNorm",
            hidden_dropout=0.0,
            attention_dropout=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=1e-3 if "moe" in name else 0.0,
            **extra,
        )
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        gpt = GPTModel(config, spec, vocab, seq, position_embedding_type="rope")
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt
        )
        config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-4, clip_grad=1.0), [ddp])
        built[name] = (gpt, ddp, optimizer, [], [])

    fwd_bwd = get_forward_backward_func()
    for i in range(args.warmup + args.steps):
        for _, ddp, optimizer, walls, cpus in built.values():
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            wall, cpu = time.perf_counter(), time.process_time()
            fwd_bwd(
                forward_step_func=forward_step,
                data_iterator=iter([batch]),
                model=ddp,
                num_microbatches=1,
                seq_length=seq,
                micro_batch_size=mbs,
            )
            optimizer.step()
            if i >= args.warmup:
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
    results = {}
    for name, (gpt, _, _, walls, cpus) in built.items():
        total = sum(p.numel() for p in gpt.parameters())
        expert = sum(p.numel() for n, p in gpt.named_parameters() if ".experts." in n)
        median, cpu = statistics.median(walls), statistics.median(cpus)
        results[name] = {
            "step_ms": 1e3 * median,
            "cpu_ms": 1e3 * cpu,
            "tokens_per_s": mbs * seq / median,
            "params": total,
            "active_params": total - expert + expert * k // E,
        }
    for r in results.values():
        r["wall_vs_dense"] = r["step_ms"] / results["dense"]["step_ms"]
        r["cpu_vs_dense"] = r["cpu_ms"] / results["dense"]["cpu_ms"]
    return results


# ----------------------------------------------------------------------------- trainer


QWEN3_MOE_ARGS = [
    "--hidden-size", "2048", "--num-attention-heads", "32",
    "--num-query-groups", "4", "--kv-channels", "128",
    "--ffn-hidden-size", "6144", "--normalization", "RMSNorm", "--swiglu",
    "--position-embedding-type", "rope", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--vocab-size", "151936",
    "--num-experts", "128", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "768",
    "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
    "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3",
]  # fmt: skip


def trainer_benchmark(args) -> Dict[str, float]:
    """``pretrain`` of the Qwen3-30B-A3B-shaped MoE model on one GPU (see the docstring)."""
    from megatron.training.arguments import parse_args
    from megatron.training.training import pretrain

    steps = args.warmup + args.steps
    argv = QWEN3_MOE_ARGS + [
        "--num-layers", str(args.trainer_layers), "--seq-length", str(args.trainer_seq),
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(steps),
        "--lr", "1e-4", "--bf16",
    ] + list(args.trainer_args or [])  # fmt: skip
    config = parse_args(argv)
    torch.cuda.reset_peak_memory_stats()
    result = pretrain(config)
    times = [r["iteration_time_s"] for r in result.records[args.warmup :]]
    median = statistics.median(times)
    tokens = 4 * args.trainer_seq
    L, h, s, E, k = args.trainer_layers, 2048, args.trainer_seq, 128, 8
    expert = L * E * 3 * h * 768
    attention = L * (h * (32 * 128 + 2 * 4 * 128) + 32 * 128 * h + 2 * 128 + 2 * h + h * E)
    embeddings = 2 * 151936 * h + h
    active = attention + embeddings + expert * k // E
    flops = tokens / median * (6 * active + 6 * L * h * s)
    return {
        "argv": " ".join(argv),
        "step_s": median,
        "tokens_per_s": tokens / median,
        "model_tflops": flops / 1e12,
        "active_params": active,
        "total_params": attention + embeddings + expert,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loss_last": result.records[-1].get("loss"),
    }


# ----------------------------------------------------------------------------- main


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the one-GPU MoE layer benchmark")
    parser.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument(
        "--aux-loss-coeff",
        type=float,
        default=1e-3,
        help="the load-balancing loss of every layer variant and the bare loop (0: none)",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="bf16 (default with --gpu)")
    parser.add_argument("--mcore-path", default=None, help="a directory holding megatron-core")
    parser.add_argument("--mcore-timeout", type=int, default=240)
    parser.add_argument("--mcore-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cpu-hidden", type=int, default=128)
    parser.add_argument("--cpu-seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="CPU: torch threads")
    parser.add_argument("--trainer", action="store_true", help="the one-GPU trainer run")
    parser.add_argument("--trainer-layers", type=int, default=8)
    parser.add_argument("--trainer-seq", type=int, default=4096)
    parser.add_argument("--trainer-args", nargs=argparse.REMAINDER, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.mcore_worker:
        return mcore_worker(args)
    record: Dict[str, object] = {"torch": torch.__version__}
    if args.trainer:
        record["device"] = torch.cuda.get_device_name()
        record["trainer"] = trainer_benchmark(args)
        print(json.dumps(record["trainer"], indent=1))
    elif args.gpu:
        args.bf16 = True
        shapes = args.shapes or ["qwen3-30b-a3b", "olmoe"]
        device = torch.device("cuda")
        record["device"] = torch.cuda.get_device_name()
        init_single_process("nccl")
        names = ["ours-sequential", "ours-grouped", "ours-grouped-fp8", "bare-grouped-mm"]
        layers = {s: layer_variants(names, SHAPES[s], args, device) for s in shapes}
        for s, result in mcore_child(args, shapes).items():
            layers[s].update(result)
        record["layers"] = layers
        for s, result in layers.items():
            print(f"\n{s} ({SHAPES[s]}), {args.tokens} tokens, bf16, forward + backward")
            print(f"{'variant':<18} {'step ms':>9} {'tokens/s':>11} {'peak GiB':>9}")
            for name, r in result.items():
                if "error" in r:
                    print(f"{name:<18} skipped: {r['error']}")
                else:
                    print(
                        f"{name:<18} {r['step_ms']:9.2f} {r['tokens_per_s']:11.0f} "
                        f"{r['peak_gib']:9.2f}"
                    )
    else:
        torch.set_num_threads(args.threads or max(1, min(2, torch.get_num_threads())))
        shapes = args.shapes or []
        if shapes:  # the layer benchmark on the CPU (tiny shapes), fp32 unless --bf16
            init_single_process("gloo")
            record["layers"] = {
                s: layer_variants(
                    ["ours-sequential", "ours-grouped", "bare-grouped-mm"],
                    SHAPES[s],
                    args,
                    torch.device("cpu"),
                )
                for s in shapes
            }
            print(json.dumps(record["layers"], indent=1))
        else:
            record["threads"] = torch.get_num_threads()
            record["load_average"] = os.getloadavg()
            record["cpu_step"] = cpu_step_benchmark(args)
            record["load_average_after"] = os.getloadavg()
            print(
                f"{'variant':<16} {'wall ms':>9} {'x dense':>8} {'cpu ms':>9} {'x dense':>8} "
                f"{'tokens/s':>9} {'params':>9} {'active':>9}"
            )
            for name, r in record["cpu_step"].items():
                print(
                    f"{name:<16} {r['step_ms']:9.1f} {r['wall_vs_dense']:8.2f} "
                    f"{r['cpu_ms']:9.1f} {r['cpu_vs_dense']:8.2f} {r['tokens_per_s']:9.0f} "
                    f"{r['params']:9d} {r['active_params']:9d}"
                )
            print(
                f"threads {record['threads']}, load average before/after "
                f"{record['load_average']} / {record['load_average_after']}"
            )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()
