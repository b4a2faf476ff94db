"""Layer specs of the GPT: which module builds each part of a transformer layer."""

from typing import List, Optional, Union

from megatron.core import config_rules, tensor_parallel
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
    ReplicatedLinear,
)
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec,
    get_mtp_num_layers_to_build,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)


def get_gpt_layer_local_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    use_kitchen: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
) -> ModuleSpec:
    """A pre-norm GPT layer from local (non-Transformer-Engine) modules:

    input_layernorm -> SelfAttention(linear_qkv: ColumnParallelLinear, core_attention:
    DotProductAttention, linear_proj: RowParallelLinear) -> bias-dropout-add ->
    pre_mlp_layernorm -> MLP(linear_fc1: ColumnParallelLinear, linear_fc2: RowParallelLinear)
    -> bias-dropout-add. The norms are ``WrappedTorchNorm`` (LayerNorm or RMSNorm per
    ``config.normalization``; ``normalization`` here only checks the name). With
    ``num_experts`` the MLP is a ``MoELayer`` (experts ``GroupedMLP`` with
    ``moe_grouped_gemm``, else ``SequentialMLP``; a ``SharedExpertMLP`` used when the config
    sets ``moe_shared_expert_intermediate_size``). ``qk_layernorm``: per-head q/k norms.
    ``multi_latent_attention``: ``MLASelfAttention`` (its q/kv norms with ``qk_layernorm``;
    needs an ``MLATransformerConfig``). qk L2 norm and kitchen are not implemented; ``fp8``
    (deprecated and unused in megatron-core) is refused: FP8 comes from
    ``TransformerConfig.fp8``.
    """
    if fp8:
        raise NotImplementedError(
            f"get_gpt_layer_local_spec: fp8={fp8!r} is deprecated and unused (megatron-core); "
            "set TransformerConfig.fp8 (docs/fp8.md); expected None"
        )
    unsupported = dict(
        qk_l2_norm=qk_l2_norm,
        use_kitchen=use_kitchen,
        use_kitchen_attention=use_kitchen_attention,
    )
    for name, value in unsupported.items():
        if value:
            raise NotImplementedError(
                f"get_gpt_layer_local_spec: {name}={value!r} is not supported"
            )
    if normalization not in (None, "LayerNorm", "RMSNorm"):
        raise ValueError(
            f"get_gpt_layer_local_spec: normalization must be None, 'LayerNorm' or 'RMSNorm', "
            f"got {normalization!r}"
        )
    qk_norm = WrappedTorchNorm if qk_layernorm else IdentityOp
    # megatron-core's local spec, one keyword per part (the same shape as other keyword calls).
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=(
                _mla_spec(qk_norm) if multi_latent_attention else _self_attention_spec(qk_norm)
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=_mlp_spec(num_experts, moe_grouped_gemm),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=_keys_map(multi_latent_attention),
        ),
    )


def _attention_spec(module: type, submodules: type, **projections: type) -> ModuleSpec:
    """A causal self-attention ``module`` whose ``submodules`` are its ``projections`` and
    norms, with the core attention and output projection every attention has."""
    return ModuleSpec(
        module=module,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=submodules(
            core_attention=DotProductAttention,
            linear_proj=tensor_parallel.RowParallelLinear,
            **projections,
        ),
    )


def _self_attention_spec(qk_norm: type) -> ModuleSpec:
    """Self-attention with the fused QKV projection."""
    return _attention_spec(
        SelfAttention,
        SelfAttentionSubmodules,
        linear_qkv=tensor_parallel.ColumnParallelLinear,
        q_layernorm=qk_norm,
        k_layernorm=qk_norm,
    )


def _mla_spec(qk_norm: type) -> ModuleSpec:
    """Multi-latent attention: replicated down projections, head-split up projections."""
    column = tensor_parallel.ColumnParallelLinear
    return _attention_spec(
        MLASelfAttention,
        MLASelfAttentionSubmodules,
        linear_q_proj=column,
        linear_q_down_proj=ReplicatedLinear,
        linear_q_up_proj=column,
        linear_kv_down_proj=ReplicatedLinear,
        linear_kv_up_proj=column,
        q_layernorm=qk_norm,
        kv_layernorm=qk_norm,
    )


