"""Run ``bench_framework_step.py`` with this repository and with megatron-core 0.16.1,
alternating launch by launch (A B A B ...), and print the ratios ours / megatron-core.

    python tests/benchmarks/run_framework_step.py --repeats 3 [--steps 20] \\
        [--mcore-python /work/mcore-venv/bin/python]

Each repeat is one launch of each (the order flips every repeat, so a slow drift of the
machine's load falls on both); each launch alternates the framework and compute models
step by step and reports medians of the slowest rank. The ratio of a repeat compares the two
launches of that repeat; the last lines give every repeat's ratios and the median over
repeats (target: framework <= 1.0, aim 0.9; compute <= 1.0).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def launch(python: str, ours: bool, args, json_path: str) -> dict:
    """One 4-rank launch; returns its JSON record."""
    command = args.prefix.split() + [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        os.path.join(HERE, "bench_framework_step.py"),
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--json={json_path}",
        f"--models={args.models}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    if ours:  # this working tree's megatron, not whatever the interpreter has installed
        env["PYTHONPATH"] = args.ours_path
    elif args.mcore_path:  # a directory holding megatron-core's ``megatron`` package
        env["PYTHONPATH"] = args.mcore_path
    if os.path.exists(json_path):
        os.remove(json_path)
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=HERE)
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-4000:])
        raise SystemExit(f"failed: {' '.join(command)}")
    print("\n".join(line for line in result.stdout.splitlines() if line.startswith("|")))
    with open(json_path) as handle:
        return json.loads(handle.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--models", default="framework,compute")
    parser.add_argument("--python", default=sys.executable, help="interpreter for ours")
    parser.add_argument("--mcore-python", default="/work/mcore-venv/bin/python")
    parser.add_argument(
        "--mcore-path", default=None, help="PYTHONPATH for megatron-core (else its venv's own)"
    )
    parser.add_argument("--ours-path", default=ROOT, help="PYTHONPATH for ours")
    parser.add_argument("--prefix", default="", help="command prefix, e.g. 'taskset -c 0,1'")
    parser.add_argument("--json", default=None, help="write all records here")
    args = parser.parse_args()
    print(f"# load average at start: {os.getloadavg()}", flush=True)
    print("| framework | model | wall ms | wall IQR | process CPU ms | main-thread CPU ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: |", flush=True)
    records = []
    models = args.models.split(",")
    ratios = {f"{m}_{k}": [] for m in models for k in ("wall", "cpu", "main")}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.json")
        for repeat in range(args.repeats):
            order = [True, False] if repeat % 2 == 0 else [False, True]
            pair = {}
            for ours in order:
                python = args.python if ours else args.mcore_python
                pair[ours] = launch(python, ours, args, path)
                records.append(pair[ours])
            for key in ratios:
                model, kind = key.split("_")
                ours_ms, mcore_ms = (pair[o]["times"][model][f"{kind}_ms"] for o in (True, False))
                ratios[key].append(ours_ms / mcore_ms)
    print(f"# load average at end: {os.getloadavg()}")
    for model, values in ratios.items():
        listed = ", ".join(f"{v:.3f}" for v in values)
        print(f"RESULT {model}_ratio={statistics.median(values):.3f} (repeats: {listed})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"records": records, "ratios": ratios}, handle)


if __name__ == "__main__":
    main()
