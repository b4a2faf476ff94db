"""Sharded state dicts of modules: which box of which global tensor each parameter is.

A parameter split over tensor parallelism (``param.tensor_model_parallel``) is a box along
``param.partition_dim``; with ``partition_stride`` S > 1 (the gated MLP's fc1, whose TP rank
holds slices of both halves) its local tensor is S boxes, blocks ``s * T + r`` of the T * S
blocks of the global tensor (T = TP size, r = TP rank), built by a ``ShardedTensorFactory``.
Every other parameter is whole and replicated over TP and data-parallel (x context-parallel)
ranks; only TP rank 0 of DP x CP rank 0 writes it. Replica ids are
``(0, tp_rank or 0, dp_cp_rank)``, megatron-core's layout; a first entry 1 marks a copy that
another stage owns (the tied output weight).

``sharded_offsets`` are prepended axes ``(axis, offset, count)`` (the global layer index,
for example); every tensor and object built here gets them.

Groups (``process_groups_config.resolve_group``'s rule): ``tp_group=`` / ``dp_cp_group=``
given, else ``metadata["tp_group"]`` / ``metadata["dp_cp_group"]``, else ``parallel_state``'s
groups when initialized (MPU fallback), else one rank.
"""

from typing import Any, Dict, Iterable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.mapping import (
    ReplicaId,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.utils import apply_prefix_mapping
from megatron.core.process_groups_config import get_pg_rank, get_pg_size, resolve_group

Offsets = Tuple[Tuple[int, int, int], ...]


def gelu_impl(x: torch.Tensor) -> torch.Tensor:
    """OpenAI's GELU (tanh approximation): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """``gelu_impl`` (megatron's ``--openai-gelu``; GPT-2's ``gelu_new``)."""
    return gelu_impl(x)


# megatron-core forward arguments this core does not implement, with what is supported
# instead: refused by ``refuse_unsupported_arguments`` when not None (SPEC section 8).
UNSUPPORTED_FORWARD_ARGUMENTS = {
    "context": "cross-attention is not implemented",
    "context_mask": "cross-attention is not implemented",
    "key_value_states": "cross-attention is not implemented",
    "rotary_pos_cos": "the fused-rope cos/sin tables are not implemented; pass rotary_pos_emb",
    "rotary_pos_sin": "the fused-rope cos/sin tables are not implemented; pass rotary_pos_emb",
    "rotary_pos_cos_sin": "flashinfer's fused rope (dynamic inference) is not implemented",
    "sequence_len_offset": "it is the KV cache's offset: pass inference_context, whose "
    "sequence_len_offset is used",
    "attention_bias": "the attention is causal by global position, with no additive bias",
    "per_token_scale": "scaling the activations by per-token router probabilities (the MoE "
    "experts' option) is not implemented in the MLP",
}


def describe_value(value: Any) -> str:
    """A short description of an argument's value for an error message."""
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)}"
    if type(value).__repr__ is object.__repr__:  # no repr of its own: its class says more
        return f"a {type(value).__name__}"
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def refuse_unsupported_arguments(
    owner: str, reasons: Optional[Dict[str, str]] = None, /, **arguments: Any
) -> None:
    """Refuse, naming ``owner``, the argument and its value, a non-None value of an argument
    that is not implemented (SPEC section 8: never silently dropped); the reason is
    ``reasons``' entry, else ``UNSUPPORTED_FORWARD_ARGUMENTS``'."""
    for name, value in arguments.items():
        if value is not None:
            reason = (reasons or {}).get(name) or UNSUPPORTED_FORWARD_ARGUMENTS[name]
            raise NotImplementedError(
                f"{owner}: {name} is not supported ({reason}); got {describe_value(value)}, "
                "expected None"
            )


