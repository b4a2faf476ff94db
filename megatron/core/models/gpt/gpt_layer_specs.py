"""Layer specs of the GPT: which module builds each part of a transformer layer."""

from typing import Optional

from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
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
    ``config.normalization``; ``normalization`` here only checks the name). Mixture of
    experts, multi-latent attention, fp8, qk L2 norm and kitchen are not implemented.
    """
    unsupported = dict(
        num_experts=num_experts,
        multi_latent_attention=multi_latent_attention,
        fp8=fp8,
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
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=tensor_parallel.ColumnParallelLinear,
                    core_attention=DotProductAttention,
                    linear_proj=tensor_parallel.RowParallelLinear,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=tensor_parallel.ColumnParallelLinear,
                    linear_fc2=tensor_parallel.RowParallelLinear,
                ),
            ),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )
