"""Tensor-parallel training-step benchmark: a bf16 ~1.1B-parameter Llama-style GPT at TP = 2,
written only against megatron-core's public API, so the SAME script measures this
repository and megatron-core 0.16.1.

Model (TinyLlama-1.1B shape): 22 layers, hidden 2048, 32 heads, 4 query groups (GQA), SwiGLU
FFN 5632, RMSNorm, RoPE, no linear biases, untied embeddings, vocabulary 32000; sequence
2048, micro-batch 1, 4 microbatches per step. Step = ``zero_grad_buffer`` ->
``get_forward_backward_func()`` (no pipelining) -> ``finalize_model_grads`` -> an SGD update
of the bf16 weights from the fp32 ``main_grad`` (the same few lines for both
implementations). Built from ``parallel_state.initialize_model_parallel``, ``GPTModel`` +
``get_gpt_layer_local_spec`` (no Transformer Engine), ``DistributedDataParallel``
(``grad_reduce_in_fp32=True``), ``model_parallel_cuda_manual_seed``.

Reported (rank 0, one JSON line on stdout, also appended to ``--json``): median step time
over the timed steps (each bracketed by a device synchronize), tokens/s (tokens per step /
median), peak memory per GPU (``torch.cuda.max_memory_allocated``, GiB, every rank), the
parameter count, the last loss, and ``--impl-label``.

Commands (2 GPUs; run from the repository root; ``megatron`` is found through PYTHONPATH
only, because running the script by path puts ``tests/benchmarks`` first on ``sys.path``):

    # ours
    PYTHONPATH=$PWD torchrun --standalone --nproc-per-node 2 tests/benchmarks/bench_tp.py \\
        --impl-label ours --json tp_bench.jsonl
    # megatron-core 0.16.1 (the directory holding its installed ``megatron`` package)
    PYTHONPATH=/path/to/site-packages-with-megatron-core torchrun --standalone \\
        --nproc-per-node 2 tests/benchmarks/bench_tp.py --impl-label megatron-core \\
        --json tp_bench.jsonl
    # both, alternating, 3 rounds, with a summary (see run_bench_tp.py for the variables)
    MCORE_PYTHONPATH=/path/to/site-packages-with-megatron-core \\
        python tests/benchmarks/run_bench_tp.py --rounds 3 --json tp_bench.jsonl

    # add --sequence-parallel to either for TP + SP

CPU check (gloo, tiny sizes, fp32 math on bf16 weights as on the GPU; correctness of the
script only, the timing means nothing):

    cd /tmp && env -u PYTHONPATH /opt/mcore/bin/python -m torch.distributed.run \\
        --nproc-per-node 2 /work/main/tests/benchmarks/bench_tp.py --tiny --impl-label mcore-cpu
    PYTHONPATH=$PWD python -m torch.distributed.run --nproc-per-node 2 \\
        tests/benchmarks/bench_tp.py --tiny --impl-label ours-cpu

megatron-core on CPU needs the documented shims of ``bench_common.install_mcore_cpu_shim``
plus one here: its RNG tracker reads CUDA generator states, so in ``--tiny`` mode its
``fork()`` is replaced by a no-op context (dropout is 0: no random numbers are drawn) and
its parameters are built with ``use_cpu_initialization=True``; its default causal mask is
made on "cuda", so ``--tiny`` passes an explicit causal ``attention_mask`` (True = masked)
to both implementations. On GPUs the mask is ``None`` (each implementation's causal path).
"""

import argparse
import contextlib
import json
import os
import resource
import statistics
import time
from typing import Dict, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_common import append_json, framework, init_distributed, install_mcore_cpu_shim, say

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

FULL = dict(
    num_layers=22,
    hidden_size=2048,
    num_attention_heads=32,
    num_query_groups=4,
    ffn_hidden_size=5632,
    vocab_size=32000,
    seq_length=2048,
    micro_batch_size=1,
    num_microbatches=4,
)
TINY = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=256,
    seq_length=32,
    micro_batch_size=2,
    num_microbatches=2,
)