def _mlp_spec(num_experts: Optional[int], moe_grouped_gemm: bool) -> ModuleSpec:
    """The dense MLP, or the MoE layer with its experts and shared expert."""
    dense = MLPSubmodules(
        linear_fc1=tensor_parallel.ColumnParallelLinear,
        linear_fc2=tensor_parallel.RowParallelLinear,
    )
    if num_experts is None:
        return ModuleSpec(module=MLP, submodules=dense)
    experts = (
        ModuleSpec(module=GroupedMLP)
        if moe_grouped_gemm
        else ModuleSpec(module=SequentialMLP, submodules=dense)
    )
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=experts, shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=dense)
        ),
    )


def _keys_map(multi_latent_attention: bool) -> dict:
    """Storage keys of the norms, megatron-core's local spec's: without multi-latent
    attention the input norm under linear_qkv and the pre-MLP norm under the MLP's fc1 (MoE
    layers too); MLA layers (dense or MoE) keep both under their own names."""
    if multi_latent_attention:
        return {}
    return {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    }


def get_gpt_decoder_layer_specs(
    config: TransformerConfig,
    use_transformer_engine: bool,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> List[ModuleSpec]:
    """One local layer spec per layer of the model: MoE where ``config.moe_layer_freq``
    says so (an int N: layers 0, N, 2N, ...; a list: 1 = MoE), dense elsewhere."""
    if use_transformer_engine:
        raise NotImplementedError(
            "get_gpt_decoder_layer_specs: use_transformer_engine=True is not supported "
            "(Transformer Engine is not available); pass False"
        )
    common = dict(
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        normalization=normalization,
        qk_l2_norm=qk_l2_norm,
        moe_use_legacy_grouped_gemm=config.moe_use_legacy_grouped_gemm,
    )
    dense = get_gpt_layer_local_spec(num_experts=None, **common)
    if config.num_moe_experts is None:
        return [dense] * config.num_layers
    moe = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm, **common
    )
    pattern = config_rules.moe_layer_pattern(config.moe_layer_freq, config.num_layers)
    if pattern is None:
        raise ValueError(
            f"moe_layer_freq={config.moe_layer_freq!r}: expected an int >= 1 or a list of "
            f"num_layers ({config.num_layers}) 0/1 entries"
        )
    return [moe if flag else dense for flag in pattern]


# megatron-core's public signature, the same parameters as get_gpt_decoder_layer_specs (whose
# slice of specs it returns).
def get_gpt_decoder_block_spec(
    config: TransformerConfig,
    use_transformer_engine: bool,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """The block spec of one model chunk (chunk ``vp_stage`` of pipeline rank ``pp_rank``;
    None: 0 / ``parallel_state``'s rank, the MPU fallback): its slice of
    ``get_gpt_decoder_layer_specs`` and the final norm."""
    specs = get_gpt_decoder_layer_specs(config, use_transformer_engine, normalization, qk_l2_norm)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=specs[offset : offset + count], layer_norm=WrappedTorchNorm
    )


def get_gpt_mtp_block_spec(
    config: TransformerConfig,
    spec: Union[TransformerBlockSubmodules, ModuleSpec],
    use_transformer_engine: bool,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> Optional[MultiTokenPredictionBlockSubmodules]:
    """The MTP block spec (megatron-core 0.16.1): ``config.mtp_num_layers`` depths around
    the decoder's last layer spec (``spec``: a block spec, or a layer spec), on the last
    pipeline stage (chunk ``vp_stage`` of ``pp_rank``; None: ``parallel_state``'s rank);
    None elsewhere and without MTP."""
    if get_mtp_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank) == 0:
        return None
    if isinstance(spec, TransformerBlockSubmodules):
        layer_spec = spec.layer_specs[-1]
    elif isinstance(spec, ModuleSpec) and spec.module is TransformerLayer:
        layer_spec = spec
    else:
        raise ValueError(
            f"get_gpt_mtp_block_spec: spec must be a TransformerBlockSubmodules or a "
            f"TransformerLayer ModuleSpec, got {type(spec).__name__}"
        )
    depth = get_mtp_layer_spec(layer_spec, use_transformer_engine)
    return MultiTokenPredictionBlockSubmodules(layer_specs=[depth] * config.mtp_num_layers)
