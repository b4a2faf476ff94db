"""The metric sinks: where each iteration's record goes, as it happens.

A record is one dict per iteration (``training.train``: loss, lr, grad_norm, timings, the
router metrics, validation results). Every sink takes each record once, when the iteration
ends (``log``), and is closed on every exit path (``close``), so a killed run leaves what it
had logged. The sinks, each registered once in ``SINKS`` (the shape of
``megatron/core/transformer/cp_attention/registry.py``):

- ``metrics.jsonl`` (``--save-metrics DIR``, rank 0): every record, appended and flushed as
  it happens (``JsonlSink``; ``metrics.save_metrics`` rewrites it at the end with the last
  rank's timings, beside ``loss.png``);
- ``console`` (``--no-progress``, rank 0): megatron's line every ``--log-interval``;
- ``tensorboard`` (``--tensorboard-dir``) and ``wandb`` (``--wandb-project``), on the last
  rank (megatron's writer: it holds the last pipeline stage): megatron's scalar names
  (``scalars_of``), the training values every ``--tensorboard-log-interval`` (megatron's
  flag, default 1), validation results always.

To add a sink: a ``MetricSink`` subclass with a ``create(config, ranks)`` that returns it
(or None when its flag is off or this rank does not write), and one entry in ``SINKS``.
TensorBoard and W&B are imported only when asked for; a missing package is a one-line
error naming the extra to install (``check_logging_packages``, run with the flag checks,
before any worker starts).
"""

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from megatron.core.config_rules import DPO_METRIC_KEYS
from megatron.training.errors import UsageError

# --dpo's metrics.jsonl keys (megatron.core.preference.METRIC_KEYS): TRL's names, whose
# scalar names have TRL's slash (rewards/chosen)
DPO_METRICS = DPO_METRIC_KEYS
# metrics.jsonl key -> megatron's scalar name
SCALAR_NAMES = {
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "num_zeros_in_grad": "num-zeros",
    "loss_scale": "loss-scale",
    "iteration_time_s": "iteration-time",
    "tokens_per_s": "tokens-per-second",
    "mem_allocated_bytes": "mem-allocated-bytes",
    "mem_max_allocated_bytes": "mem-max-allocated-bytes",
    "mem_reserved_bytes": "mem-reserved-bytes",
    **{name: name.replace("_", "/", 1) for name in DPO_METRICS},  # --dpo: TRL's names
    # the router losses under megatron's track_moe_metrics names
    "moe_load_balancing_loss": "load_balancing_loss",
    "moe_seq_load_balancing_loss": "seq_load_balancing_loss",
    "moe_z_loss": "z_loss",
}
VALIDATION_SCALAR_NAMES = {
    "valid_loss": "lm loss validation",
    "valid_ppl": "lm loss validation ppl",
    **{f"valid_{name}": f"{name.replace('_', '/', 1)} validation" for name in DPO_METRICS},
}
# moe_tokens_per_expert[l][e] -> this scalar (an extra of this core; megatron has none)
TOKENS_PER_EXPERT_NAME = "moe/tokens_per_expert/layer_{layer}_expert_{expert}"
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}
# metrics.jsonl keys of the multi-token prediction losses (scalar name "mtp_<k> loss")
MTP_LOSS_KEY = re.compile(r"mtp_\d+_loss")


@dataclass(frozen=True)
class Ranks:
    """Which writer this process is: rank 0 (metrics.jsonl, console) and / or the last
    rank (TensorBoard, W&B)."""

    first: bool
    last: bool


class MetricSink:
    """One destination of the run's records."""

    name = ""

    @classmethod
    def create(cls, config: Any, ranks: Ranks) -> Optional["MetricSink"]:
        """This sink for ``config`` on this process, or None (not asked for, not its rank)."""
        raise NotImplementedError

    def log(self, record: Dict[str, Any]) -> None:
        """Take one iteration's record (called once per record, in order)."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release (called on every exit path)."""


