"""What a run leaves behind: ``metrics.jsonl`` (one JSON object per iteration) and
``loss.png`` (the loss curve, and the one-process curve when compared)."""

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
    written = [write_jsonl(out / METRICS_FILE, records)]
    curves = {label: records}
    if reference is not None:
        written.append(write_jsonl(out / SINGLE_PROCESS_METRICS_FILE, reference))
        curves[reference_label] = reference
    try:
        written.append(plot_loss_curves(out / LOSS_PLOT_FILE, curves))
    except ImportError as exc:
        warnings.warn(f"{LOSS_PLOT_FILE} not written: {exc} (pip install matplotlib)", stacklevel=2)
    return written


def write_jsonl(path: Path, records: List[dict]) -> Path:
    """One JSON object per line."""
    with open(path, "w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return path


def read_jsonl(path) -> List[dict]:
    """The records of a ``metrics.jsonl`` file."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def plot_loss_curves(path: Path, curves: Dict[str, List[dict]]) -> Path:
    """Loss against iteration, one line per curve (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(6, 4), dpi=100)
    styles = [dict(linestyle="-", marker="o"), dict(linestyle="--", marker="x")]
    for i, (label, records) in enumerate(curves.items()):
        iterations = [r["iteration"] for r in records]
        axes.plot(iterations, [r["loss"] for r in records], label=label, **styles[i % 2])
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("iteration")
    axes.set_ylabel("loss (masked token mean over the global batch)")
    axes.set_title("SFT loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
