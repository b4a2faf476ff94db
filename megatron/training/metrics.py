"""What a run leaves behind: ``metrics.jsonl`` (one JSON object per iteration) and
``loss.png`` (the loss and the validation loss, the gradient norm and the learning rate
against iteration; the one-process run's too when compared). A resumed run continues both
(``continued_history``). ``metrics.jsonl`` is written as the run goes
(``loggers.JsonlSink``); ``save_metrics`` rewrites it at the end (the last rank's timings)
beside the picture."""

import json
import warnings
from pathlib import Path
from typing import Dict, List, Optional

METRICS_FILE = "metrics.jsonl"
SINGLE_PROCESS_METRICS_FILE = "metrics_single_process.jsonl"
LOSS_PLOT_FILE = "loss.png"


def save_metrics(
    directory: str,
    records: List[dict],
    label: str,
    reference: Optional[List[dict]] = None,
    reference_label: str = "1 process",
) -> List[Path]:
    """Write ``metrics.jsonl``, the reference's ``metrics_single_process.jsonl`` (if any)
    and ``loss.png`` under ``directory`` (created); returns the paths written.

    Without matplotlib (the ``plot`` extra) the picture is skipped with a warning.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if (out / METRICS_FILE).exists():
        records = continued_history(read_jsonl(out / METRICS_FILE), records)
    written = [write_jsonl(out / METRICS_FILE, records)]
    curves = {label: records}
    if reference is not None:
        written.append(write_jsonl(out / SINGLE_PROCESS_METRICS_FILE, reference))
        curves[reference_label] = reference
    try:
        written.append(plot_loss_curves(out / LOSS_PLOT_FILE, curves))
    except ImportError as exc:
        warnings.warn(
            f"{LOSS_PLOT_FILE} not written: matplotlib is not installed ({exc}); "
            "pip install -e '.[plot]' (or pip install matplotlib)",
            stacklevel=2,
        )
    return written


def continued_history(earlier: List[dict], records: List[dict]) -> List[dict]:
    """The records of a run continued from ``earlier`` (an existing ``metrics.jsonl``): the
    earlier records before this run's first iteration, then this run's (a resumed run
    continues its history; a run from iteration 1 replaces it). Records of an
    evaluation-only run (``--skip-train``: no ``loss``) are merged into the earlier record
    of their iteration, or added after the history."""
    if not records:
        return earlier
    if all("loss" not in r for r in records):
        merged = [dict(r) for r in earlier]
        by_iteration = {r["iteration"]: r for r in merged}
        for record in records:
            if record["iteration"] in by_iteration:
                by_iteration[record["iteration"]].update(record)
            else:
                merged.append(record)
        return merged
    first = records[0]["iteration"]
    return [r for r in earlier if r["iteration"] < first] + list(records)


def write_jsonl(path: Path, records: List[dict]) -> Path:
    """One JSON object per line."""
    with open(path, "w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return path


def read_jsonl(path) -> List[dict]:
    """The records of a ``metrics.jsonl`` file; an unfinished last line (a run killed while
    writing it) is left out."""
    with open(path) as handle:
        lines = [line for line in handle if line.strip()]
    records = [json.loads(line) for line in lines[:-1]]
    try:
        return records + [json.loads(line) for line in lines[-1:]]
    except json.JSONDecodeError:
        return records


def plot_loss_curves(path: Path, curves: Dict[str, List[dict]]) -> Path:
    """Write ``loss_figure(curves)`` to ``path`` (PNG)."""
    from matplotlib import pyplot as plt

    figure = loss_figure(curves)
    figure.savefig(path)
    plt.close(figure)
    return path


# (record key, y label, log scale) of each panel of the picture, top to bottom.
PANELS = (
    ("loss", "loss (masked token mean\nover the global batch)", False),
    ("grad_norm", "gradient norm\n(before clipping)", True),
    ("lr", "learning rate", False),
)


def loss_figure(curves: Dict[str, List[dict]]):
    """A matplotlib figure (Agg backend) with one panel per ``PANELS`` entry: the loss, the
    gradient norm and the learning rate against iteration, one line per curve (a missing or
    None value is left out of its line)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, panels = plt.subplots(len(PANELS), 1, figsize=(6, 8), dpi=100, sharex=True)
    styles = [dict(linestyle="-", marker="o"), dict(linestyle="--", marker="x")]
    for axes, (key, label, log_scale) in zip(panels, PANELS):
        for i, (name, records) in enumerate(curves.items()):
            points = [(r["iteration"], r[key]) for r in records if r.get(key) is not None]
            axes.plot([x for x, _ in points], [y for _, y in points], label=name, **styles[i % 2])
            if key == "loss":  # the validation loss beside the training loss
                valid = [(r["iteration"], r["valid_loss"]) for r in records if "valid_loss" in r]
                if valid:
                    axes.plot(
                        [x for x, _ in valid],
                        [y for _, y in valid],
                        label=f"{name} validation",
                        linestyle=":",
                        marker="s",
                    )
        if log_scale and all(y > 0 for line in axes.get_lines() for y in line.get_ydata()):
            axes.set_yscale("log")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
    panels[0].set_title("SFT loss, gradient norm and learning rate")
    panels[0].legend()
    panels[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    panels[-1].set_xlabel("iteration")
    figure.tight_layout()
    return figure
