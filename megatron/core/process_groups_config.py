"""ProcessGroupCollection: the groups a step runs on, passed explicitly."""

import dataclasses
from typing import List, Optional

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
        ps = parallel_state
        getters = {
            "tp": ps.get_tensor_model_parallel_group,
            "pp": ps.get_pipeline_model_parallel_group,
            "mp": ps.get_model_parallel_group,
            "embd": ps.get_embedding_group,
            "pos_embd": ps.get_position_embedding_group,
            "cp": ps.get_context_parallel_group,
            "tp_cp": ps.get_tensor_and_context_parallel_group,
            "hcp": lambda: ps.get_hierarchical_context_parallel_groups(check_initialized=False),
            "ep": ps.get_expert_model_parallel_group,
            "expt_tp": ps.get_expert_tensor_parallel_group,
            "tp_ep": ps.get_expert_tensor_and_model_parallel_group,
            "tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group,
            "tp_dp_cp": lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
            "dp": ps.get_data_parallel_group,
            "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
            "expt_dp": ps.get_expert_data_parallel_group,
            "intra_dp_cp": lambda: ps.get_data_parallel_group(
                with_context_parallel=True, partial_data_parallel=True
            ),
            "intra_expt_dp": lambda: ps.get_expert_data_parallel_group(
                partial_expert_data_parallel=True
            ),
        }
        names = list(getters) if required_pgs is None else list(required_pgs)
        invalid = [n for n in names if n not in getters]
        if invalid:
            raise ValueError(f"Invalid process groups requested: {invalid}")
        return cls(**{name: getters[name]() for name in names})


def _describe(group) -> str:
    """Short text for a group in repr: its size, or the value itself."""
    if isinstance(group, dist.ProcessGroup):
        return f"<group size {group.size()}>"
    return repr(group)
