"""The stack of transformer layers one pipeline chunk owns, plus the final norm on the last
stage, built from a layer spec."""

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    layers_per_virtual_stage,
)
from megatron.core.transformer.utils import refuse_unsupported_arguments


@dataclass
class TransformerBlockSubmodules:
    """One spec per layer of the chunk, and the final norm's spec."""

    layer_specs: List[ModuleSpec] = None
    layer_norm: Optional[Union[ModuleSpec, torch.nn.Module]] = None


def build_layers(
    specs: List[ModuleSpec],
    config: TransformerConfig,
    pg_collection: Optional[ProcessGroupCollection],
    vp_stage: Optional[int],
    pp_rank: Optional[int],
) -> torch.nn.ModuleList:
    """One module per spec, ``layer_number`` 1, 2, ... (``pp_rank`` handed on when given)."""
    extra = {} if pp_rank is None else {"pp_rank": pp_rank}
    return torch.nn.ModuleList(
        build_module(
            spec,
            config=config,
            layer_number=i + 1,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
            **extra,
        )
        for i, spec in enumerate(specs)
    )


def full_recompute_spans(
    config: TransformerConfig, training: bool, count: int
) -> List[Tuple[int, int, bool]]:
    """Layers [0, count) as runs (start, end, checkpointed) under ``recompute_granularity=
    "full"`` in training with autograd on ("uniform": groups of ``recompute_num_layers``, one
    checkpoint each; "block": the first ``recompute_num_layers`` one checkpoint each, the rest
    one run); otherwise one run, not checkpointed. Used by ``TransformerBlock`` and by each
    MTP depth (one layer)."""
    full = config.recompute_granularity == "full" and training and torch.is_grad_enabled()
    if not full or count == 0:
        return [(0, count, False)]
    step = config.recompute_num_layers
    if config.recompute_method == "uniform":
        return [(start, min(start + step, count), True) for start in range(0, count, step)]
    spans = [(index, index + 1, True) for index in range(min(step, count))]
    return spans + ([(step, count, False)] if step < count else [])


