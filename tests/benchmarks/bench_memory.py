"""Distributed optimizer (ZeRO-1) benchmark on CPU gloo: optimizer-state bytes per rank, and
the step time with ``overlap_param_gather`` against the plain optimizer.

Run under torchrun with the data-parallel size as the world size (TP = CP = PP = 1):

    torchrun --nproc-per-node 1 tests/benchmarks/bench_memory.py
    torchrun --nproc-per-node 2 tests/benchmarks/bench_memory.py --timing
    torchrun --nproc-per-node 4 tests/benchmarks/bench_memory.py

Bytes are counted from the tensors after one Adam step: every tensor in the torch optimizer's
state (``exp_avg``, ``exp_avg_sq``, ``step``) plus the fp32 main parameters that are not the
model's own storage (bf16 runs; with fp32 parameters the distributed optimizer's main shards
are views of the parameter buffer and count 0). Expected: the distributed optimizer's bytes
per rank are the plain optimizer's / DP (up to bucket padding).

``--timing`` (DP >= 2): median seconds per training step (forward, backward, reduction,
optimizer step, and the parameter all-gather) over ``--steps`` steps after a warm-up, for the
plain optimizer, the distributed optimizer without and with ``overlap_param_gather`` (both
with ``overlap_grad_reduce``); the ratio overlapped / plain. On gloo the reduce-scatter is an
all-reduce (``param_and_grad_buffer``), so the CPU ratio measures the extra all-gather and
the bookkeeping, not NCCL's traffic saving. JSON on rank 0's stdout and in ``--json``.
"""

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

MODEL = dict(hidden_size=256, num_attention_heads=8, num_layers=4, vocab=4096, seq=128)


def build(kind: str, bf16: bool, overlap: bool):
    """The GPT in DDP and its optimizer: ``kind`` "plain" or "dist"."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=MODEL["num_layers"],
        hidden_size=MODEL["hidden_size"],
        num_attention_heads=MODEL["num_attention_heads"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
    )
    groups = ProcessGroupCollection.use_mpu_process_groups()
    distributed = kind == "dist"
    gpt = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        MODEL["vocab"],
        MODEL["seq"],
        pg_collection=groups,
    ).to(dtype)
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            use_distributed_optimizer=distributed,
            overlap_param_gather=distributed and overlap,
            bucket_size=2_000_000,
        ),
        gpt,
        pg_collection=groups,
    )
    config.no_sync_func = ddp.no_sync
    config.grad_sync_func = ddp.start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            lr=1e-4,
            bf16=bf16,
            params_dtype=dtype,
            use_distributed_optimizer=distributed,
            overlap_param_gather=distributed and overlap,
        ),
        [ddp],
        pg_collection=groups,
    )
    return ddp, optimizer, groups


def train_step(ddp, optimizer, groups, microbatches: int = 2) -> None:
    gen = torch.Generator().manual_seed(1)
    data = [
        torch.randint(0, MODEL["vocab"], (2, MODEL["seq"]), generator=gen)
        for _ in range(microbatches)
    ]
    positions = torch.arange(MODEL["seq"]).expand(2, MODEL["seq"])

    def forward_step(iterator, model):
        tokens = next(iterator)
        out = model(tokens, positions, None, labels=tokens)

        def loss(o):
            return o.sum(), torch.tensor(o.numel()), {}

        return out, loss

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(data),
        model=ddp,
        num_microbatches=microbatches,
        seq_length=MODEL["seq"],
        micro_batch_size=2,
        pg_collection=groups,
    )
    optimizer.step()


def state_bytes(ddp, optimizer) -> int:
    """Bytes of optimizer state held by this rank (see the module docstring)."""
    model_storages = {p.untyped_storage().data_ptr() for p in ddp.module.parameters()}
    total = 0
    inner = optimizer.chained_optimizers[0]
    for state in inner.optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    for group in inner.optimizer.param_groups:
        for main in group["params"]:
            if main.untyped_storage().data_ptr() not in model_storages:
                total += main.numel() * main.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timing", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel() if dist.is_initialized() else None
    dp = dist.get_world_size() if dist.is_initialized() else 1
    result = {"dp": dp, "model": MODEL, "state_bytes_per_rank": {}}
    for bf16 in (False, True):
        for kind in ("plain", "dist"):
            ddp, optimizer, groups = build(kind, bf16, overlap=False)
            train_step(ddp, optimizer, groups)
            key = f"{kind}-{'bf16' if bf16 else 'fp32'}"
            result["state_bytes_per_rank"][key] = state_bytes(ddp, optimizer)
    if args.timing and dp >= 2:
        times = {}
        for name, kind, overlap in (
            ("plain", "plain", False),
            ("dist", "dist", False),
            ("dist-overlap-param-gather", "dist", True),
        ):
            ddp, optimizer, groups = build(kind, False, overlap)
            for _ in range(2):
                train_step(ddp, optimizer, groups)
            samples = []
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                train_step(ddp, optimizer, groups)
                ddp.finish_param_sync()
                samples.append(time.perf_counter() - start)
            times[name] = statistics.median(samples)
        result["step_seconds_median"] = times
        result["overlap_over_plain"] = times["dist-overlap-param-gather"] / times["plain"]
    if not dist.is_initialized() or dist.get_rank() == 0:
        text = json.dumps(result, indent=2)
        print(text)
        if args.json:
            with open(args.json, "w") as handle:
                handle.write(text + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
