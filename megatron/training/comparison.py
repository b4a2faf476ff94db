"""``--compare-single-process``: the run's losses against the same training on one process.

After a multi-process run, ``compare_with_single_process`` trains the same job on global rank
0 alone (its own groups; the other ranks wait), and for fp32 a second one-process run with
initial weights perturbed by a rounding-sized amount (or, for bf16 / fp16, an fp32 one): the
per-iteration tolerances follow from them (``comparison_tolerances``); ``compare.py`` holds
the rule and the verdict. The trainer's ``train`` is passed in (``pretrain`` hands its own).
"""

import dataclasses
from typing import Callable, List, Optional, Tuple

import torch

from megatron.core.communication import barrier, broadcast_, world_group
from megatron.core.device import comm_device
from megatron.training.arguments import TrainingConfig, single_process_config, validate_config
from megatron.training.compare import (
    Comparison,
    compare_losses,
    format_comparison,
    sensitivity_tolerances,
)
from megatron.training.initialize import is_rank_zero, print_rank_0, single_process_groups

# train(config, layout, groups, desc=..., perturbation=...) -> records (``training.train``)
Train = Callable[..., List[dict]]


def compare_with_single_process(
    train: Train, config: TrainingConfig, records: List[dict], label: str
) -> Tuple[Optional[List[dict]], Optional[Comparison], bool]:
    """(the one-process records, the comparison on rank 0 (None elsewhere), whether it
    passed on every rank): rank 0's verdict; INCONCLUSIVE is not a failure. Collective."""
    reference = train_single_process(train, config)
    tolerances, rule = comparison_tolerances(train, config, reference)
    comparison = None
    if is_rank_zero():
        comparison = compare_losses(records, reference, tolerances, rule)
        print_rank_0(format_comparison(comparison, label, "1 process"))
    passed = _agree_on_rank_zero(comparison is None or not comparison.failed)
    return reference, comparison, passed


PRECISION_FIELDS = (
    "bf16",
    "fp16",
    "loss_scale",
    "initial_loss_scale",
    "min_loss_scale",
    "loss_scale_window",
    "hysteresis",
)
FP32_COMPARE_TOLERANCE = 1e-4
HALF_PRECISION_TOLERANCE_FACTOR = 3.0
SENSITIVITY_PERTURBATION = 1e-6
SENSITIVITY_FACTOR = 10.0


def comparison_tolerances(
    train: Train, config: TrainingConfig, reference: Optional[List[dict]]
) -> Tuple[Optional[List[float]], str]:
    """The per-iteration tolerances of ``--compare-single-process`` and their rule, on
    rank 0 (None elsewhere); the rule of ``megatron.training.compare``:

    - ``--compare-tolerance T``: T everywhere;
    - fp32: ``max(1e-4, 10 * e_i)``, e_i the running largest |difference| between the
      one-process run and a second one whose initial weights are scaled by
      ``1 + 1e-6 * u`` (u uniform in [-1, 1], fixed): the run's own sensitivity to
      rounding-sized changes, which Adam amplifies over long runs;
    - bf16 / fp16: ``3 * max_i |one process half - one process fp32|`` everywhere: a
      layout's rounding and the one-process run's are independent, each about as large as
      that difference, so the two runs can differ by about twice it.

    The extra one-process run trains on rank 0 while the other ranks wait."""
    n = len(reference) if reference is not None else 0
    if config.compare_tolerance is not None:
        tolerance = config.compare_tolerance
        return [tolerance] * n, f"--compare-tolerance {tolerance:.2e} at every iteration"
    if not (config.bf16 or config.fp16):
        perturbed = train_single_process(train, config, perturbation=SENSITIVITY_PERTURBATION)
        if not is_rank_zero():
            return None, ""
        tolerances = sensitivity_tolerances(
            reference, perturbed, FP32_COMPARE_TOLERANCE, SENSITIVITY_FACTOR
        )
        return tolerances, (
            f"{FP32_COMPARE_TOLERANCE:.0e}, or {SENSITIVITY_FACTOR:g} x the one-process run's "
            "own sensitivity when larger (the running largest |difference| from a one-process "
            f"run with initial weights perturbed by {SENSITIVITY_PERTURBATION:.0e}, relative)"
        )
    defaults = TrainingConfig()
    fp32 = dataclasses.replace(
        config, **{name: getattr(defaults, name) for name in PRECISION_FIELDS}
    )
    fp32_records = train_single_process(train, fp32)
    if not is_rank_zero():
        return None, ""
    rounding = max(abs(a["loss"] - b["loss"]) for a, b in zip(reference, fp32_records))
    tolerance = HALF_PRECISION_TOLERANCE_FACTOR * rounding
    precision = "bf16" if config.bf16 else "fp16"
    return [tolerance] * n, (
        f"{tolerance:.2e} at every iteration = {HALF_PRECISION_TOLERANCE_FACTOR:g} x the "
        f"largest |one process {precision} - one process fp32| loss difference "
        f"({rounding:.2e})"
    )


def train_single_process(
    train: Train, config: TrainingConfig, perturbation: float = 0.0
) -> Optional[List[dict]]:
    """The same training on one process: here when there is no torch.distributed, else on
    global rank 0 with groups of its own while the other ranks wait. Returns the records
    on the process that trained, None elsewhere. ``perturbation``: see ``training.train``."""
    reference_config = single_process_config(config)
    layout = validate_config(reference_config, 1)
    groups = single_process_groups(rank=0)
    records = None
    if is_rank_zero():
        label = "1 process, perturbed" if perturbation else "1 process"
        records = train(reference_config, layout, groups, desc=label, perturbation=perturbation)
    barrier(world_group())
    return records


def _agree_on_rank_zero(passed: bool) -> bool:
    """Rank 0's verdict, on every rank."""
    flag = torch.tensor([1 if passed else 0], device=comm_device())
    return bool(broadcast_(flag, world_group()).item())