class TransformerBlock(MegatronModule):
    """Layers [offset, offset + L / (PP * V)) of the model on [s, b, h]; ``final_layernorm``
    when ``post_process and post_layer_norm``. ``spec`` is a layer spec (repeated for every
    layer, final norm ``WrappedTorchNorm``), a block spec, or ``TransformerBlockSubmodules``.

    With ``pre_process=False`` the input is the tensor given to ``set_input_tensor``.
    ``pp_rank`` (an extra) is handed to the layers, overriding ``pg_collection.pp``.

    ``recompute_granularity="full"`` (training with autograd on): the layers run under
    ``tensor_parallel.checkpoint`` in the runs of ``full_recompute_spans`` -- "uniform":
    groups of ``recompute_num_layers`` layers, one checkpoint each; "block": the first
    ``recompute_num_layers`` layers of this chunk, one checkpoint per layer, the rest as
    usual. Only each checkpoint's input is kept; the backward reruns it with the forward's
    RNG states (same dropout masks).
    """

    def __init__(
        self,
        config: TransformerConfig,
        spec: Union[TransformerBlockSubmodules, ModuleSpec],
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection: Optional[ProcessGroupCollection] = None,
        vp_stage: Optional[int] = None,
        *,
        pp_rank: Optional[int] = None,
    ) -> None:
        super().__init__(config)
        submodules = _block_submodules(config, spec, vp_stage)
        self.pre_process = pre_process
        self.post_process = post_process
        self.post_layer_norm = post_layer_norm
        self.vp_stage = vp_stage
        self.input_tensor: Optional[torch.Tensor] = None
        self.layers = build_layers(submodules.layer_specs, config, pg_collection, vp_stage, pp_rank)
        self.final_layernorm = None
        if post_process and post_layer_norm:
            self.final_layernorm = build_module(
                submodules.layer_norm,
                config=config,
                hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
            )

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        """The previous stage's hidden states, used as input when ``pre_process=False``."""
        self.input_tensor = input_tensor

    # megatron-core's signature: TransformerLayer.forward's arguments, passed on to every
    # layer (``layer_kwargs``), so the two parameter lists repeat by design.
    def forward(
        self,
        hidden_states: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        context: Optional[torch.Tensor] = None,
        context_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        rotary_pos_cos: Optional[torch.Tensor] = None,
        rotary_pos_sin: Optional[torch.Tensor] = None,
        rotary_pos_cos_sin: Optional[torch.Tensor] = None,
        attention_bias: Optional[torch.Tensor] = None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset: Optional[torch.Tensor] = None,
        padding_mask: Optional[torch.Tensor] = None,
        *,
        inference_params=None,
        dynamic_inference_decode_only: Optional[bool] = None,
    ) -> torch.Tensor:
        """Run the layers (then the final norm) on [s, b, h] (s sharded over CP, and over TP
        under sequence parallelism). ``context`` and ``context_mask`` (cross-attention) are
        refused unless None; ``inference_params`` is the deprecated name of
        ``inference_context``; ``dynamic_inference_decode_only`` (megatron-core's CUDA-graph
        key) changes nothing, as there."""
        refuse_unsupported_arguments("TransformerBlock", context=context, context_mask=context_mask)
        if inference_context is None:
            inference_context = inference_params
        if not self.pre_process:
            hidden_states = self.input_tensor
        dropout_active = self.training and any(
            getattr(layer, "hidden_dropout", 0) > 0 for layer in self.layers
        )
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if self.config.sequence_parallel and dropout_active
            else contextlib.nullcontext()
        )
        layer_kwargs = dict(
            attention_mask=attention_mask,
            context_mask=context_mask,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
            padding_mask=padding_mask,
        )
        spans = full_recompute_spans(self.config, self.training, len(self.layers))
        with rng:
            for start, end, checkpointed in spans:
                run = self._layers_run(start, end, context, layer_kwargs)
                if checkpointed:
                    hidden_states = tensor_parallel.checkpoint(run, False, hidden_states)
                else:
                    hidden_states = run(hidden_states)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states

    def _layers_run(
        self, start: int, end: int, context: Optional[torch.Tensor], layer_kwargs: dict
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function running layers [start, end) on the hidden states (one checkpoint's
        body under full recomputation)."""

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            ctx = context
            for layer in self.layers[start:end]:
                hidden, ctx = layer(hidden, context=ctx, **layer_kwargs)
            return hidden

        return forward

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> Dict[str, Any]:
        """Layers stacked along a prepended axis of the GLOBAL layer index (storage keys
        ``{prefix}layers.<name>``, offset ``layer_number - 1`` of ``num_layers``), so a layer's
        key and position do not depend on PP or VPP; then the final norm.

        Non-homogeneous layers (megatron-core's rule: ``moe_layer_freq`` a list, or an int
        > 1, or ``metadata["non_homogeneous_layers"]``) are not stacked: each layer's
        tensors are stored under ``{prefix}layers.<global index>.<name>``, since dense and
        MoE layers hold different tensors."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import sharded_state_dict_default

        sharded: Dict[str, Any] = {}
        layers_prefix = f"{prefix}layers."
        separate = non_homogeneous_layers(self.config, metadata)
        for local_index, layer in enumerate(self.layers):
            layer_prefix = f"{layers_prefix}{local_index}."
            if separate:
                offsets = tuple(sharded_offsets)
                storage_prefix = f"{layers_prefix}{layer.layer_number - 1}."
            else:
                offsets = tuple(sharded_offsets) + (
                    (len(sharded_offsets), layer.layer_number - 1, self.config.num_layers),
                )
                storage_prefix = layers_prefix
            layer_sharded = layer.sharded_state_dict(layer_prefix, offsets, metadata)
            replace_prefix_for_sharding(layer_sharded, layer_prefix, storage_prefix)
            sharded.update(layer_sharded)
        for name, child in self.named_children():
            if name != "layers":
                sharded.update(
                    sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata)
                )
        return sharded


def non_homogeneous_layers(config: TransformerConfig, metadata: Optional[dict] = None) -> bool:
    """Whether the block's layers are stored one by one rather than stacked (megatron-core's
    rule): ``metadata["non_homogeneous_layers"]``, or ``moe_layer_freq`` a list or an
    int > 1."""
    if metadata is not None and metadata.get("non_homogeneous_layers", False):
        return True
    freq = config.moe_layer_freq
    return isinstance(freq, (list, tuple)) or freq > 1


def get_num_layers_to_build(
    config: TransformerConfig, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> int:
    """Layers per model chunk: L / (PP * V), the same for every chunk.

    ``vp_stage`` and ``pp_rank`` are accepted for megatron-core compatibility.
    """
    return layers_per_virtual_stage(config)


def _block_submodules(
    config: TransformerConfig,
    spec: Union[TransformerBlockSubmodules, ModuleSpec],
    vp_stage: Optional[int],
) -> TransformerBlockSubmodules:
    """A block spec from a layer spec (repeated), a block spec, or block submodules."""
    if isinstance(spec, TransformerBlockSubmodules):
        return spec
    if isinstance(spec, ModuleSpec) and isinstance(spec.module, type):
        if issubclass(spec.module, TransformerBlock):
            return spec.submodules
        if issubclass(spec.module, TransformerLayer):
            count = get_num_layers_to_build(config, vp_stage=vp_stage)
            return TransformerBlockSubmodules(
                layer_specs=[spec] * count, layer_norm=WrappedTorchNorm
            )
    raise TypeError(
        "TransformerBlock: spec must be a TransformerLayer or TransformerBlock ModuleSpec or "
        f"TransformerBlockSubmodules, got {spec!r}"
    )
