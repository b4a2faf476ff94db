"""Which process groups a model module uses: explicit ``pg_collection`` first, then the MPU
fallback (``parallel_state``), then none (one process).

Each getter checks the group's size against the config, so a mismatched collection is a clear
error at build time rather than a hang.
"""

from typing import List, Optional

import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_pg_size


def tp_group_of(
    pg_collection: Optional[ProcessGroupCollection], config
) -> Optional[dist.ProcessGroup]:
    """The TP group: ``pg_collection.tp``; without a collection, ``parallel_state``'s (MPU
    fallback) when initialized; else None (TP = 1). Its size must equal
    ``config.tensor_model_parallel_size``."""
    return _group_of(
        pg_collection,
        "tp",
        config.tensor_model_parallel_size,
        "tensor_model_parallel_size",
        parallel_state.get_tensor_model_parallel_group,
    )


def cp_group_of(
    pg_collection: Optional[ProcessGroupCollection], config
) -> Optional[dist.ProcessGroup]:
    """The CP group: ``pg_collection.cp``; without a collection, ``parallel_state``'s (MPU
    fallback) when initialized; else None (C = 1). Its size must equal
    ``config.context_parallel_size``."""
    return _group_of(
        pg_collection,
        "cp",
        config.context_parallel_size,
        "context_parallel_size",
        parallel_state.get_context_parallel_group,
    )


def hierarchical_cp_groups_of(
    pg_collection: Optional[ProcessGroupCollection], config
) -> List[dist.ProcessGroup]:
    """The [all-to-all, ring] groups of ``cp_comm_type="a2a+p2p"``: ``pg_collection.hcp``;
    without a collection, ``parallel_state.get_hierarchical_context_parallel_groups()``.

    They must be two levels that split this rank's CP group the way the attention assumes
    (``initialize_model_parallel(hierarchical_context_parallel_sizes=[A, P])`` builds them
    so): the all-to-all group is the run of A consecutive CP ranks holding this rank, the
    ring every A-th CP rank from it, so that CP rank = ring rank * A + all-to-all rank.
    """
    cp_group = cp_group_of(pg_collection, config)
    if pg_collection is not None:
        groups = pg_collection.hcp
    elif parallel_state.model_parallel_is_initialized():
        groups = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    else:
        groups = None
    where = "pg_collection.hcp" if pg_collection is not None else "parallel_state"
    if groups is None or len(groups) != 2:
        raise ValueError(
            "cp_comm_type='a2a+p2p' needs two hierarchical CP groups [all-to-all, ring] "
            "(initialize_model_parallel(hierarchical_context_parallel_sizes=[A, P]) or "
            f"pg_collection.hcp); {where} has {groups!r}"
        )
    cp_ranks = dist.get_process_group_ranks(cp_group)
    index = cp_ranks.index(dist.get_rank())
    a2a_size = get_pg_size(groups[0])
    start = index - index % a2a_size
    expected = [cp_ranks[start : start + a2a_size], cp_ranks[index % a2a_size :: a2a_size]]
    actual = [dist.get_process_group_ranks(group) for group in groups]
    if actual != expected:
        raise ValueError(
            f"cp_comm_type='a2a+p2p': the hierarchical CP groups of {where} are {actual}; for "
            f"the CP group {cp_ranks} this rank needs {expected} (A consecutive CP ranks, "
            "then every A-th)"
        )
    return list(groups)


def pp_rank_of(pg_collection: Optional[ProcessGroupCollection], config) -> int:
    """This rank's pipeline rank: in ``pg_collection.pp``; without a collection,
    ``parallel_state``'s (MPU fallback) when initialized; else 0."""
    group = _group_of(
        pg_collection,
        "pp",
        config.pipeline_model_parallel_size,
        "pipeline_model_parallel_size",
        parallel_state.get_pipeline_model_parallel_group,
    )
    return 0 if group is None else dist.get_rank(group=group)


def _group_of(pg_collection, field: str, size: int, size_name: str, mpu_getter):
    if pg_collection is not None:
        group = getattr(pg_collection, field)
    elif parallel_state.model_parallel_is_initialized():
        group = mpu_getter()
    else:
        group = None
    actual = get_pg_size(group)
    if field == "tp" and pg_collection is None and size == 1 and actual > 1:
        # megatron-core's MPU fallback: a script that initializes parallel_state with TP > 1
        # and leaves config.tensor_model_parallel_size at its default (megatron-core's own
        # examples/run_simple_mcore_train_loop.py) gets parallel_state's TP group.
        return group
    if actual != size:
        where = "pg_collection" if pg_collection is not None else "parallel_state"
        raise ValueError(
            f"the {field} group of {where} has {actual} rank(s) but config.{size_name} is "
            f"{size}" + (f"; pass pg_collection.{field}" if group is None else "")
        )
    return group
