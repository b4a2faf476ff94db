"""OLMoE (``OlmoeForCausalLM``, e.g. allenai/OLMoE-1B-7B-0924): Llama-shaped attention whose
q/k norms are RMSNorms over the whole q and k projections, every layer a MoE layer without a
shared expert.

Attention: q = q_norm(q_proj x), k = k_norm(k_proj x), each an RMSNorm over all heads of its
projection together (weights [num_attention_heads * head_dim] and [num_key_value_heads *
head_dim], eps = ``rms_norm_eps``), then the rotary embedding: our ``qk_layernorm`` with
``qk_layernorm_whole_projection`` (``WholeProjectionRMSNorm``, exact at any TP). transformers
sizes q_norm by ``hidden_size``, so head_dim must be hidden_size / num_attention_heads.
Routing as Qwen-MoE (``norm_topk_prob`` false, the default: the top-k probabilities of the
softmax over all experts, our ``moe_router_pre_softmax`` true; true: renormalized, ours
false); ``intermediate_size`` is each expert's FFN size. Weights: the Qwen-MoE keys
(``mlp.gate``, ``mlp.experts.g.{gate,up,down}_proj``) and ``self_attn.q_norm`` /
``k_norm``. Refused: ``clip_qkv`` (a clamp of q, k and v our attention does not have) and
``attention_bias``.
"""

from typing import Any, Dict, Optional

from megatron.training.hf.families.llama import LlamaShaped, require_implied_head_dim
from megatron.training.hf.families.moe import (
    read_norm_topk_prob,
    read_routing,
)
from megatron.training.hf.families.qwen2_moe import qwen_moe_layer_sources, read_experts
from megatron.training.hf.families.qwen3 import qk_norm_sources, refuse_attention_bias
from megatron.training.hf.family import ConfigReader, HFArchitecture, Source


class Olmoe(LlamaShaped):
    model_type = "olmoe"
    architecture = "OlmoeForCausalLM"
    settings_hint = (
        "RMSNorm + swiglu + rope + --disable-bias-linear + --qk-layernorm "
        "--qk-layernorm-whole-projection + --num-experts with softmax routing in every "
        "layer, no shared expert (OLMoE)"
    )

    def read_extra(self, c: ConfigReader) -> Dict[str, Any]:
        refuse_attention_bias(c)
        c.expect(
            "clip_qkv",
            None,
            "null (clamping q, k and v to [-clip_qkv, clip_qkv] is not supported)",
            default=None,
        )
        hidden, heads = c.positive_int("hidden_size"), c.positive_int("num_attention_heads")
        require_implied_head_dim(
            c, hidden, heads, "transformers sizes OLMoE's q_norm by hidden_size"
        )
        experts = read_experts(c)
        c.require(experts >= 1, "num_experts", experts, "at least 1 (OLMoE is a MoE model)")
        return dict(
            qk_layernorm=True,
            qk_layernorm_whole_projection=True,
            **read_routing(c, experts, norm_topk_prob=read_norm_topk_prob(c)),
            moe_ffn_hidden_size=c.positive_int("intermediate_size"),
            moe_layer_freq=(1,) * c.positive_int("num_hidden_layers"),
        )

    def write_extra(self, arch: HFArchitecture) -> Dict[str, Any]:
        return dict(
            intermediate_size=arch.moe_ffn_hidden_size,
            num_experts=arch.num_moe_experts,
            num_experts_per_tok=arch.moe_router_topk,
            norm_topk_prob=not arch.moe_router_pre_softmax,
            attention_bias=False,
            clip_qkv=None,
        )

    def layer_sources(
        self, arch: HFArchitecture, layer: int, prefix: Optional[str]
    ) -> Dict[str, Source]:
        table = super().layer_sources(arch, layer, prefix)
        table.update(qk_norm_sources(arch, layer, prefix))
        return qwen_moe_layer_sources(arch, table, layer, prefix)


FAMILY = Olmoe()
