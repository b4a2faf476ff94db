"""The groups a MoE layer runs on, resolved once (``pg_collection`` first, else
``parallel_state``'s: the MPU fallback, else one rank) and checked against the config.

- ``tp``, ``cp``: the model's tensor- and context-parallel groups; ``tp_cp`` (their product)
  holds the shards of one micro-batch: token counts and router losses are summed over it;
- ``dp``: the data-parallel group (logged losses are averaged over it); ``tp_dp_cp``: the
  expert-bias counts are summed over it;
- ``ep`` (expert parallel), ``expt_tp`` (expert tensor parallel), ``tp_ep`` (their
  product: tokens are exchanged within it), ``expt_dp`` (expert gradients are summed over
  it).
"""

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from megatron.core.process_groups_config import ProcessGroupCollection, get_pg_size, resolve_group


@dataclass
class MoEGroups:
    """Resolved groups (None = one rank)."""

    tp: Optional[dist.ProcessGroup]
    cp: Optional[dist.ProcessGroup]
    tp_cp: Optional[dist.ProcessGroup]
    dp: Optional[dist.ProcessGroup]
    tp_dp_cp: Optional[dist.ProcessGroup]
    ep: Optional[dist.ProcessGroup]
    expt_tp: Optional[dist.ProcessGroup]
    tp_ep: Optional[dist.ProcessGroup]
    expt_dp: Optional[dist.ProcessGroup]


def moe_groups_of(pg_collection: Optional[ProcessGroupCollection], config) -> MoEGroups:
    """The MoE groups (see the module docstring); a group whose size disagrees with the
    config raises ``ValueError`` naming it."""
    groups = MoEGroups(
        **{name: resolve_group(name, pg_collection=pg_collection) for name in _NAMES}
    )
    tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
    ep, etp = config.expert_model_parallel_size, config.expert_tensor_parallel_size
    expected = {"tp": tp, "cp": cp, "tp_cp": tp * cp, "ep": ep, "expt_tp": etp, "tp_ep": etp * ep}
    where = "pg_collection" if pg_collection is not None else "parallel_state"
    for name, size in expected.items():
        actual = get_pg_size(getattr(groups, name))
        if actual != size:
            raise ValueError(
                f"MoE layer: the {name} group of {where} has {actual} rank(s) but the config "
                f"needs {size} (tensor_model_parallel_size={tp}, context_parallel_size={cp}, "
                f"expert_model_parallel_size={ep}, expert_tensor_parallel_size={etp}); pass "
                f"pg_collection.{name}"
            )
    return groups


_NAMES = ("tp", "cp", "tp_cp", "dp", "tp_dp_cp", "ep", "expt_tp", "tp_ep", "expt_dp")


def get_default_pg_collection() -> ProcessGroupCollection:
    """The MoE layer's groups from ``parallel_state`` (MPU fallback): ep, expt_tp, tp_ep,
    expt_dp, tp, cp, tp_cp, dp, tp_dp_cp, pp."""
    return ProcessGroupCollection.use_mpu_process_groups(
        ["ep", "expt_tp", "tp_ep", "expt_dp", "tp", "cp", "tp_cp", "dp", "tp_dp_cp", "pp"]
    )
