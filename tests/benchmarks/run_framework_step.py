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
    return finish(start(python, ours, args, json_path), json_path)


def start(python: str, ours: bool, args, json_path: str) -> subprocess.Popen:
    """Start one 4-rank launch."""
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
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE
    )


def finish(process: subprocess.Popen, json_path: str) -> dict:
    """Wait for a launch; print its table rows and return its JSON record."""
    stdout, stderr = process.communicate()
    if process.returncode != 0:
        sys.stderr.write(stdout[-4000:] + stderr[-4000:])
        raise SystemExit(f"failed: {' '.join(process.args)}")
    print("\n".join(line for line in stdout.splitlines() if line.startswith("|")), flush=True)
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
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="run the two launches of a repeat at the same time (8 ranks): on a machine "
        "shared with other jobs both then see the same background load",
    )
    parser.add_argument("--json", default=None, help="write all records here")
    args = parser.parse_args()
    print(f"# load average at start: {os.getloadavg()}", flush=True)
    print("| framework | model | wall ms | wall IQR | process CPU ms | main-thread CPU ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: |", flush=True)
    records = []
    models = args.models.split(",")
    ratios = {f"{m}_{k}": [] for m in models for k in ("wall", "cpu", "main")}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = [True, False] if repeat % 2 == 0 else [False, True]
            paths = {o: os.path.join(tmp, f"run_{o}.json") for o in order}
            pythons = {True: args.python, False: args.mcore_python}
            pair = {}
            if args.concurrent:
                started = {o: start(pythons[o], o, args, paths[o]) for o in order}
                pair = {o: finish(started[o], paths[o]) for o in order}
            else:
                pair = {o: launch(pythons[o], o, args, paths[o]) for o in order}
            records.extend(pair[o] for o in order)
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
