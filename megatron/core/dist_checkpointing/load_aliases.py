"""Other names under which a requested piece may be stored (checkpoints written by
megatron-core or Transformer Engine, or by an older version of this package); ``load`` reads a
piece from its alias only when the checkpoint lacks the piece's own key."""

from dataclasses import replace
from typing import Any, Collection, Dict, List, Optional, Set

from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor

# Other names of the same tensors, tried when a requested key is not in the checkpoint
# (any prefix). Transformer Engine's fused names: megatron-core's TE layer spec fuses the MLA
# q / kv down-projection norms into the up projections. The pre-MLP norm: megatron-core's
# local spec (and this package since it used megatron-core's names) stores it as
# ``mlp.linear_fc1.layer_norm_*`` except in MLA layers, which have no keys map
# (``pre_mlp_layernorm.*``); its TE spec the other way round for MoE layers, and this package
# before for MoE layers and MLA dense layers.
LOAD_ALIASES = (
    ("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight"),
    ("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
)


def read_aliases(values, stored_shapes: Dict[str, Any], stored_objects: Set[str]) -> List:
    """The sharded pieces among ``values``; a requested tensor the checkpoint lacks under its
    key is read from an alias (``LOAD_ALIASES``, any prefix) when the checkpoint has that
    one, and an unstacked ShardedObject from the other grid position an unsharded object
    has had (``_object_alias``)."""
    pieces = [v for v in values if isinstance(v, ShardedBase)]
    for piece in pieces:
        if isinstance(piece, ShardedObject) and piece.unique_key not in stored_objects:
            _object_alias(piece, stored_objects)
        if not isinstance(piece, ShardedTensor) or piece.key in stored_shapes:
            continue
        piece.key = stored_alias(piece.key, stored_shapes) or piece.key
    return pieces


def stored_alias(key: str, stored: Collection[str]) -> Optional[str]:
    """The first alias of ``key`` (``LOAD_ALIASES``, any prefix) that ``stored`` holds, else
    None."""
    for ours, theirs in LOAD_ALIASES:
        alias = key[: -len(ours)] + theirs
        if key.endswith(ours) and alias in stored:
            return alias
    return None


def _object_alias(piece: ShardedObject, stored_objects: Set[str]) -> None:
    """An object outside any grid is stored at shape (1,), offset (0,) by megatron-core
    (``make_sharded_object_for_checkpoint``) and at shape (), offset () by this package
    before it did the same: read whichever the checkpoint has."""
    if tuple(piece.global_shape) not in ((1,), ()) or tuple(piece.global_offset) not in ((0,), ()):
        return
    for shape, offset in (((1,), (0,)), ((), ())):
        if replace(piece, global_shape=shape, global_offset=offset).unique_key in stored_objects:
            piece.global_shape, piece.global_offset = shape, offset
            return
