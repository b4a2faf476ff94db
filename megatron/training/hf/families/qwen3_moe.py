"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B): Qwen3's attention (per-head q/k
RMSNorm, our ``qk_layernorm``) with MoE layers without a shared expert.

Routing as Qwen2-MoE (``norm_topk_prob``: true renormalizes the top-k probabilities, our
``moe_router_pre_softmax`` false; false keeps them, ours true); ``decoder_sparse_step`` and
``mlp_only_layers`` choose the MoE layers (our ``moe_layer_freq`` list), the others have a
dense MLP of ``intermediate_size``.
"""

from typing import Any, Dict

from megatron.training.hf.families.qwen2_moe import (
    QwenMoeLayers,
    read_qwen_moe,
    write_qwen_moe,
)
from megatron.training.hf.families.qwen3 import Qwen3
from megatron.training.hf.family import ConfigReader, HFArchitecture


class Qwen3Moe(QwenMoeLayers, Qwen3):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    settings_hint = (
        "RMSNorm + swiglu + rope + --disable-bias-linear + --qk-layernorm + --num-experts "
        "with softmax routing, no shared expert (Qwen3-MoE)"
    )

    def read_extra(self, c: ConfigReader) -> Dict[str, Any]:
        return dict(super().read_extra(c), **read_qwen_moe(c, shared=False))

    def write_extra(self, arch: HFArchitecture) -> Dict[str, Any]:
        return dict(super().write_extra(arch), **write_qwen_moe(arch))


FAMILY = Qwen3Moe()
