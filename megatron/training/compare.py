"""Checking a run against the one-process run: per-iteration losses side by side, the
largest difference, and a verdict against a tolerance per iteration.

The tolerance rule (``--compare-single-process``, docs/lifecycle.md):

- ``--compare-tolerance T``: T at every iteration.
- fp32: ``tolerance_i = max(1e-4, 10 * e_i)``, ``e_i = max over j <= i of |L_j - L'_j|``,
  L the one-process run and L' a second one-process run whose initial weights differ by a
  relative 1e-6 (``SENSITIVITY_PERTURBATION``): how far rounding-sized differences grow by
  iteration i in this very run (Adam amplifies them over long runs). The first iterations
  are held to 1e-4; a layout that trains another objective (per-shard normalization at
  C > 1) differs by more than 1e-3 from the second iteration on.
- bf16 / fp16: ``3 * max_i |L_i(half precision) - L_i(fp32)|`` over the one-process runs at
  every iteration: the precision's own rounding.

A tolerance above ``MEANINGFUL_FRACTION`` (1%) of the one-process loss at its iteration
cannot tell a layout error from the run's own sensitivity (a long MoE run whose routing
flips grew it to 0.97 on a loss of 2): such a comparison is INCONCLUSIVE, not a PASS.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

# A tolerance above this fraction of the one-process loss says nothing about the layout:
# a real error of that size (per-shard normalization at C = 2 drifted by ~1.5% in bf16)
# would pass.
MEANINGFUL_FRACTION = 0.01


@dataclass
class Comparison:
    """Per-iteration ``(iteration, loss, single-process loss, |difference|, tolerance)``
    rows and the rule the tolerances follow (printed once)."""

    rows: List[tuple]
    rule: str = ""

    @property
    def max_difference(self) -> float:
        """max over iterations of |loss - single-process loss| (inf when none)."""
        return max((row[3] for row in self.rows), default=float("inf"))

    @property
    def tolerance(self) -> float:
        """The largest per-iteration tolerance (the only one when it is constant)."""
        return max((row[4] for row in self.rows), default=0.0)

    @property
    def worst(self) -> Optional[tuple]:
        """The row with the largest difference / tolerance."""
        return max(self.rows, key=_excess, default=None)

    @property
    def within_tolerance(self) -> bool:
        """Every difference within its iteration's tolerance (and at least one row)."""
        return bool(self.rows) and all(row[3] <= row[4] for row in self.rows)

    @property
    def loose_rows(self) -> List[tuple]:
        """The rows whose tolerance exceeds ``MEANINGFUL_FRACTION`` of the one-process
        loss (it could not catch a layout error of that size)."""
        return [row for row in self.rows if row[4] > MEANINGFUL_FRACTION * abs(row[2])]

    @property
    def inconclusive(self) -> bool:
        """Within tolerance, but only because some tolerance is too wide to mean anything."""
        return self.within_tolerance and bool(self.loose_rows)

    @property
    def failed(self) -> bool:
        """Some difference above its tolerance (or no rows): the run does not follow. An
        INCONCLUSIVE comparison has not failed (SPEC 19: a correct run is never failed)."""
        return not self.within_tolerance

    @property
    def passed(self) -> bool:
        """Within tolerance at every iteration, and every tolerance meaningful."""
        return self.within_tolerance and not self.loose_rows

    @property
    def verdict(self) -> str:
        """PASS, FAIL or INCONCLUSIVE."""
        if self.passed:
            return "PASS"
        return "INCONCLUSIVE" if self.inconclusive else "FAIL"


def compare_losses(
    records: List[dict], reference: List[dict], tolerance, rule: str = ""
) -> Comparison:
    """Pair the two runs' records by iteration; |a - b| per iteration. ``tolerance``: one
    number, or one per iteration."""
    if [r["iteration"] for r in records] != [r["iteration"] for r in reference]:
        raise ValueError(f"cannot compare runs of {len(records)} and {len(reference)} iterations")
    tolerances = list(tolerance) if isinstance(tolerance, Sequence) else [tolerance] * len(records)
    rows = [
        (a["iteration"], a["loss"], b["loss"], abs(a["loss"] - b["loss"]), t)
        for a, b, t in zip(records, reference, tolerances)
    ]
    return Comparison(rows, rule or f"{_number(tolerances[0] if tolerances else 0.0)}")


def sensitivity_tolerances(
    reference: List[dict], perturbed: List[dict], floor: float, factor: float
) -> List[float]:
    """``max(floor, factor * max_{j <= i} |reference_j - perturbed_j|)`` per iteration."""
    envelope, tolerances = 0.0, []
    for a, b in zip(reference, perturbed):
        envelope = max(envelope, abs(a["loss"] - b["loss"]))
        tolerances.append(max(floor, factor * envelope))
    return tolerances


def format_comparison(comparison: Comparison, label: str, reference_label: str) -> str:
    """The table, the rule and the verdict, as printed by ``--compare-single-process``."""
    width = max(len(label), len(reference_label), 14)
    header = (
        f"{'iteration':>9}  {label:>{width}}  {reference_label:>{width}}  "
        f"{'|difference|':>12}  {'tolerance':>9}"
    )
    lines = [header, "-" * len(header)]
    for iteration, loss, reference, difference, tolerance in comparison.rows:
        lines.append(
            f"{iteration:>9}  {loss:>{width}.8f}  {reference:>{width}.8f}  {difference:>12.2e}"
            f"  {tolerance:>9.2e}"
        )
    verdict = comparison.verdict
    worst = comparison.worst
    where = (
        ""
        if worst is None
        else f"; closest to its tolerance at iteration {worst[0]} "
        f"({worst[3]:.2e} of {worst[4]:.2e})"
    )
    lines.append(f"tolerance: {comparison.rule}")
    if comparison.inconclusive:
        lines.append(_loose_warning(comparison, reference_label))
    if comparison.passed:
        meaning = f"the {label} run follows the {reference_label} run step for step"
    elif comparison.inconclusive:
        meaning = f"cannot tell whether the {label} run follows the {reference_label} run"
    else:
        meaning = f"the {label} run does NOT follow the {reference_label} run"
    lines.append(
        f"max |difference| = {comparison.max_difference:.2e}{where}: {verdict} -- {meaning}"
    )
    return "\n".join(lines)


def _loose_warning(comparison: Comparison, reference_label: str) -> str:
    """The warning of an INCONCLUSIVE comparison: where the tolerance stopped meaning
    anything, and what to do."""
    loose = comparison.loose_rows
    first, widest = loose[0], max(loose, key=lambda row: row[4] / max(abs(row[2]), 1e-30))
    return (
        f"warning: from iteration {first[0]} the tolerance exceeds "
        f"{MEANINGFUL_FRACTION:.0%} of the {reference_label} loss ({len(loose)} of "
        f"{len(comparison.rows)} iterations; up to {widest[4]:.2e} on a loss of "
        f"{widest[2]:.4f} at iteration {widest[0]}): a layout error that large would pass "
        "unseen (a derived tolerance grows with the run's own sensitivity, e.g. routing "
        "flips); compare fewer iterations (--train-iters) or give a tighter "
        "--compare-tolerance"
    )


def _excess(row: tuple) -> float:
    difference, tolerance = row[3], row[4]
    if tolerance > 0:
        return difference / tolerance
    return float("inf") if difference > 0 else 0.0


def _number(value: float) -> str:
    return f"{value:.2e}"
