"""Layout-independent logged losses from the ``reported`` dicts of a step.

The loss callback reports ``[sum, count]`` per microbatch (its shard's masked loss sum and
valid-token count). The logged value is one ratio over everything, not a mean of means:
``loss = sum(sums) / sum(counts)`` over microbatches and the dp x cp group, which equals the
one-process value for every layout.
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.communication import all_reduce_


def reduce_reported_losses(
    forward_data_store: List[dict], group: Optional[dist.ProcessGroup] = None
) -> Dict[str, float]:
    """``{key: sum(sum) / sum(count)}`` over microbatches and ``group`` (0 when the count
    is 0), for every key whose entries are ``[sum, count]`` pairs (two-element tensors or
    sequences of two scalars). Other entries are left out.

    Call it on every rank of ``group`` (the dp x cp group of the last pipeline stage);
    ranks of a stage with no reports (not the last) get ``{}`` and run no collective.
    """
    return {
        key: total / count if count > 0 else 0.0
        for key, (total, count) in reduce_reported_totals(forward_data_store, group).items()
    }


def reduce_reported_totals(
    forward_data_store: List[dict], group: Optional[dist.ProcessGroup] = None
) -> Dict[str, Tuple[float, float]]:
    """``{key: (sum(sum), sum(count))}`` in float64 over microbatches and ``group``: the
    totals behind ``reduce_reported_losses`` (same keys, same calling rule)."""
    if not forward_data_store:
        return {}
    keys = sorted(k for k, v in forward_data_store[0].items() if _pair(v) is not None)
    if not keys:
        return {}
    totals = torch.zeros(len(keys), 2, dtype=torch.float64)
    for reported in forward_data_store:
        for i, key in enumerate(keys):
            pair = _pair(reported[key])
            if pair is None:
                raise ValueError(f"reported[{key!r}] must be [sum, count], got {reported[key]!r}")
            totals[i] += pair
    all_reduce_(totals, group)
    return {key: (totals[i, 0].item(), totals[i, 1].item()) for i, key in enumerate(keys)}


def _pair(value) -> Optional[torch.Tensor]:
    """``value`` as a float64 ``[sum, count]`` tensor, or None if it is not a pair."""
    if isinstance(value, torch.Tensor):
        return value.detach().double().reshape(-1).cpu() if value.numel() == 2 else None
    if isinstance(value, (list, tuple)) and len(value) == 2:
        parts = [torch.as_tensor(v).detach().double().reshape(-1).cpu() for v in value]
        return torch.cat(parts) if all(p.numel() == 1 for p in parts) else None
    return None
