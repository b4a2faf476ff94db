"""Which process groups a model module uses, by ``process_groups_config.resolve_group``'s
rule (``pg_collection`` first, then the MPU fallback ``parallel_state``, then none).

Each getter checks the group's size against the config, so a mismatched collection is a clear
error at build time rather than a hang.
"""

import weakref
from typing import Any, Callable, List, Optional

import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.process_groups_config import (
    ProcessGroupCollection,
    get_pg_rank,
    get_pg_size,
    resolve_group,
)


def tp_group_of(
    pg_collection: Optional[ProcessGroupCollection], config
) -> Optional[dist.ProcessGroup]:
    """The TP group: ``pg_collection.tp``; without a collection, ``parallel_state``'s (MPU
    fallback) when initialized; else None (TP = 1). Its size must equal
    ``config.tensor_model_parallel_size``."""
    return _checked_group(pg_collection, "tp", config.tensor_model_parallel_size)


def cp_group_of(
    pg_collection: Optional[ProcessGroupCollection], config
) -> Optional[dist.ProcessGroup]:
    """``tp_group_of`` for the CP group (``pg_collection.cp``; None: C = 1), of size
    ``config.context_parallel_size``: both are ``_checked_group``."""
    return _checked_group(pg_collection, "cp", config.context_parallel_size)


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
    groups = resolve_group("hcp", pg_collection=pg_collection)
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


class ResolvedGroup:
    """A module's group (or list of groups), resolved by ``resolve(pg_collection, config)``
    once instead of at every forward.

    With a ``pg_collection`` the result is kept for good (the module holds the collection
    anyway). Without one (MPU fallback) it is kept until ``parallel_state`` is initialized or
    destroyed again (``parallel_state.groups_generation``), and only weakly, so a model that
    outlives its run does not keep that run's groups alive; then it is resolved afresh.
    """

    def __init__(self, resolve: Callable[[Any, Any], Any], pg_collection, config) -> None:
        self._resolve, self._pg_collection, self._config = resolve, pg_collection, config
        self._generation: Optional[int] = None
        self._held: Any = None
        self.get()  # resolved (and checked) at build time

    def get(self) -> Any:
        """The group(s) of this step."""
        if self._pg_collection is not None:
            if self._generation is None:
                self._held, self._generation = self._resolve(self._pg_collection, self._config), 0
            return self._held
        generation = parallel_state.groups_generation()
        if generation == self._generation:
            groups = _dereference(self._held)
            if groups is not _GONE:
                return groups
        groups = self._resolve(None, self._config)
        self._held, self._generation = _weak(groups), generation
        return groups

    def __getstate__(self) -> dict:  # pickling or deepcopy: resolve again on first use
        state = dict(self.__dict__)
        state["_held"], state["_generation"] = None, None
        return state


_GONE = object()


def _weak(groups: Any) -> Any:
    """``groups`` (None, a group or a list of groups) held by weak references."""
    if groups is None:
        return None
    if isinstance(groups, (list, tuple)):
        return [weakref.ref(g) for g in groups]
    return weakref.ref(groups)


def _dereference(held: Any) -> Any:
    """What ``_weak`` held, or ``_GONE`` when a group was freed since."""
    if held is None:
        return None
    groups = [ref() for ref in held] if isinstance(held, list) else held()
    if groups is None or (isinstance(groups, list) and any(g is None for g in groups)):
        return _GONE
    return groups


def pp_rank_of(pg_collection: Optional[ProcessGroupCollection], config) -> int:
    """This rank's pipeline rank: in ``pg_collection.pp``; without a collection,
    ``parallel_state``'s (MPU fallback) when initialized; else 0."""
    return get_pg_rank(_checked_group(pg_collection, "pp", config.pipeline_model_parallel_size))


_SIZE_NAMES = {
    "tp": "tensor_model_parallel_size",
    "cp": "context_parallel_size",
    "pp": "pipeline_model_parallel_size",
}


def _checked_group(pg_collection, field: str, size: int):
    """``resolve_group(field, pg_collection=pg_collection)``, its size checked against the
    config's."""
    group = resolve_group(field, pg_collection=pg_collection)
    size_name = _SIZE_NAMES[field]
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
