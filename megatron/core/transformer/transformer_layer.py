"""A transformer layer built from its spec (pre-norm: x + attn(norm(x)), then
x + mlp(norm(x))), and where a pipeline chunk's layers start in the global numbering."""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import BaseMoELayer
from megatron.core.transformer.parallel_groups import pp_rank_of, tp_group_of
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, get_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import refuse_unsupported_arguments


@dataclass
class TransformerLayerSubmodules:
    """Specs of a layer's parts (megatron-core's names; unused slots are identities)."""

    input_layernorm: Union[ModuleSpec, type] = IdentityOp
    self_attention: Union[ModuleSpec, type] = IdentityOp
    self_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    pre_cross_attn_layernorm: Union[ModuleSpec, type] = IdentityOp
    cross_attention: Union[ModuleSpec, type] = IdentityOp
    cross_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    pre_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp
    mlp: Union[ModuleSpec, type] = IdentityOp
    mlp_bda: Union[ModuleSpec, type] = IdentityFuncOp
    sharded_state_dict_keys_map: Dict[str, str] = field(default_factory=dict)


class TransformerLayer(MegatronModule):
    """One layer on [s, b, h]:

        h1 = bda(self_attention(input_layernorm(x)), x)
        out = bda(mlp(pre_mlp_layernorm(h1)), h1),  bda((y, b), r) = r + dropout(y + b)

    (with ``apply_residual_connection_post_layernorm`` the residual is the norm's output).
    With ``config.sandwich_layernorm`` (Gemma 2 / 3) the attention's and the MLP's outputs
    (their biases added) are normalized too before each residual add, by
    ``post_self_attn_layernorm`` and ``post_mlp_layernorm`` (built as ``input_layernorm``).
    Selective recomputation (``recompute_granularity="selective"``, training with autograd
    on): "layernorm" in ``recompute_modules`` discards each norm's output once the next
    module has used it and recomputes it in the backward
    (``tensor_parallel.CheckpointWithoutOutput``); "mlp" runs the MLP under
    ``tensor_parallel.checkpoint``; "core_attn" is the attention module's.
    ``layer_number`` is 1-based within the chunk; ``self.layer_number`` is global (the chunk's
    offset added, the pipeline rank from ``pg_collection.pp`` or the MPU fallback, or the
    explicit ``pp_rank``, an extra of this core for building several stages in one process).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        vp_stage: Optional[int] = None,
        *,
        pp_rank: Optional[int] = None,
    ) -> None:
        super().__init__(config)
        if submodules.cross_attention is not IdentityOp:
            raise NotImplementedError("TransformerLayer: cross_attention is not supported")
        self.submodules_config = submodules
        self.layer_number = layer_number + get_transformer_layer_offset(
            config, vp_stage, pp_rank if pp_rank is not None else pp_rank_of(pg_collection, config)
        )
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        norm = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.input_layernorm = build_module(submodules.input_layernorm, **norm)
        self.self_attention = build_module(
            submodules.self_attention,
            config=config,
            layer_number=self.layer_number,
            pg_collection=pg_collection,
        )
        self.self_attn_bda = build_module(submodules.self_attn_bda)
        self.pre_cross_attn_layernorm = build_module(submodules.pre_cross_attn_layernorm, **norm)
        self.cross_attention = build_module(submodules.cross_attention, config=config)
        self.cross_attn_bda = build_module(submodules.cross_attn_bda)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm)
        if config.sandwich_layernorm:
            self.post_self_attn_layernorm = build_module(submodules.input_layernorm, **norm)
            self.post_mlp_layernorm = build_module(submodules.input_layernorm, **norm)
        self.is_moe_layer = _is_moe_spec(submodules.mlp)
        if self.is_moe_layer:
            self.mlp = build_module(
                submodules.mlp,
                config=config,
                layer_number=self.layer_number,
                pg_collection=pg_collection,
            )
        else:
            self.mlp = build_module(
                submodules.mlp, config=config, tp_group=tp_group_of(pg_collection, config)
            )
        self.mlp_bda = build_module(submodules.mlp_bda)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
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
    ):
        """Returns (hidden_states, context), as megatron-core's layer does. ``context`` and
        ``context_mask`` (cross-attention) are refused unless None; ``inference_params`` is
        the deprecated name of ``inference_context``; ``dynamic_inference_decode_only``
        (megatron-core's CUDA-graph key) changes nothing, as there; ``padding_mask`` is read
        by a MoE MLP only."""
        refuse_unsupported_arguments("TransformerLayer", context=context, context_mask=context_mask)
        if inference_context is None:
            inference_context = inference_params
        fused = self.config.bias_dropout_fusion
        recompute = self._recompute_modules()
        normed, norm_ckpt = self._norm(self.input_layernorm, hidden_states, recompute)
        residual = normed if self.config.apply_residual_connection_post_layernorm else hidden_states
        attention = self.self_attention(
            normed,
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        if norm_ckpt is not None:
            norm_ckpt.discard_output_and_register_recompute(attention[0])
        if self.config.sandwich_layernorm:
            attention = _post_norm(self.post_self_attn_layernorm, attention)
        hidden_states = self.self_attn_bda(self.training, fused)(
            attention, residual, self.hidden_dropout
        )
        normed, norm_ckpt = self._norm(self.pre_mlp_layernorm, hidden_states, recompute)
        residual = normed if self.config.apply_residual_connection_post_layernorm else hidden_states
        if self.is_moe_layer:
            mlp_output = self.mlp(normed, padding_mask=padding_mask)
        elif "mlp" in recompute:
            mlp_output = tensor_parallel.checkpoint(self.mlp, False, normed)
        else:
            mlp_output = self.mlp(normed)
        if norm_ckpt is not None:
            norm_ckpt.discard_output_and_register_recompute(mlp_output[0])
        if self.config.sandwich_layernorm:
            mlp_output = _post_norm(self.post_mlp_layernorm, mlp_output)
        hidden_states = self.mlp_bda(self.training, fused)(
            mlp_output, residual, self.hidden_dropout
        )
        return hidden_states, context

    def _recompute_modules(self) -> tuple:
        """The ``recompute_modules`` in force for this forward (none outside training or
        without autograd)."""
        if self.config.recompute_granularity != "selective" or not self.training:
            return ()
        if not torch.is_grad_enabled():
            return ()
        return tuple(self.config.recompute_modules)

    @staticmethod
    def _norm(norm: torch.nn.Module, hidden_states: torch.Tensor, recompute: tuple):
        """``norm(hidden_states)``, and its ``CheckpointWithoutOutput`` under "layernorm"
        recomputation (None otherwise, and for identity norms)."""
        if "layernorm" not in recompute or isinstance(norm, (IdentityOp, IdentityFuncOp)):
            return norm(hidden_states), None
        ckpt = tensor_parallel.CheckpointWithoutOutput()
        return ckpt.checkpoint(norm, hidden_states), ckpt

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> Dict[str, Any]:
        """The layer's pieces (``sharded_offsets`` carry the global layer index), with the
        spec's ``sharded_state_dict_keys_map`` applied to the storage keys."""
        from megatron.core.transformer.utils import apply_keys_map, module_sharded_state_dict

        sharded = module_sharded_state_dict(self, prefix, sharded_offsets, metadata)
        apply_keys_map(sharded, prefix, self.submodules_config.sharded_state_dict_keys_map)
        return sharded


def get_transformer_layer_offset(
    config: TransformerConfig, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> int:
    """Global index of the first layer of chunk ``vp_stage`` on pipeline rank ``pp_rank``.

    offset = (vp_stage * PP + pp_rank) * L / (PP * V). ``vp_stage=None`` means 0;
    ``pp_rank=None`` is the MPU fallback (``parallel_state``'s rank, or 0 uninitialized).
    """
    pipeline_size = config.pipeline_model_parallel_size
    virtual_size = config.virtual_pipeline_model_parallel_size or 1
    vp_stage = 0 if vp_stage is None else vp_stage
    if pp_rank is None:
        pp_rank = pp_rank_of(None, config)
    if not 0 <= vp_stage < virtual_size:
        raise ValueError(
            f"vp_stage must be in [0, {virtual_size}) for virtual_pipeline_model_parallel_size="
            f"{config.virtual_pipeline_model_parallel_size}, got {vp_stage!r}"
        )
    if not 0 <= pp_rank < pipeline_size:
        raise ValueError(
            f"pp_rank must be in [0, {pipeline_size}) for pipeline_model_parallel_size="
            f"{pipeline_size}, got {pp_rank!r}"
        )
    return (vp_stage * pipeline_size + pp_rank) * layers_per_virtual_stage(config)


def layers_per_virtual_stage(config: TransformerConfig) -> int:
    """L / (PP * V), with a clear error when the layers do not split evenly."""
    stages = config.pipeline_model_parallel_size * (
        config.virtual_pipeline_model_parallel_size or 1
    )
    if config.num_layers < 1 or config.num_layers % stages != 0:
        raise ValueError(
            f"num_layers ({config.num_layers}) must be a positive multiple of "
            f"pipeline_model_parallel_size ({config.pipeline_model_parallel_size}) x "
            f"virtual_pipeline_model_parallel_size "
            f"({config.virtual_pipeline_model_parallel_size or 1}) = {stages}"
        )
    return config.num_layers // stages


def _post_norm(norm: torch.nn.Module, output: tuple) -> tuple:
    """A sublayer's (output, bias) normalized (the bias added first): (norm(y + b), None)."""
    out, bias = output[0], output[1]
    if bias is not None:
        out = out + bias
    return norm(out), None


def _is_moe_spec(spec) -> bool:
    """Whether an MLP spec builds a mixture-of-experts layer (it then takes
    ``pg_collection`` and ``layer_number``, and the padding mask in its forward)."""
    try:
        module = get_module(spec)
    except (AttributeError, ImportError):
        return False
    return isinstance(module, type) and issubclass(module, BaseMoELayer)
