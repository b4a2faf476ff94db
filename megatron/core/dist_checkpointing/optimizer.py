"""Optimizer state as sharded pieces: each per-parameter state tensor (Adam's ``exp_avg``,
``exp_avg_sq``, fp32 main parameters) is stored like its parameter, same boxes and replica
ids, under ``optimizer.state.<name>.<parameter key>``, so it reshards exactly as the model
does. Parameter groups keep their hyper-parameters in the common state; their ``params``
lists (positions, which depend on the layout) stay local.
"""

from copy import deepcopy
from dataclasses import replace
from typing import Any, Dict, Iterable, Tuple, Union

import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)

Sharded = Union[ShardedTensor, ShardedTensorFactory]


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[torch.nn.Parameter]
) -> Dict[int, Sharded]:
    """{position of the parameter in ``optim_params_iter``: its model piece}, matching by
    identity (the piece's ``data`` is the parameter)."""
    by_tensor = {
        id(piece.data): piece
        for piece in nested_values(model_sharded_state_dict)
        if isinstance(piece, (ShardedTensor, ShardedTensorFactory))
    }
    mapping = {}
    for index, param in enumerate(optim_params_iter):
        if id(param) not in by_tensor:
            raise CheckpointingException(
                f"optimizer parameter #{index} (shape {tuple(param.shape)}) is not in the "
                "model's sharded state dict; pass the sharded state dict of every model chunk "
                "the optimizer updates"
            )
        mapping[index] = by_tensor[id(param)]
    return mapping


def make_sharded_optimizer_tensor(
    model_param: Sharded, optim_param: torch.Tensor, prefix: str
) -> Sharded:
    """``optim_param`` stored like ``model_param`` (same boxes and replica ids) under
    ``prefix.<model key>``."""
    if tuple(optim_param.shape) != tuple(model_param.data.shape):
        raise CheckpointingException(
            f"optimizer tensor {prefix}.{model_param.key} has shape {tuple(optim_param.shape)}, "
            f"its parameter {tuple(model_param.data.shape)}"
        )
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=f"{prefix}.{model_param.key}", data=optim_param)
    return replace(
        model_param, key=f"{prefix}.{model_param.key}", data=optim_param, dtype=optim_param.dtype
    )


def optim_state_to_sharding_state(
    optim_state_dict: Dict[str, Any],
    id_to_sharded_param_map: Dict[int, Sharded],
    exclude_keys: Tuple[str, ...] = (),
) -> None:
    """Turn a torch optimizer ``state_dict()`` into a sharded one, in place: every tensor of
    ``state[i]`` (but ``exclude_keys``) becomes a piece like parameter i's; the groups'
    ``params`` lists become ``LocalNonpersistentObject``."""
    sharded_state: Dict[int, Dict[str, Any]] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        if param_id not in id_to_sharded_param_map:
            raise CheckpointingException(
                f"optimizer state of parameter #{param_id} has no model piece"
            )
        sharded_state[param_id] = {}
        for name, value in param_state.items():
            if name in exclude_keys:
                continue
            sharded_state[param_id][name] = make_sharded_optimizer_tensor(
                id_to_sharded_param_map[param_id], value, prefix=f"optimizer.state.{name}"
            )
    optim_state_dict["param_groups"] = deepcopy(optim_state_dict["param_groups"])
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])
    optim_state_dict["state"] = sharded_state


def extract_common_step(optim_state_dict: Dict[str, Any]) -> Any:
    """The ``step`` every parameter's state shares (None without state); different steps
    per parameter are an error (they could not be resharded)."""
    common = None
    for param_id, param_state in optim_state_dict["state"].items():
        step = param_state.get("step")
        if step is None:
            continue
        if common is None:
            common = step
        elif not torch.equal(torch.as_tensor(step), torch.as_tensor(common)):
            raise CheckpointingException(
                f"optimizer step differs between parameters (#{param_id}: {step}, others: "
                f"{common}); only a step shared by all parameters can be resharded"
            )
    return common


def restore_common_step(optim_state_dict: Dict[str, Any]) -> None:
    """Undo ``extract_common_step``: pop ``state["common_step"]`` and give every parameter
    state a copy of it (in place)."""
    state = optim_state_dict.get("state", {})
    if "common_step" in state:
        step = state.pop("common_step")
        for param_state in state.values():
            param_state["step"] = deepcopy(step)