class ConsoleSink(MetricSink):
    """megatron's console line every ``--log-interval`` iterations (with ``--no-progress``;
    the progress bar shows the loss otherwise)."""

    name = "console"

    def __init__(self, log_interval: int, train_iters: int) -> None:
        self.log_interval, self.train_iters = log_interval, train_iters

    @classmethod
    def create(cls, config: Any, ranks: Ranks) -> Optional["ConsoleSink"]:
        if config.progress or not ranks.first:
            return None
        return cls(config.log_interval, config.train_iters)

    def log(self, record: Dict[str, Any]) -> None:
        if "loss" in record and record["iteration"] % self.log_interval == 0:
            print(log_line(record, self.train_iters), flush=True)


class ScalarSink(MetricSink):
    """The scalars of each record (``scalars_of``): the training values every
    ``--tensorboard-log-interval`` iterations, the validation values always."""

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def log(self, record: Dict[str, Any]) -> None:
        iteration = record["iteration"]
        scalars = scalars_of(record, training=iteration % self.interval == 0)
        if scalars:
            self.write(scalars, iteration)

    def write(self, scalars: Dict[str, float], iteration: int) -> None:
        """Write ``{name: value}`` at step ``iteration``."""
        raise NotImplementedError


class TensorBoardSink(ScalarSink):
    """``--tensorboard-dir``: event files (``torch.utils.tensorboard``)."""

    name = "tensorboard"

    def __init__(self, config: Any) -> None:
        super().__init__(config.tensorboard_log_interval)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=config.tensorboard_dir, max_queue=1000)

    @classmethod
    def create(cls, config: Any, ranks: Ranks) -> Optional["TensorBoardSink"]:
        return cls(config) if config.tensorboard_dir and ranks.last else None

    def write(self, scalars: Dict[str, float], iteration: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, iteration)

    def close(self) -> None:
        self.writer.close()


class WandbSink(ScalarSink):
    """``--wandb-project``: a W&B run (its files under ``--wandb-save-dir``, else
    ``--save``/wandb)."""

    name = "wandb"

    def __init__(self, config: Any) -> None:
        super().__init__(config.tensorboard_log_interval)
        import wandb

        directory = config.wandb_save_dir or (
            os.path.join(config.save, "wandb") if config.save else None
        )
        if directory:
            os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(
            project=config.wandb_project,
            name=config.wandb_exp_name,
            dir=directory,
            config={k: v for k, v in vars(config).items() if _plain(v)},
        )

    @classmethod
    def create(cls, config: Any, ranks: Ranks) -> Optional["WandbSink"]:
        return cls(config) if config.wandb_project and ranks.last else None

    def write(self, scalars: Dict[str, float], iteration: int) -> None:
        self.run.log(scalars, step=iteration)

    def close(self) -> None:
        self.run.finish()


class JsonlSink(MetricSink):
    """``--save-metrics DIR``: ``DIR/metrics.jsonl``, one JSON line per record, appended and
    flushed as it happens (``tail -f`` follows the run; a killed run leaves every finished
    iteration). An existing file is continued (``metrics.continued_history``): a resumed
    run keeps the earlier records before its first iteration, a run from iteration 1
    replaces them, an evaluation-only record is merged into its iteration's."""

    name = "metrics.jsonl"

    def __init__(self, directory: str) -> None:
        from megatron.training.metrics import METRICS_FILE, read_jsonl

        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, METRICS_FILE)
        self.earlier = read_jsonl(self.path) if os.path.exists(self.path) else []
        self.records: List[Dict[str, Any]] = []
        self.handle = None

    @classmethod
    def create(cls, config: Any, ranks: Ranks) -> Optional["JsonlSink"]:
        return cls(config.save_metrics) if config.save_metrics and ranks.first else None

    def log(self, record: Dict[str, Any]) -> None:
        from megatron.training.metrics import continued_history

        self.records.append(record)
        if self.handle is None or "loss" not in record:  # (re)write the history before it
            self.close()
            history = continued_history(self.earlier, self.records)
            with open(self.path, "w") as handle:
                handle.writelines(json.dumps(r) + "\n" for r in history)
            self.handle = open(self.path, "a", buffering=1)  # line-buffered
            return
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


# name -> create(config, ranks): the sinks of a run, in the order they take each record.
SINKS: Dict[str, Callable[[Any, Ranks], Optional[MetricSink]]] = {
    JsonlSink.name: JsonlSink.create,
    ConsoleSink.name: ConsoleSink.create,
    TensorBoardSink.name: TensorBoardSink.create,
    WandbSink.name: WandbSink.create,
}


