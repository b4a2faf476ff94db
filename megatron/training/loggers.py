"""TensorBoard and Weights & Biases mirrors of ``metrics.jsonl`` (megatron's flags and
scalar names).

``metrics.jsonl`` stays the record; ``MetricsLoggers`` writes the same values, under
megatron's scalar names (``SCALAR_NAMES``), to ``--tensorboard-dir`` and/or the W&B run of
``--wandb-project``: the training values of every ``--log-interval``-th iteration and every
validation result. One process writes (megatron's choice: the last rank, which holds the
last pipeline stage); the other ranks get a no-op. Both packages are imported only when
asked for; a missing one is a one-line error naming the extra to install
(``check_logging_packages``, run with the flag checks, before any worker starts).
"""

import importlib.util
import os
from typing import Any, Dict, List, Optional

from megatron.training.errors import UsageError

# --dpo's metrics.jsonl keys (megatron.core.preference.METRIC_KEYS): TRL's names, whose
# scalar names have TRL's slash (rewards/chosen)
DPO_METRICS = (
    "rewards_chosen",
    "rewards_rejected",
    "rewards_accuracies",
    "rewards_margins",
    "logps_chosen",
    "logps_rejected",
)
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
}
VALIDATION_SCALAR_NAMES = {
    "valid_loss": "lm loss validation",
    "valid_ppl": "lm loss validation ppl",
    **{f"valid_{name}": f"{name.replace('_', '/', 1)} validation" for name in DPO_METRICS},
}
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}


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


class MetricsLoggers:
    """The TensorBoard writer and the W&B run of this process (none unless ``writer``)."""

    def __init__(self, config: Any, writer: bool) -> None:
        self.log_interval = config.log_interval
        self.tensorboard = None
        self.wandb_run = None
        if not writer:
            return
        if config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=config.tensorboard_dir, max_queue=1000)
        if config.wandb_project:
            import wandb

            directory = config.wandb_save_dir or (
                os.path.join(config.save, "wandb") if config.save else None
            )
            if directory:
                os.makedirs(directory, exist_ok=True)
            self.wandb_run = wandb.init(
                project=config.wandb_project,
                name=config.wandb_exp_name,
                dir=directory,
                config={k: v for k, v in vars(config).items() if _plain(v)},
            )

    @property
    def active(self) -> bool:
        return self.tensorboard is not None or self.wandb_run is not None

    def log(self, record: Dict[str, Any]) -> None:
        """The scalars of one ``metrics.jsonl`` record: the training values when its
        iteration is a multiple of ``--log-interval``, the validation values always."""
        if not self.active:
            return
        iteration = record["iteration"]
        scalars = scalars_of(record, training=iteration % self.log_interval == 0)
        if not scalars:
            return
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, iteration)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=iteration)

    def close(self) -> None:
        """Flush and close (call on every exit path)."""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def scalars_of(record: Dict[str, Any], training: bool = True) -> Dict[str, float]:
    """``{megatron scalar name: value}`` of a record (None values left out)."""
    names: List[Dict[str, str]] = [VALIDATION_SCALAR_NAMES]
    if training:
        names.insert(0, SCALAR_NAMES)
    return {
        name: float(record[key])
        for table in names
        for key, name in table.items()
        if record.get(key) is not None
    }


def _plain(value: Optional[object]) -> bool:
    return isinstance(value, (int, float, str, bool, type(None)))
