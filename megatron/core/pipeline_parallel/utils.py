"""Pipeline-stage questions answered from an explicit pipeline group.

Each function takes the group (or the virtual-pipeline sizes) it asks about, never
``parallel_state``. A ``None`` group stands for a one-stage pipeline.
"""

import torch.distributed as dist

from megatron.core.parallel_state import ParallelStateError
from megatron.core.process_groups_config import get_pg_rank, get_pg_size


def is_pp_first_stage(pp_group: dist.ProcessGroup):
    """Whether this rank is stage 0 of ``pp_group``."""
    return get_pg_rank(pp_group) == 0


def is_pp_last_stage(pp_group: dist.ProcessGroup):
    """Whether this rank is the last stage of ``pp_group``."""
    return get_pg_rank(pp_group) == get_pg_size(pp_group) - 1


def is_vp_first_stage(vp_stage: int, vp_size: int | None):
    """Whether ``vp_stage`` is the first of ``vp_size`` model chunks (always, without VPP)."""
    if vp_size is None or vp_size <= 1:
        _check_no_vpp(vp_stage, vp_size)
        return True
    return vp_stage == 0


def is_vp_last_stage(vp_stage: int, vp_size: int | None):
    """Whether ``vp_stage`` is the last of ``vp_size`` model chunks (always, without VPP)."""
    if vp_size is None or vp_size <= 1:
        _check_no_vpp(vp_stage, vp_size)
        return True
    return vp_stage == vp_size - 1


def get_pp_first_rank(pp_group: dist.ProcessGroup):
    """Global rank of the first stage of ``pp_group``."""
    return dist.get_process_group_ranks(pp_group)[0]


def get_pp_last_rank(pp_group: dist.ProcessGroup):
    """Global rank of the last stage of ``pp_group``."""
    return dist.get_process_group_ranks(pp_group)[-1]


def get_pp_next_rank(pp_group: dist.ProcessGroup):
    """Global rank of the next stage, or None on the last stage (no wrap-around)."""
    if is_pp_last_stage(pp_group):
        return None
    return dist.get_process_group_ranks(pp_group)[get_pg_rank(pp_group) + 1]


def get_pp_prev_rank(pp_group: dist.ProcessGroup):
    """Global rank of the previous stage, or None on the first stage (no wrap-around)."""
    if is_pp_first_stage(pp_group):
        return None
    return dist.get_process_group_ranks(pp_group)[get_pg_rank(pp_group) - 1]


def _check_no_vpp(vp_stage, vp_size) -> None:
    if vp_stage not in (None, 0):
        raise ParallelStateError(
            f"vp_stage={vp_stage!r} with vp_size={vp_size!r}: without virtual pipeline "
            "parallelism vp_stage must be 0 or None"
        )
