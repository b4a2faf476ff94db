"""ProcessGroupCollection: the groups a step runs on, passed explicitly."""

from typing import List, Optional

import torch.distributed as dist

from megatron.core import parallel_state


class ProcessGroupCollection:
    """Named process groups; any field not given reads as ``None``.

    Fields: tp, pp, mp, embd, pos_embd, cp, tp_cp, tp_dp_cp, dp, dp_cp (and a few
    megatron-core names for features this core does not implement).
    """

    FIELDS = (
        "tp",
        "pp",
        "mp",
        "embd",
        "pos_embd",
        "cp",
        "tp_cp",
        "hcp",
        "ep",
        "expt_tp",
        "tp_ep",
        "tp_ep_pp",
        "tp_dp_cp",
        "dp",
        "dp_cp",
        "expt_dp",
        "intra_dp_cp",
        "intra_expt_dp",
        "inter_dist_opt",
        "intra_dist_opt",
    )

    def __init__(self, **kwargs) -> None:
        for key, value in kwargs.items():
            if key not in self.FIELDS:
                raise ValueError(
                    f"ProcessGroupCollection: unknown attribute {key!r}; known: "
                    f"{', '.join(self.FIELDS)}"
                )
            setattr(self, key, value)

    def __getattr__(self, name: str):
        if name in type(self).FIELDS:
            return None
        raise AttributeError(f"ProcessGroupCollection has no attribute {name!r}")

    def __repr__(self) -> str:
        set_fields = [f"{k}={_describe(v)}" for k, v in vars(self).items()]
        return f"ProcessGroupCollection({', '.join(set_fields)})"

    @classmethod
    def use_mpu_process_groups(
        cls, required_pgs: Optional[List[str]] = None
    ) -> "ProcessGroupCollection":
        """A collection filled from ``parallel_state`` (all groups, or ``required_pgs``)."""
        getters = {
            "tp": parallel_state.get_tensor_model_parallel_group,
            "pp": parallel_state.get_pipeline_model_parallel_group,
            "mp": parallel_state.get_model_parallel_group,
            "embd": parallel_state.get_embedding_group,
            "pos_embd": parallel_state.get_position_embedding_group,
            "cp": parallel_state.get_context_parallel_group,
            "tp_cp": parallel_state.get_tensor_and_context_parallel_group,
            "tp_dp_cp": lambda: parallel_state.get_tensor_and_data_parallel_group(
                with_context_parallel=True
            ),
            "dp": parallel_state.get_data_parallel_group,
            "dp_cp": lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
            "intra_dp_cp": lambda: parallel_state.get_data_parallel_group(
                with_context_parallel=True
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
