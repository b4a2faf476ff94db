"""How ``load`` treats keys that the request and the checkpoint do not share, and the
check that a save writes every element of every global tensor exactly once.

Terms (megatron-core's): an *unexpected* key is requested but absent from the checkpoint;
a *missing* key is in the checkpoint but requested by no rank.
"""

from enum import Enum
from math import prod
from typing import Dict, List, Sequence, Tuple, Union

from megatron.core.dist_checkpointing.core import CheckpointingException


class StrictHandling(Enum):
    """What ``load(strict=...)`` does with unexpected and missing keys.

    ``assume_ok_unexpected`` (default): no pre-check; an unexpected key fails the load with
    an error naming it. ``log_unexpected`` / ``log_all``: log them (and missing keys), skip
    the unexpected ones. ``raise_unexpected`` / ``raise_all``: raise before reading anything.
    ``return_unexpected`` / ``return_all``: skip them and return ``(state_dict,
    missing_keys, unexpected_keys)``. ``ignore_all``: skip them silently.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        """Whether the request is compared with the checkpoint's keys before loading."""
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        """Whether all ranks' requests are needed (to find missing keys)."""
        return val in (
            StrictHandling.IGNORE_ALL,
            StrictHandling.RAISE_ALL,
            StrictHandling.RETURN_ALL,
            StrictHandling.LOG_ALL,
        )

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        """Whether ``load`` returns ``(state_dict, missing_keys, unexpected_keys)``."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, StrictHandling]) -> StrictHandling:
    """``StrictHandling`` from itself or its string value (a clear error otherwise)."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except ValueError:
        allowed = ", ".join(repr(s.value) for s in StrictHandling)
        raise CheckpointingException(
            f"strict={strict!r} is not a StrictHandling value; expected one of {allowed}"
        ) from None


Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offset, shape)


def find_coverage_errors(
    key: str, global_shape: Sequence[int], boxes: List[Tuple[Box, int]]
) -> List[str]:
    """Problems with the main-replica boxes ``(box, rank)`` of one global tensor: boxes that
    overlap, and elements no box covers (found as total volume short of the tensor's)."""
    errors = []
    ordered = sorted(boxes, key=lambda b: b[0][0])
    for i, ((off_a, shape_a), rank_a) in enumerate(ordered):
        for (off_b, shape_b), rank_b in ordered[i + 1 :]:
            if off_a and off_b[0] >= off_a[0] + shape_a[0]:
                break
            if all(
                oa < ob + sb and ob < oa + sa
                for oa, sa, ob, sb in zip(off_a, shape_a, off_b, shape_b)
            ):
                errors.append(
                    f"{key!r}: the box at offset {off_a} shape {shape_a} (rank {rank_a}) "
                    f"overlaps the box at offset {off_b} shape {shape_b} (rank {rank_b}); each "
                    "element needs exactly one main replica (replica_id 0)"
                )
    covered = sum(prod(shape) for (_, shape), _ in boxes)
    total = prod(global_shape)
    if not errors and covered != total:
        errors.append(
            f"{key!r}: main replicas cover {covered} of {total} elements of global shape "
            f"{tuple(global_shape)}; some element has no rank with replica_id 0 writing it"
        )
    return errors


def summarize(errors: List[str], limit: int = 10) -> str:
    """The first ``limit`` messages, one per line, and how many more there were."""
    text = "\n  ".join(errors[:limit])
    more = f"\n  ... and {len(errors) - limit} more" if len(errors) > limit else ""
    return f"\n  {text}{more}"


def group_by_key(items: List[Tuple[str, object]]) -> Dict[str, list]:
    """{key: [item, ...]} preserving order."""
    grouped: Dict[str, list] = {}
    for key, item in items:
        grouped.setdefault(key, []).append(item)
    return grouped