def main() -> None:
    args = _parse()
    sizes = dict(TINY if args.tiny else FULL)
    for key in ("num_layers", "seq_length", "micro_batch_size", "num_microbatches"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    on_gpu = not args.tiny
    if on_gpu:  # before the process group, so nccl binds this rank's GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_distributed("nccl" if on_gpu else "gloo")
    fw = framework()
    if not on_gpu and fw["name"] == "megatron-core":
        install_mcore_cpu_shim()
        _install_mcore_cpu_rng_shim()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    if on_gpu or fw["name"] != "megatron-core":
        model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)

    config = TransformerConfig(
        num_layers=sizes["num_layers"],
        hidden_size=sizes["hidden_size"],
        num_attention_heads=sizes["num_attention_heads"],
        num_query_groups=sizes["num_query_groups"],
        ffn_hidden_size=sizes["ffn_hidden_size"],
        tensor_model_parallel_size=args.tp,
        sequence_parallel=args.sequence_parallel,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        use_cpu_initialization=not on_gpu,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=sizes["vocab_size"],
        max_sequence_length=sizes["seq_length"],
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    if on_gpu:
        model = model.cuda()
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        model,
    )
    local_params = sum(p.numel() for p in model.parameters())
    params = _total_params(model, local_params)

    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    data = _batches(sizes, device, causal_mask=not on_gpu)
    forward_backward = get_forward_backward_func()
    times, losses = [], []
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        _synchronize(on_gpu)
        start = time.perf_counter()
        ddp.zero_grad_buffer()
        reported = forward_backward(
            forward_step_func=_forward_step,
            data_iterator=data,
            model=[ddp],
            num_microbatches=sizes["num_microbatches"],
            seq_length=sizes["seq_length"],
            micro_batch_size=sizes["micro_batch_size"],
            forward_only=False,
        )
        finalize_model_grads([ddp])
        with torch.no_grad():
            for param in model.parameters():
                param.add_(param.main_grad.to(param.dtype), alpha=-args.lr)
        _synchronize(on_gpu)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        if reported:
            losses.append(sum(float(r["lm loss"][0]) / float(r["lm loss"][1]) for r in reported))

    tokens_per_step = (
        sizes["seq_length"]
        * sizes["micro_batch_size"]
        * sizes["num_microbatches"]
        * parallel_state.get_data_parallel_world_size()
    )
    median = statistics.median(times)
    peak = _peak_memory_gib(on_gpu)
    record = {
        "impl": args.impl_label,
        "framework": fw["name"],
        "framework_version": fw["version"],
        "device": torch.cuda.get_device_name() if on_gpu else "cpu (gloo)",
        "world_size": dist.get_world_size(),
        "tp": args.tp,
        "sequence_parallel": args.sequence_parallel,
        "params": params,
        "sizes": sizes,
        "steps_timed": len(times),
        "median_step_s": round(median, 6),
        "step_times_s": [round(t, 6) for t in times],
        "tokens_per_s": round(tokens_per_step / median, 1),
        "peak_memory_gib_per_gpu" if on_gpu else "peak_rss_gib_per_rank": peak,
        "last_loss": losses[-1] / sizes["num_microbatches"] if losses else None,
    }
    say(json.dumps(record))
    append_json(args.json, record)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl-label", required=True, help="name of this run in the output")
    parser.add_argument("--tiny", action="store_true", help="CPU/gloo, tiny sizes")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--seq-length", type=int, default=None)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--num-microbatches", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--json", default=None, help="append the JSON line to this file")
    return parser.parse_args()


def _batches(sizes: Dict[str, int], device: torch.device, causal_mask: bool) -> Iterator[dict]:
    """Endless seeded microbatches (the same on every TP rank): random tokens, next-token
    labels, every token counted."""
    gen = torch.Generator().manual_seed(0)
    b, s, v = sizes["micro_batch_size"], sizes["seq_length"], sizes["vocab_size"]
    positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    mask = None
    if causal_mask:
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)
        mask = mask.view(1, 1, s, s)
    while True:
        tokens = torch.randint(0, v, (b, s + 1), generator=gen).to(device)
        yield {
            "tokens": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "positions": positions,
            "attention_mask": mask,
            "loss_mask": torch.ones(b, s, device=device),
        }


def _forward_step(data_iterator, model):
    """megatron's callback: per-token losses, then (loss sum, token count, reported)."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["positions"], batch["attention_mask"], labels=batch["labels"]
    )

    def loss_func(output_tensor):
        mask = batch["loss_mask"]
        loss_sum = (output_tensor.float() * mask).sum()
        num_tokens = mask.sum().to(torch.int)
        # clones: megatron-core divides loss_sum in place, which would alter an alias
        reported = {"lm loss": [loss_sum.detach().clone(), num_tokens.clone()]}
        return loss_sum, num_tokens, reported

    return output, loss_func


def _total_params(model: torch.nn.Module, local: int) -> int:
    """Parameters of the whole model: TP-split ones summed over the TP group, replicated
    ones once."""
    split = sum(p.numel() for p in model.parameters() if getattr(p, "tensor_model_parallel", False))
    counts = torch.tensor([split, local - split], dtype=torch.float64)
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        counts = counts.cuda()
    dist.all_reduce(counts[:1], group=parallel_state.get_tensor_model_parallel_group())
    return int(counts[0].item() + counts[1].item())


def _synchronize(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.synchronize()


def _peak_memory_gib(on_gpu: bool):
    """Peak memory of every rank (GiB): CUDA allocator peak on GPUs, max RSS on CPU."""
    if on_gpu:
        value = torch.cuda.max_memory_allocated() / 2**30
    else:
        value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, round(value, 3))
    return values


def _install_mcore_cpu_rng_shim() -> None:
    """megatron-core's tracker reads CUDA RNG states in ``fork()``; with dropout 0 nothing is
    drawn, so on CPU its fork is a no-op context."""
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


if __name__ == "__main__":
    main()
