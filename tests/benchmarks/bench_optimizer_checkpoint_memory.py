"""Peak memory per rank while the distributed optimizer saves and loads a sharded checkpoint
(CPU, gloo; the data-parallel size is the world size, TP = CP = PP = 1):

    for n in 1 2 4; do for phase in save load; do
      torchrun --nproc-per-node $n tests/benchmarks/bench_optimizer_checkpoint_memory.py \
          $phase --dir /tmp/optim_ckpt_dp$n
    done; done

Two phases, each in fresh processes (so memory freed earlier cannot hide new allocations):

* save: each rank trains one step (so Adam has its state), then ``optimizer.sharded_state_dict``
  + ``dist_checkpointing.save`` of the optimizer;
* load: a fresh model and optimizer (as on resume), ``sharded_state_dict(is_loading=True)``
  (which creates the empty state) + ``dist_checkpointing.load`` + ``load_state_dict``.

Only the optimizer is saved and loaded (``--with-model`` adds the model, whose checkpoint at
TP = PP = 1 is the whole model on every rank whatever the DP size).

The peak of a phase is the growth of the process's resident set over its size when the phase
starts: freed heap memory is returned to the system (``malloc_trim``), Linux's high-water
mark (``VmHWM``) is reset to the current RSS (``/proc/self/clear_refs`` = 5) just before the
phase and read just after it, so the number is what the phase itself added at its worst
moment. Also printed: this rank's optimizer-state bytes (Adam's
moments plus fp32 main copies that are not the model's storage) and the whole model's (the
state a plain optimizer would hold). The expectation: the phase peaks scale like the state per
rank, i.e. ~1/DP of the whole state. JSON on rank 0's stdout and in ``--json``. (A
load's peak includes creating the state itself, ~the state per rank.)
"""

import argparse
import ctypes
import gc
import json
import os
import shutil
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, parallel_state
from tests.benchmarks import bench_memory

MIB = 2**20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> int:
    """Give freed heap memory back to the system (so a phase cannot reuse pages an earlier
    step freed without them counting), reset VmHWM to the current RSS; returns the RSS."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_bytes()


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def build(bf16: bool):
    ddp, optimizer, groups = bench_memory.build("dist", bf16, overlap=False)
    return ddp, optimizer, groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["save", "load"])
    parser.add_argument("--dir", required=True, help="checkpoint directory (save creates it)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--with-model", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel() if dist.is_initialized() else None
    rank = dist.get_rank() if dist.is_initialized() else 0
    dp = dist.get_world_size() if dist.is_initialized() else 1
    bench_memory.MODEL.update(
        hidden_size=args.hidden,
        num_attention_heads=8,
        num_layers=args.layers,
        vocab=args.vocab,
        seq=64,
    )
    ddp, optimizer, groups = bench_memory.build("dist", args.bf16, overlap=False)
    model_state = ddp.module.sharded_state_dict()
    if args.phase == "save":
        if rank == 0:
            shutil.rmtree(args.dir, ignore_errors=True)
            os.makedirs(args.dir)
        bench_memory.train_step(ddp, optimizer, groups)
        barrier()
        start = reset_peak()
        request = {"optimizer": optimizer.sharded_state_dict(model_state)}
        if args.with_model:
            request["model"] = model_state
        dist_checkpointing.save(request, args.dir)
        peak = peak_bytes() - start
    else:
        barrier()
        start = reset_peak()
        request = {"optimizer": optimizer.sharded_state_dict(model_state, is_loading=True)}
        if args.with_model:
            request["model"] = model_state
        loaded = dist_checkpointing.load(request, args.dir)
        if args.with_model:
            ddp.module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        del loaded, request
        peak = peak_bytes() - start
    barrier()
    state = bench_memory.state_bytes(ddp, optimizer)
    params = sum(p.numel() for p in ddp.module.parameters())
    whole_state = params * (12 if args.bf16 else 8)  # moments (+ fp32 mains) of every param
    mine = {"peak": peak, "state": state}
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dp
        dist.all_gather_object(everyone, mine)
    if rank == 0:
        result = {
            "phase": args.phase,
            "dp": dp,
            "bf16": args.bf16,
            "with_model": args.with_model,
            "params": params,
            "whole_state_MiB": round(whole_state / MIB, 1),
            "state_per_rank_MiB": [round(e["state"] / MIB, 1) for e in everyone],
            "peak_MiB": [round(e["peak"] / MIB, 1) for e in everyone],
        }
        text = json.dumps(result)
        print(text)
        if args.json:
            with open(args.json, "w") as handle:
                handle.write(text + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
