"""Where a MoE layer's forward + backward spends its GPU time (issue 30): our MoELayer
(GroupedMLP) and the bare ``torch._grouped_mm`` floor of ``bench_moe.py`` under
``torch.profiler``, at Qwen3-30B-A3B's shape, bf16, one process; prints the top operators
by CUDA time and the number of host syncs.

    python tests/benchmarks/profile_moe.py [--tokens 16384] [--rows 25]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.benchmarks.bench_moe import SHAPES, init_single_process, variant_step  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["ours-grouped", "bare-grouped-mm"],
        choices=["ours-grouped", "ours-sequential", "bare-grouped-mm"],
    )
    args = parser.parse_args()
    init_single_process("nccl")
    device = torch.device("cuda")
    shape = SHAPES[args.shape]
    x = torch.randn(args.tokens, 1, shape["hidden"], dtype=torch.bfloat16, device=device)
    grad = torch.randn_like(x)
    x.requires_grad_(True)
    for name in args.variants:
        step = variant_step(name, shape, device, True, 1e-3)
        for _ in range(3):
            step(x, grad)
        torch.cuda.synchronize()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(3):
                step(x, grad)
            torch.cuda.synchronize()
        print(f"==== {name} (3 steps)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