class MetricSinks:
    """The sinks of this process for ``config`` (``SINKS``); ``log`` hands each record to
    every one, ``close`` closes them all (each once, even if one fails)."""

    def __init__(self, config: Any, ranks: Ranks) -> None:
        self.sinks: List[MetricSink] = []
        try:
            for create in SINKS.values():
                sink = create(config, ranks)
                if sink is not None:
                    self.sinks.append(sink)
        except BaseException:
            self.close()
            raise

    def log(self, record: Dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        errors = []
        for sink in sinks:
            try:
                sink.close()
            except Exception as exc:  # the others still close; the first error is raised
                errors.append(exc)
        if errors:
            raise errors[0]


def check_logging_packages(config: Any) -> None:
    """``--tensorboard-dir`` needs the ``tensorboard`` package, ``--wandb-project`` the
    ``wandb`` package: a UsageError naming the flag and the extra when one is missing."""
    for flag, value, package in (
        ("--tensorboard-dir", config.tensorboard_dir, "tensorboard"),
        ("--wandb-project", config.wandb_project, "wandb"),
    ):
        if value and importlib.util.find_spec(package) is None:
            raise UsageError(
                f"{flag} {value} needs the '{package}' package, which is not installed: "
                f"pip install -e '.[{EXTRAS[package]}]' (or pip install {package})"
            )


def scalars_of(record: Dict[str, Any], training: bool = True) -> Dict[str, float]:
    """``{megatron scalar name: value}`` of a record (None values left out); ``training``:
    with the training values (and the per-expert token counts), else validation only."""
    names: List[Dict[str, str]] = [VALIDATION_SCALAR_NAMES]
    if training:
        names.insert(0, SCALAR_NAMES)
    scalars = {
        name: float(record[key])
        for table in names
        for key, name in table.items()
        if record.get(key) is not None
    }
    if training:
        scalars.update({mtp_scalar_name(k): float(v) for k, v in mtp_losses(record).items()})
        for layer, counts in enumerate(record.get("moe_tokens_per_expert") or []):
            for expert, count in enumerate(counts):
                scalars[TOKENS_PER_EXPERT_NAME.format(layer=layer, expert=expert)] = float(count)
    return scalars


def mtp_losses(record: Dict[str, Any]) -> Dict[str, float]:
    """The record's multi-token prediction losses (``mtp_<k>_loss``), in depth order."""
    keys = [key for key in record if MTP_LOSS_KEY.fullmatch(key) and record[key] is not None]
    return {key: record[key] for key in sorted(keys, key=lambda k: int(k.split("_")[1]))}


def mtp_scalar_name(key: str) -> str:
    """megatron's name of ``mtp_<k>_loss``: "mtp_<k> loss" (``track_mtp_metrics``)."""
    return key[: -len("_loss")] + " loss"


def log_line(record: Dict[str, Any], train_iters: int) -> str:
    """megatron's console line: `` iteration 10/20 | lm loss: 3.2 | ...``."""
    parts = [f" iteration {record['iteration']}/{train_iters}"]
    parts.append(f"lm loss: {record['loss']:.6E}")
    parts.append(f"learning rate: {record['lr']:.6E}")
    if record.get("grad_norm") is not None:
        parts.append(f"grad norm: {record['grad_norm']:.4f}")
    if record.get("num_zeros_in_grad") is not None:
        parts.append(f"num zeros: {record['num_zeros_in_grad']:.1f}")
    for key, name in SCALAR_NAMES.items():  # the router losses, megatron's names
        if key.startswith("moe_") and record.get(key) is not None:
            parts.append(f"{name}: {record[key]:.6E}")
    for key, value in mtp_losses(record).items():  # megatron's "mtp_1 loss", ...
        parts.append(f"{mtp_scalar_name(key)}: {value:.6E}")
    parts.append(f"elapsed time per iteration (ms): {1000 * record['iteration_time_s']:.1f}")
    parts.append(f"tokens per second: {record['tokens_per_s']:.0f}")
    return " | ".join(parts)


def _plain(value: Optional[object]) -> bool:
    return isinstance(value, (int, float, str, bool, type(None)))
