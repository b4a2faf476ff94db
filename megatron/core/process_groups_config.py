"""The groups a step runs on: ``ProcessGroupCollection``, the one group resolver, and the one
size/rank convention.

The rule, for every function of this library that takes a group or a ``pg_collection``:

1. an explicit group wins (it is the only group used, forward and backward);
2. else ``pg_collection.<name>`` when a collection is given (an unset field is ``None``: the
   collection is never topped up from ``parallel_state`` behind the caller's back);
3. else the MPU fallback: ``parallel_state``'s group of that name, when
   ``initialize_model_parallel`` has run (``ProcessGroupCollection.use_mpu_process_groups``);
4. else ``None``: one rank.

``resolve_group`` applies it to one group, ``resolve_pg_collection`` to a whole collection;
callers document "MPU fallback" and point here. Sizes and ranks of a resolved group come from
``get_pg_size`` / ``get_pg_rank`` (megatron-core's convention: 1 and 0 for ``None`` or
without torch.distributed).
"""

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron.core import parallel_state


@dataclasses.dataclass(init=False)
class ProcessGroupCollection:
    """Named process groups, built by keyword; any field not given reads as ``None``.

    A dataclass with megatron-core's fields, so ``dataclasses.fields`` lists them and
    ``dataclasses.replace(pgc, cp=group)`` copies the others. Unknown names raise
    ``ValueError``. ``hcp`` is a list of groups, one per level of hierarchical context
    parallelism (``parallel_state.get_hierarchical_context_parallel_groups``). The
    distributed-optimizer instance groups (``inter_dist_opt``, ``intra_dist_opt``) may be
    stored but are never built here.
    """

    tp: Optional[dist.ProcessGroup] = None
    pp: Optional[dist.ProcessGroup] = None
    mp: Optional[dist.ProcessGroup] = None
    embd: Optional[dist.ProcessGroup] = None
    pos_embd: Optional[dist.ProcessGroup] = None
    cp: Optional[dist.ProcessGroup] = None
    tp_cp: Optional[dist.ProcessGroup] = None
    hcp: Optional[List[dist.ProcessGroup]] = None
    ep: Optional[dist.ProcessGroup] = None
    expt_tp: Optional[dist.ProcessGroup] = None
    tp_ep: Optional[dist.ProcessGroup] = None
    tp_ep_pp: Optional[dist.ProcessGroup] = None
    tp_dp_cp: Optional[dist.ProcessGroup] = None
    dp: Optional[dist.ProcessGroup] = None
    dp_cp: Optional[dist.ProcessGroup] = None
    expt_dp: Optional[dist.ProcessGroup] = None
    intra_dp_cp: Optional[dist.ProcessGroup] = None
    intra_expt_dp: Optional[dist.ProcessGroup] = None
    inter_dist_opt: Optional[dist.ProcessGroup] = None
    intra_dist_opt: Optional[dist.ProcessGroup] = None

    def __init__(self, **kwargs) -> None:
        known = {field.name for field in dataclasses.fields(self)}
        for key, value in kwargs.items():
            if key not in known:
                raise ValueError(
                    f"ProcessGroupCollection: unknown attribute {key!r}; known: "
                    f"{', '.join(f.name for f in dataclasses.fields(self))}"
                )
            setattr(self, key, value)

    def __repr__(self) -> str:
        set_fields = [
            f"{f.name}={_describe(getattr(self, f.name))}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        ]
        return f"ProcessGroupCollection({', '.join(set_fields) or 'empty'})"

    @classmethod
    def use_mpu_process_groups(
        cls, required_pgs: Optional[List[str]] = None
    ) -> "ProcessGroupCollection":
        """A collection filled from ``parallel_state`` (all groups it builds, or
        ``required_pgs``); ``hcp`` is None unless ``initialize_model_parallel`` was given
        ``hierarchical_context_parallel_sizes``."""
        names = list(_MPU_GETTERS) if required_pgs is None else list(required_pgs)
        invalid = [n for n in names if n not in _MPU_GETTERS]
        if invalid:
            raise ValueError(f"Invalid process groups requested: {invalid}")
        return cls(**{name: _mpu_group(name) for name in names})


def resolve_group(
    name: str,
    group: Any = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
) -> Any:
    """The group ``name`` (a ``ProcessGroupCollection`` field: "tp", "cp", "dp_cp", ...) a
    call uses, by the module docstring's rule: ``group`` if not None; else
    ``pg_collection.<name>`` when a collection is given; else ``parallel_state``'s (MPU
    fallback) when initialized; else None (one rank)."""
    if name not in _MPU_GETTERS:
        raise ValueError(
            f"resolve_group: unknown group name {name!r}; expected one of {', '.join(_MPU_GETTERS)}"
        )
    if group is not None:
        return group
    if pg_collection is not None:
        return getattr(pg_collection, name)
    if parallel_state.model_parallel_is_initialized():
        return _mpu_group(name)
    return None


def resolve_pg_collection(
    pg_collection: Optional[ProcessGroupCollection] = None,
    required_pgs: Optional[Sequence[str]] = None,
) -> Optional[ProcessGroupCollection]:
    """The collection a call uses: ``pg_collection`` if given; else (MPU fallback)
    ``ProcessGroupCollection.use_mpu_process_groups(required_pgs)`` when ``parallel_state``
    is initialized; else None (one process, no groups)."""
    if pg_collection is not None:
        return pg_collection
    if parallel_state.model_parallel_is_initialized():
        return ProcessGroupCollection.use_mpu_process_groups(
            None if required_pgs is None else list(required_pgs)
        )
    return None


def get_pg_size(group: Optional[dist.ProcessGroup] = None) -> int:
    """Size of ``group``; 1 when it is None or torch.distributed is not initialized."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return group.size()


def get_pg_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    """Rank in ``group``; 0 when it is None or torch.distributed is not initialized."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    return group.rank()


# name -> (parallel_state getter, its keyword arguments); looked up at call time.
_MPU_GETTERS: Dict[str, Tuple[str, Dict[str, bool]]] = {
    "tp": ("get_tensor_model_parallel_group", {}),
    "pp": ("get_pipeline_model_parallel_group", {}),
    "mp": ("get_model_parallel_group", {}),
    "embd": ("get_embedding_group", {}),
    "pos_embd": ("get_position_embedding_group", {}),
    "cp": ("get_context_parallel_group", {}),
    "tp_cp": ("get_tensor_and_context_parallel_group", {}),
    "hcp": ("get_hierarchical_context_parallel_groups", {"check_initialized": False}),
    "ep": ("get_expert_model_parallel_group", {}),
    "expt_tp": ("get_expert_tensor_parallel_group", {}),
    "tp_ep": ("get_expert_tensor_and_model_parallel_group", {}),
    "tp_ep_pp": ("get_expert_tensor_model_pipeline_parallel_group", {}),
    "tp_dp_cp": ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    "dp": ("get_data_parallel_group", {}),
    "dp_cp": ("get_data_parallel_group", {"with_context_parallel": True}),
    "expt_dp": ("get_expert_data_parallel_group", {}),
    "intra_dp_cp": (
        "get_data_parallel_group",
        {"with_context_parallel": True, "partial_data_parallel": True},
    ),
    "intra_expt_dp": ("get_expert_data_parallel_group", {"partial_expert_data_parallel": True}),
}


def _mpu_group(name: str) -> Any:
    """``parallel_state``'s group ``name`` (see ``_MPU_GETTERS``)."""
    getter, kwargs = _MPU_GETTERS[name]
    return getattr(parallel_state, getter)(**kwargs)


def _describe(group) -> str:
    """Short text for a group in repr: its size, or the value itself."""
    if isinstance(group, dist.ProcessGroup):
        return f"<group size {group.size()}>"
    return repr(group)
