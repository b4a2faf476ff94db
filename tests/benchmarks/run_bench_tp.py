"""Run bench_tp.py for this repository and for megatron-core 0.16.1 alternately (ours,
megatron-core, ours, ...), each launch ``torchrun --standalone --nproc-per-node 2``, then
print the per-implementation medians and the ratio ours / megatron-core.

    MCORE_PYTHONPATH=/path/to/site-packages-with-megatron-core \\
        python tests/benchmarks/run_bench_tp.py --rounds 3 --json tp_bench.jsonl [-- extra
        bench_tp.py arguments, e.g. --steps 20]

Environment (defaults in brackets): ``OURS_PYTHON`` / ``MCORE_PYTHON`` [this interpreter]:
the Python running each implementation; ``OURS_PYTHONPATH`` [the repository root];
``MCORE_PYTHONPATH`` [/opt/mcore/lib/python3.11/site-packages]: the directory holding
megatron-core's ``megatron`` package. ``--tiny`` runs the CPU check (gloo) instead.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", default="tp_bench.jsonl")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="-- then bench_tp.py arguments")
    args = parser.parse_args()
    extra = [a for a in args.extra if a != "--"] + (["--tiny"] if args.tiny else [])
    impls = {
        "ours": (
            os.environ.get("OURS_PYTHON", sys.executable),
            os.environ.get("OURS_PYTHONPATH", str(REPO)),
        ),
        "megatron-core": (
            os.environ.get("MCORE_PYTHON", sys.executable),
            os.environ.get("MCORE_PYTHONPATH", "/opt/mcore/lib/python3.11/site-packages"),
        ),
    }
    results = {name: [] for name in impls}
    for round_index in range(args.rounds):
        for name, (python, pythonpath) in impls.items():
            env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")
            command = [
                python,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(args.nproc),
                str(HERE / "bench_tp.py"),
                "--impl-label",
                name,
                "--json",
                str(Path(args.json).resolve()),
                *extra,
            ]
            print(f"round {round_index + 1}/{args.rounds}: {name}", flush=True)
            # run outside the repository so that only PYTHONPATH decides which megatron loads
            out = subprocess.run(command, env=env, cwd="/tmp", capture_output=True, text=True)
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode != 0 or not lines:
                print(out.stdout[-3000:], out.stderr[-3000:], sep="\n", file=sys.stderr)
                raise SystemExit(f"{name} failed (exit {out.returncode})")
            record = json.loads(lines[-1])
            results[name].append(record)
            print(
                f"  median step {record['median_step_s']:.4f} s, {record['tokens_per_s']:.0f} "
                "tokens/s",
                flush=True,
            )
    summary = {}
    for name, records in results.items():
        medians = [r["median_step_s"] for r in records]
        summary[name] = {
            "median_step_s": statistics.median(medians),
            "per_round_median_step_s": medians,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
            "peak_memory": records[-1].get(
                "peak_memory_gib_per_gpu", records[-1].get("peak_rss_gib_per_rank")
            ),
            "last_loss": records[-1]["last_loss"],
        }
    ratio = summary["ours"]["median_step_s"] / summary["megatron-core"]["median_step_s"]
    summary["step_time_ratio_ours_over_mcore"] = round(ratio, 4)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
