"""Small shared pieces of the dataset stack: the split enum, weight normalisation, blends.

``compile_helpers`` exists because megatron-core's scripts call it before building datasets;
here the index-building helpers are plain numpy (``megatron.core.datasets.helpers``), so there
is nothing to compile and it returns at once.
"""

import logging
from enum import Enum
from typing import List, Optional, Tuple

import numpy

logger = logging.getLogger(__name__)


class Split(Enum):
    """The three dataset splits, in megatron-core's order."""

    train = 0
    valid = 1
    test = 2


def compile_helpers() -> None:
    """Make the dataset index helpers available. Nothing to do here.

    megatron-core builds a C++ extension (``make``) for its sample and blending indices. Ours
    are written with numpy (vectorised where the algorithm allows, a short Python loop
    elsewhere), so no compiler is needed and any process may call this.
    """
    from megatron.core.datasets import helpers  # noqa: F401  (importable = ready)


def normalize(weights: List[float]) -> List[float]:
    """Scale non-negative weights to sum to one: w_i / sum_j w_j."""
    w = numpy.array(weights, dtype=numpy.float64)
    total = numpy.sum(w)
    if total <= 0:
        raise ValueError(f"weights={list(weights)}: expected non-negative values with sum > 0")
    return (w / total).tolist()


def get_blend_from_list(
    blend: Optional[List[str]],
) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """``["30", "a", "70", "b"]`` -> ``(["a", "b"], [30.0, 70.0])``; ``["a"]`` -> no weights."""
    if blend is None:
        return None
    if len(blend) % 2 == 1:
        return [p.strip() for p in blend], None
    weights, prefixes = blend[0::2], blend[1::2]
    parsed: List[Optional[float]] = []
    for w in weights:
        try:
            parsed.append(float(w))
        except ValueError:
            parsed.append(None)
    if any(w is None for w in parsed):
        # not a weight/prefix list after all: every entry is a prefix
        return [p.strip() for p in blend], None
    return [p.strip() for p in prefixes], parsed  # type: ignore[return-value]
