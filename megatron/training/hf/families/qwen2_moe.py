"""Qwen2-MoE (``Qwen2MoeForCausalLM``, e.g. Qwen1.5-MoE-A2.7B): Qwen2's attention (q/k/v
biases, ``qkv_bias``) with MoE layers that have a gated shared expert.

MoE layer: routed experts (``num_experts``, ``moe_intermediate_size``, softmax routing,
``norm_topk_prob`` false by default: the top-k probabilities of the softmax over all
experts, our ``moe_router_pre_softmax`` true; true: renormalized, ours false) plus
sigmoid(x . s) times a shared expert of ``shared_expert_intermediate_size`` (our
``SharedExpertMLP`` with ``moe_shared_expert_gate``). Layer i is a MoE layer unless it is in
``mlp_only_layers`` or (i + 1) is not a multiple of ``decoder_sparse_step``: the other layers
have a dense MLP of ``intermediate_size`` (our ``moe_layer_freq`` as a 0/1 list). Sliding
windows are refused.
"""

from typing import Any, Dict, Optional

from megatron.training.hf.families.llama import LlamaShaped, layer_prefix
from megatron.training.hf.families.moe import (
    moe_mlp_sources,
    read_norm_topk_prob,
    read_routing,
    read_sparse_layers,
    replace_mlp,
)
from megatron.training.hf.families.qwen2 import refuse_sliding_windows
from megatron.training.hf.family import ConfigReader, HFArchitecture, Source


def read_experts(c: ConfigReader) -> int:
    """The routed experts per MoE layer: ``num_experts`` (transformers 5 also writes it as
    ``num_local_experts``; both present must agree). 0 means a dense model."""
    experts = c.optional("num_experts", None)
    alias = c.optional("num_local_experts", None)
    if experts is None:
        experts = alias
    c.require(
        alias is None or alias == experts,
        "num_local_experts",
        alias,
        f"the same as num_experts ({experts})",
    )
    c.require(
        isinstance(experts, int) and experts >= 0,
        "num_experts",
        experts,
        "a non-negative integer",
    )
    return experts


def read_qwen_moe(c: ConfigReader, shared: bool) -> Dict[str, Any]:
    """The MoE fields of a Qwen-MoE config (``shared``: the gated shared expert)."""
    experts = read_experts(c)
    pattern = read_sparse_layers(c) if experts else None
    norm = read_norm_topk_prob(c)
    if shared:
        size = c.positive_int("shared_expert_intermediate_size")
    if pattern is None:  # no MoE layer: the dense model the config describes
        c.seen("num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef")
        c.seen("output_router_logits")
        return {}
    out = dict(
        **read_routing(c, experts, norm_topk_prob=norm),
        moe_ffn_hidden_size=c.positive_int("moe_intermediate_size"),
        moe_layer_freq=pattern,
    )
    if shared:
        out.update(moe_shared_expert_intermediate_size=size, moe_shared_expert_gate=True)
    return out


def write_qwen_moe(arch: HFArchitecture) -> Dict[str, Any]:
    """The MoE keys of an exported Qwen-MoE ``config.json``."""
    pattern = arch.moe_layer_freq
    return dict(
        num_experts=arch.num_moe_experts,
        num_experts_per_tok=arch.moe_router_topk,
        moe_intermediate_size=arch.moe_ffn_hidden_size,
        norm_topk_prob=not arch.moe_router_pre_softmax,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, flag in enumerate(pattern) if not flag],
        use_sliding_window=False,
    )


def qwen_moe_layer_sources(
    arch: HFArchitecture, table: Dict[str, Source], layer: int, prefix: Optional[str]
) -> Dict[str, Source]:
    """``table`` (the dense layer's) with a MoE layer's MLP: ``mlp.gate`` is our router,
    ``mlp.experts.g.{gate,up,down}_proj`` expert g, ``mlp.shared_expert`` and
    ``mlp.shared_expert_gate`` the shared expert and its gate."""
    if arch.is_moe_layer(layer):
        mlp = layer_prefix(prefix, layer) + "mlp."
        sources = moe_mlp_sources(
            arch,
            layer,
            f"{mlp}gate.weight",
            mlp + "experts.{g}.",
            ("gate_proj", "up_proj", "down_proj"),
            shared=f"{mlp}shared_expert.",
            shared_gate=f"{mlp}shared_expert_gate.weight",
        )
        replace_mlp(table, layer, sources)
    return table


class QwenMoeLayers:
    """The layer weights of the Qwen MoE families: their attention family's, with the MLP's
    replaced by the experts' (``qwen_moe_layer_sources``). A mixin before that family."""

    def layer_sources(
        self, arch: HFArchitecture, layer: int, prefix: Optional[str]
    ) -> Dict[str, Source]:
        table = super().layer_sources(arch, layer, prefix)  # type: ignore[misc]
        return qwen_moe_layer_sources(arch, table, layer, prefix)


class Qwen2Moe(QwenMoeLayers, LlamaShaped):
    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    settings_hint = (
        "RMSNorm + swiglu + rope + --disable-bias-linear + --num-experts with softmax "
        "routing + --moe-shared-expert-intermediate-size N --moe-shared-expert-gate (Qwen2-MoE)"
    )

    def read_extra(self, c: ConfigReader) -> Dict[str, Any]:
        refuse_sliding_windows(c)
        qkv_bias = c.optional("qkv_bias", True)
        c.require(isinstance(qkv_bias, bool), "qkv_bias", qkv_bias, "true or false")
        return dict(add_qkv_bias=qkv_bias, **read_qwen_moe(c, shared=True))

    def write_extra(self, arch: HFArchitecture) -> Dict[str, Any]:
        return dict(
            write_qwen_moe(arch),
            qkv_bias=arch.add_qkv_bias,
            shared_expert_intermediate_size=arch.moe_shared_expert_intermediate_size,
        )


FAMILY = Qwen2Moe()
