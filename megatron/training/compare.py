"""Checking a run against the one-process run: per-iteration losses side by side, the
largest difference, and a verdict against a tolerance."""

from dataclasses import dataclass
from typing import List


@dataclass
class Comparison:
    """Per-iteration ``(iteration, loss, single-process loss, |difference|)`` rows."""

    rows: List[tuple]
    tolerance: float

    @property
    def max_difference(self) -> float:
        """max over iterations of |loss - single-process loss| (inf when lengths differ)."""
        return max((row[3] for row in self.rows), default=float("inf"))

    @property
    def passed(self) -> bool:
        """All differences within the tolerance (and at least one iteration compared)."""
        return self.max_difference <= self.tolerance


def compare_losses(records: List[dict], reference: List[dict], tolerance: float) -> Comparison:
    """Pair the two runs' records by iteration; |a - b| per iteration."""
    if [r["iteration"] for r in records] != [r["iteration"] for r in reference]:
        raise ValueError(f"cannot compare runs of {len(records)} and {len(reference)} iterations")
    rows = [
        (a["iteration"], a["loss"], b["loss"], abs(a["loss"] - b["loss"]))
        for a, b in zip(records, reference)
    ]
    return Comparison(rows, tolerance)


def format_comparison(comparison: Comparison, label: str, reference_label: str) -> str:
    """The table and the verdict, as printed by ``--compare-single-process``."""
    width = max(len(label), len(reference_label), 14)
    header = f"{'iteration':>9}  {label:>{width}}  {reference_label:>{width}}  {'|difference|':>12}"
    lines = [header, "-" * len(header)]
    for iteration, loss, reference, difference in comparison.rows:
        lines.append(
            f"{iteration:>9}  {loss:>{width}.8f}  {reference:>{width}.8f}  {difference:>12.2e}"
        )
    verdict = "PASS" if comparison.passed else "FAIL"
    lines.append(
        f"max |difference| = {comparison.max_difference:.2e} (tolerance "
        f"{comparison.tolerance:.0e}): {verdict} -- "
        + (
            f"the {label} run follows the {reference_label} run step for step"
            if comparison.passed
            else f"the {label} run does NOT follow the {reference_label} run"
        )
    )
    return "\n".join(lines)