def sharded_state_dict_default(
    module: torch.nn.Module,
    prefix: str = "",
    sharded_offsets: Offsets = (),
    metadata: Optional[dict] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> ShardedStateDict:
    """``module.sharded_state_dict(...)`` when it has one, else its state dict with each
    tensor made a ShardedTensor by its parameter's TP attributes (see the module docstring)
    and each ``_extra_state`` a ShardedObject."""
    if hasattr(module, "sharded_state_dict"):
        return module.sharded_state_dict(
            prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata
        )
    state_dict = module.state_dict(prefix="", keep_vars=True)
    return make_sharded_tensors_for_checkpoint(
        state_dict,
        prefix,
        tensor_parallel_axis_map(state_dict),
        sharded_offsets,
        tp_group=tp_group if tp_group is not None else _tp_group(metadata),
        dp_cp_group=_dp_cp_group(metadata),
    )


def make_sharded_tensors_for_checkpoint(
    state_dict: Dict[str, Any],
    prefix: str,
    tensor_parallel_layers_axis_map: Optional[Dict[str, int]] = None,
    sharded_offsets: Iterable[Tuple[int, int, int]] = (),
    extra_state_suffix: str = "_extra_state",
    tp_group: Optional[dist.ProcessGroup] = None,
    dp_cp_group: Optional[dist.ProcessGroup] = None,
) -> ShardedStateDict:
    """``{prefix + name: piece}`` for a (module's) state dict: names in
    ``tensor_parallel_layers_axis_map`` are split over TP along the given axis, names ending
    in ``extra_state_suffix`` become ShardedObjects, the rest are replicated."""
    axis_map = tensor_parallel_layers_axis_map or {}
    sharded_offsets = tuple(sharded_offsets)
    if tp_group is None:
        tp_group = _tp_group(None)
    if dp_cp_group is None:
        dp_cp_group = _dp_cp_group(None)
    out: ShardedStateDict = {}
    for name, value in state_dict.items():
        key = f"{prefix}{name}"
        if name.endswith(extra_state_suffix):
            out[key] = make_sharded_object_for_checkpoint(
                value, key, sharded_offsets, tp_group=tp_group, dp_cp_group=dp_cp_group
            )
        elif name in axis_map:
            out[key] = make_tp_sharded_tensor_for_checkpoint(
                value, key, axis_map[name], None, sharded_offsets, tp_group, dp_cp_group
            )
        else:
            out[key] = make_sharded_tensor_for_checkpoint(
                value, key, sharded_offsets, None, tp_group, dp_cp_group
            )
    return out


def make_sharded_object_for_checkpoint(
    obj: Any,
    key: str,
    sharded_offsets: Iterable[Tuple[int, int, int]] = (),
    replica_id: Union[None, int, Tuple[int, ...]] = None,
    **kwargs,
) -> ShardedObject:
    """A ShardedObject at the prepended offsets' position (grid = their counts; without
    offsets shape (1,), offset (0,), as megatron-core), written by TP rank 0 of DP x CP rank 0
    unless ``replica_id`` says otherwise. ``tp_group`` / ``dp_cp_group`` may be given as
    keywords."""
    sharded_offsets = tuple(sharded_offsets) or ((0, 0, 1),)
    if replica_id is None:
        replica_id = (
            0,
            get_pg_rank(kwargs.get("tp_group", _tp_group(None))),
            get_pg_rank(kwargs.get("dp_cp_group", _dp_cp_group(None))),
        )
    return ShardedObject(
        key,
        obj,
        tuple(count for _, _, count in sharded_offsets),
        tuple(offset for _, offset, _ in sharded_offsets),
        replica_id,
    )


def make_sharded_tensor_for_checkpoint(
    tensor: torch.Tensor,
    key: str,
    prepend_offsets: Offsets = (),
    replica_id: Optional[ReplicaId] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    dp_cp_group: Optional[dist.ProcessGroup] = None,
    **kwargs,
) -> ShardedTensor:
    """A whole tensor replicated over TP and DP x CP (replica id (0, tp_rank, dp_cp_rank))."""
    if replica_id is None:
        replica_id = (0, get_pg_rank(tp_group), get_pg_rank(dp_cp_group))
    return ShardedTensor.from_rank_offsets(
        key,
        tensor,
        *prepend_offsets,
        replica_id=replica_id,
        prepend_axis_num=len(prepend_offsets),
        **kwargs,
    )


def make_tp_sharded_tensor_for_checkpoint(
    tensor: torch.Tensor,
    key: str,
    tp_axis: int = 0,
    replica_id: Optional[ReplicaId] = None,
    prepend_offsets: Offsets = (),
    tp_group: Optional[dist.ProcessGroup] = None,
    dp_cp_group: Optional[dist.ProcessGroup] = None,
    **kwargs,
) -> Union[ShardedTensor, ShardedTensorFactory]:
    """This TP rank's box along ``tp_axis`` (replica id (0, 0, dp_cp_rank)); a factory of S
    boxes when the parameter has ``partition_stride`` S > 1."""
    tp_size, tp_rank = get_pg_size(tp_group), get_pg_rank(tp_group)
    if replica_id is None:
        replica_id = (0, 0, get_pg_rank(dp_cp_group))
    stride = int(getattr(tensor, "partition_stride", 1) or 1)
    prepend = len(prepend_offsets)
    axis = tp_axis + prepend
    if stride == 1 or tp_size == 1:
        return ShardedTensor.from_rank_offsets(
            key,
            tensor,
            *prepend_offsets,
            (axis, tp_rank, tp_size),
            replica_id=replica_id,
            prepend_axis_num=prepend,
            **kwargs,
        )

    def build(key, data, replica_id, flattened_range):
        return {
            str(s): ShardedTensor.from_rank_offsets(
                key,
                block,
                *prepend_offsets,
                (axis, s * tp_size + tp_rank, tp_size * stride),
                replica_id=replica_id,
                prepend_axis_num=prepend,
                **kwargs,
            )
            for s, block in enumerate(torch.chunk(data, stride, dim=tp_axis))
        }

    def merge(loaded: Dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([loaded[str(s)] for s in range(stride)], dim=tp_axis)

    return ShardedTensorFactory(key, tensor, build, merge, replica_id)


def tensor_parallel_axis_map(state_dict: Dict[str, Any]) -> Dict[str, int]:
    """{name: partition_dim} for the entries that are TP-split parameters."""
    return {
        name: value.partition_dim
        for name, value in state_dict.items()
        if isinstance(value, torch.Tensor) and getattr(value, "tensor_model_parallel", False)
    }


def module_sharded_state_dict(
    module: torch.nn.Module,
    prefix: str = "",
    sharded_offsets: Offsets = (),
    metadata: Optional[dict] = None,
) -> ShardedStateDict:
    """The generic walk: the module's own parameters and buffers, then every child through
    ``sharded_state_dict_default`` (which uses a child's own ``sharded_state_dict``)."""
    own = module.state_dict(prefix="", keep_vars=True)
    own = {k: v for k, v in own.items() if "." not in k}  # direct members only
    out = make_sharded_tensors_for_checkpoint(
        own,
        prefix,
        tensor_parallel_axis_map(own),
        sharded_offsets,
        tp_group=_tp_group(metadata),
        dp_cp_group=_dp_cp_group(metadata),
    )
    for name, child in module.named_children():
        out.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata))
    return out


