"""Helpers scripts use on sharded state dicts: extracting pieces and renaming keys."""

from typing import Any, Dict, Tuple

from megatron.core.dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    extract_matching_values,
)
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)


def extract_sharded_tensors(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """(the ShardedTensors, everything else), keeping the nesting."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))


def extract_sharded_tensors_and_factories(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """(the ShardedTensors and ShardedTensorFactories, everything else)."""
    return extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory))
    )


def extract_sharded_tensors_or_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """(ShardedTensors, factories and LocalNonpersistentObjects, everything else)."""
    return extract_matching_values(
        sharded_state_dict,
        lambda v: isinstance(v, (ShardedTensor, LocalNonpersistentObject, ShardedTensorFactory)),
    )


def extract_sharded_base(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """(every ShardedBase piece, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))


def extract_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """(the LocalNonpersistentObjects, everything else)."""
    return extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
    )


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the storage key of every sharded piece (in place)."""

    def add_prefix(t):
        if isinstance(t, ShardedBase):
            t.key = f"{prefix}{t.key}"
        return t

    dict_list_map_inplace(add_prefix, sharded_state_dict)


def replace_prefix_for_sharding(
    sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str
) -> None:
    """Replace ``old_prefix`` with ``new_prefix`` in every sharded piece's storage key, in
    place; a key without ``old_prefix`` is an error (``ValueError`` naming it)."""

    def replace_prefix(x):
        if isinstance(x, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
            if not x.key.startswith(old_prefix):
                raise ValueError(
                    f"replace_prefix_for_sharding: key {x.key!r} does not start with "
                    f"old_prefix {old_prefix!r}"
                )
            x.key = f"{new_prefix}{x.key[len(old_prefix):]}"
        return x

    dict_list_map_inplace(replace_prefix, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: Dict[str, str]) -> None:
    """Rename storage keys by the first matching prefix in ``prefix_map`` (old -> new), in
    place; keys matching no prefix are left as they are."""

    def rename(x: Any):
        if isinstance(x, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
            for old_prefix, new_prefix in prefix_map.items():
                if x.key.startswith(old_prefix):
                    x.key = f"{new_prefix}{x.key[len(old_prefix):]}"
                    break
        return x

    dict_list_map_inplace(rename, sharded_state_dict)
