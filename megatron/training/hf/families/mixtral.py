"""Mixtral (``MixtralForCausalLM``): Mistral's attention (optional sliding window) with a MoE
block in every layer.

Routing: softmax over the ``num_local_experts`` router logits, the top
``num_experts_per_tok``, their probabilities renormalized to sum 1: a softmax over the
selected logits, our ``moe_router_pre_softmax`` false. ``intermediate_size`` is each
expert's FFN size. Weights: ``block_sparse_moe.gate`` is our router; expert g's ``w1``
(gate), ``w3`` (up) make its ``linear_fc1`` [w1; w3], ``w2`` (down) its ``linear_fc2``.
``router_jitter_noise`` (a training-time random input scaling) is refused unless 0.
"""

from typing import Any, Dict, Optional

from megatron.training.hf.families.llama import layer_prefix
from megatron.training.hf.families.mistral import Mistral
from megatron.training.hf.families.moe import (
    moe_mlp_sources,
    read_routing,
    replace_mlp,
)
from megatron.training.hf.family import ConfigReader, HFArchitecture, Source


class Mixtral(Mistral):
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    settings_hint = (
        "RMSNorm + swiglu + rope + --disable-bias-linear + --num-experts with softmax "
        "routing, every layer MoE, no shared expert (Mixtral)"
    )

    def read_extra(self, c: ConfigReader) -> Dict[str, Any]:
        extra = super().read_extra(c)
        experts = c.positive_int("num_local_experts")
        c.expect(
            "router_jitter_noise",
            0.0,
            "0 (multiplicative jitter on the router input makes training depend on per-rank "
            "random numbers; megatron's moe_input_jitter_eps is refused for the same reason)",
            default=0.0,
        )
        layers = c.positive_int("num_hidden_layers")
        return dict(
            extra,
            **read_routing(c, experts, norm_topk_prob=True),
            moe_ffn_hidden_size=c.positive_int("intermediate_size"),
            moe_layer_freq=(1,) * layers,
        )

    def write_extra(self, arch: HFArchitecture) -> Dict[str, Any]:
        return dict(
            super().write_extra(arch),
            intermediate_size=arch.moe_ffn_hidden_size,
            num_local_experts=arch.num_moe_experts,
            num_experts_per_tok=arch.moe_router_topk,
            router_jitter_noise=0.0,
        )

    def layer_sources(
        self, arch: HFArchitecture, layer: int, prefix: Optional[str]
    ) -> Dict[str, Source]:
        table = super().layer_sources(arch, layer, prefix)
        moe = layer_prefix(prefix, layer) + "block_sparse_moe."
        replace_mlp(
            table,
            layer,
            moe_mlp_sources(
                arch, layer, f"{moe}gate.weight", moe + "experts.{g}.", ("w1", "w3", "w2")
            ),
        )
        return table


FAMILY = Mixtral()