def apply_keys_map(
    sharded_state_dict: ShardedStateDict, prefix: str, keys_map: Dict[str, str]
) -> None:
    """Rename storage keys ``prefix + old`` to ``prefix + new`` (a layer spec's
    ``sharded_state_dict_keys_map``: the local spec stores norms under Transformer Engine's
    names, as megatron-core does)."""
    if keys_map:
        apply_prefix_mapping(
            sharded_state_dict, {f"{prefix}{k}": f"{prefix}{v}" for k, v in keys_map.items()}
        )


def ensure_metadata_has_dp_cp_group(metadata: Optional[dict]) -> dict:
    """``metadata`` with ``dp_cp_group`` set (MPU fallback when absent; None: one rank)."""
    metadata = dict(metadata or {})
    if metadata.get("dp_cp_group") is None:
        metadata["dp_cp_group"] = _dp_cp_group(None)
    return metadata


def _tp_group(metadata: Optional[dict]) -> Optional[dist.ProcessGroup]:
    """``metadata["tp_group"]``, else the MPU fallback (``resolve_group``)."""
    return resolve_group("tp", (metadata or {}).get("tp_group"))


def _dp_cp_group(metadata: Optional[dict]) -> Optional[dist.ProcessGroup]:
    """``metadata["dp_cp_group"]``, else the MPU fallback (``resolve_group``)."""
    return resolve_group("dp_cp", (metadata or {}).get("dp_cp_group"))


def offset_rows(context: Any, table: torch.Tensor, length: int) -> torch.Tensor:
    """Rows [offset, offset + ``length``) of ``table`` (a row per position of a cached
    forward's context, e.g. the RoPE angles), for any context with megatron-core's
    ``sequence_len_offset``: a slice, or the row gathered at the device offset after
    ``StaticInferenceContext.enable_static_decode`` (its ``static_offset``)."""
    static = getattr(context, "static_offset", None)
    if static is None:
        return table[context.sequence_len_offset : context.sequence_len_offset + length]
    check_one_token_per_forward(length)
    return table.index_select(0, static)


def check_one_token_per_forward(length: int) -> None:
    """A forward after ``StaticInferenceContext.enable_static_decode`` runs one token."""
    if length != 1:
        raise ValueError(
            f"StaticInferenceContext: {length} tokens in a forward after "
            "enable_static_decode; expected one token per forward"
        )
