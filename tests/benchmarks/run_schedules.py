"""Run ``bench_schedules.py`` for every layout with this repository and with megatron-core
0.16.1, alternating the two launch by launch, and print one summary table.

    python tests/benchmarks/run_schedules.py [--repeats 3] [--steps 20]

Layouts: no pipelining (1 rank), 1F1B with PP = 2 and 4, interleaved with PP = 2, V = 2.
Each launch alternates its variants step by step and reports medians (see
``bench_schedules.py``); this driver reports, per layout and framework, the median over the
repeated launches. The order of the two frameworks flips every repeat, so slow drifts of
the machine's load fall on both. megatron-core runs under ``--mcore-python``'s torchrun.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = [(1, None), (2, None), (4, None), (2, 2)]


def launch(python: str, pp: int, vpp, args, json_path: str, memory: bool) -> None:
    """One torchrun launch of bench_schedules.py; raises on failure."""
    command = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={pp}",
        os.path.join(HERE, "bench_schedules.py"),
        f"--steps={args.steps}",
        f"--microbatches={args.microbatches}",
        f"--json={json_path}",
    ]
    if vpp:
        command.append(f"--vpp={vpp}")
    if not memory:
        command.append("--no-memory")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # megatron comes from the interpreter's own packages
    before = _lines(json_path)
    for attempt in range(2):  # one retry: a rare abort at process teardown (see the docs)
        result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=HERE)
        if result.returncode == 0:
            break
        print(f"# launch failed (rc={result.returncode}), attempt {attempt + 1}", flush=True)
        with open(json_path, "w") as handle:  # drop what the failed launch wrote
            handle.writelines(before)
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-4000:])
        raise SystemExit(f"failed: {' '.join(command)}")
    print("\n".join(line for line in result.stdout.splitlines() if line.startswith("|")))


def _lines(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return handle.readlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--ours-python", default=sys.executable)
    parser.add_argument("--mcore-python", default="/opt/mcore/bin/python")
    parser.add_argument("--json", default=None, help="keep every launch's JSON lines here")
    parser.add_argument("--layouts", default=None, help="e.g. 4 or 2x2 (PP or PPxV; default all)")
    parser.add_argument("--summarize", default=None, help="only summarize this JSON-lines file")
    args = parser.parse_args()
    if args.summarize:
        with open(args.summarize) as handle:
            print(summarize([json.loads(line) for line in handle]))
        return

    json_path = os.path.abspath(args.json or tempfile.mktemp(suffix=".jsonl"))
    pythons = {"ours": args.ours_python, "megatron-core": args.mcore_python}
    for pp, vpp in LAYOUTS:
        if args.layouts and _key(pp, vpp) not in args.layouts.split(","):
            continue
        for repeat in range(args.repeats):
            order = list(pythons) if repeat % 2 == 0 else list(reversed(pythons))
            for name in order:
                print(f"# {name}: PP={pp} VPP={vpp} repeat {repeat + 1}", flush=True)
                launch(pythons[name], pp, vpp, args, json_path, memory=repeat == 0)

    with open(json_path) as handle:
        records = [json.loads(line) for line in handle]
    print(summarize(records))


def summarize(records) -> str:
    """Markdown tables: time per microbatch per stage, and memory per stage."""
    rows, memory_rows = [], []
    for pp, vpp in LAYOUTS:
        mine = [r for r in records if r["pp"] == pp and r["vpp"] == vpp]
        if not mine:
            continue
        cells = {}
        for fw in ("ours", "megatron-core"):
            runs = [r for r in mine if r["framework"] == fw]
            for variant in ("bare", "schedule", "schedule+ddp"):
                walls = [r["times"][variant]["wall_us"] for r in runs if variant in r["times"]]
                cpus = [r["times"][variant]["cpu_us"] for r in runs if variant in r["times"]]
                mains = [
                    r["times"][variant].get("main_us", float("nan"))
                    for r in runs
                    if variant in r["times"]
                ]
                if walls:
                    cells[fw, variant] = tuple(map(statistics.median, (walls, cpus, mains)))
                    calls = runs[0]["times"][variant]
                    if "py_calls" in calls:
                        text = f"{calls['py_calls']:.0f}+{calls['c_calls']:.0f}"
                        previous = cells.get(("calls", variant))
                        cells["calls", variant] = f"{previous} / {text}" if previous else text
                    # framework cost over the bare loop, launch by launch (same process)
                    if variant != "bare" and "bare" in runs[0]["times"]:
                        over = [
                            r["times"][variant]["cpu_us"] - r["times"]["bare"]["cpu_us"]
                            for r in runs
                        ]
                        cells[fw, variant, "over"] = statistics.median(over)
            for r in runs:
                if r["memory_mib"]:
                    for key, values in r["memory_mib"].items():
                        memory_rows.append(
                            [_layout(pp, vpp), fw, key] + [f"{v:.1f}" for v in values]
                        )
        schedule = mine[0]["schedule"].replace("forward_backward_", "")
        for variant in ("bare", "schedule", "schedule+ddp"):
            if ("ours", variant) not in cells:
                continue
            ours, mcore = cells["ours", variant], cells.get(("megatron-core", variant))
            row = [_layout(pp, vpp), schedule, variant] + [f"{v:.0f}" for v in ours]
            row += [f"{v:.0f}" for v in mcore] if mcore else ["-", "-", "-"]
            row.append(f"{ours[1] / mcore[1]:.2f}" if mcore else "-")
            row.append(f"{ours[2] / mcore[2]:.2f}" if mcore else "-")
            over_o = cells.get(("ours", variant, "over"))
            over_m = cells.get(("megatron-core", variant, "over"))
            row.append(f"{over_o:.0f} / {over_m:.0f}" if over_o is not None else "-")
            row.append(cells.get(("calls", variant), "-"))
            rows.append(row)
    from bench_common import table  # noqa: E402  (no torch.distributed needed here)

    text = table(
        [
            "layout",
            "schedule",
            "variant",
            "ours wall",
            "ours CPU",
            "ours main-thread CPU",
            "mcore wall",
            "mcore CPU",
            "mcore main-thread CPU",
            "CPU ours/mcore",
            "main-thread CPU ours/mcore",
            "CPU over bare (ours / mcore)",
            "Python+C calls/mb (ours / mcore)",
        ],
        rows,
        align="lll" + "r" * 10,
    )
    text += "\n\nus per microbatch per stage (medians over launches of per-launch medians)\n\n"
    width = max(len(r) for r in memory_rows) - 3 if memory_rows else 0
    text += table(
        ["layout", "framework", "deallocate_pipeline_outputs"]
        + [f"stage {i} MiB" for i in range(width)],
        [r + [""] * (width + 3 - len(r)) for r in memory_rows],
        align="lll" + "r" * width,
    )
    return text


def _key(pp: int, vpp) -> str:
    """The ``--layouts`` name of a layout: "4" or "2x2"."""
    return f"{pp}x{vpp}" if vpp else str(pp)


def _layout(pp: int, vpp) -> str:
    return f"PP={pp}" + (f" V={vpp}" if vpp else "")


if __name__ == "__main__":
    main()
