"""Qwen3 dense (``Qwen3ForCausalLM``): Llama-shaped with per-head q/k RMSNorm.

After the q/k/v projections each query and key head (``head_dim`` values) is RMS-normalized
with its own ``[head_dim]`` weight shared by all heads: y = x / sqrt(mean(x^2) + eps) * w,
eps = ``rms_norm_eps``, before the rotary embedding. That is our ``qk_layernorm``
(``self_attention.q_layernorm`` / ``k_layernorm``, built by
``get_gpt_layer_local_spec(qk_layernorm=True)``). Biases on q/k/v/o only (``attention_bias``)
are not expressible with a norm-free MLP and are refused; sliding windows are refused.
"""

from typing import Any, Dict, Optional

from megatron.training.hf.families.llama import LlamaShaped, layer_prefix
from megatron.training.hf.families.qwen2 import refuse_sliding_windows
from megatron.training.hf.family import ConfigReader, HFArchitecture, Segment, Source


class Qwen3(LlamaShaped):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    settings_hint = "RMSNorm + swiglu + rope + --qk-layernorm --disable-bias-linear (Qwen3)"

    def read_extra(self, c: ConfigReader) -> Dict[str, Any]:
        refuse_attention_bias(c)
        refuse_sliding_windows(c)
        return {"qk_layernorm": True}

    def write_extra(self, arch: HFArchitecture) -> Dict[str, Any]:
        return {"attention_bias": False, "use_sliding_window": False}

    def layer_sources(
        self, arch: HFArchitecture, layer: int, prefix: Optional[str]
    ) -> Dict[str, Source]:
        return {
            **super().layer_sources(arch, layer, prefix),
            **qk_norm_sources(arch, layer, prefix),
        }


FAMILY = Qwen3()


def qk_norm_sources(arch: HFArchitecture, layer: int, prefix: Optional[str]) -> Dict[str, Source]:
    """``self_attn.q_norm`` / ``k_norm`` as our ``q_layernorm`` / ``k_layernorm`` weights:
    [head_dim] each (per head, Qwen3), or [heads * head_dim] and [groups * head_dim] with
    ``qk_layernorm_whole_projection`` (OLMoE)."""
    attn = layer_prefix(prefix, layer) + "self_attn."
    ours = f"decoder.layers.{layer}.self_attention."
    q, k = arch.qk_norm_sizes()
    return {
        ours + "q_layernorm.weight": (Segment(f"{attn}q_norm.weight", 0, q),),
        ours + "k_layernorm.weight": (Segment(f"{attn}k_norm.weight", 0, k),),
    }


def refuse_attention_bias(c: ConfigReader) -> None:
    """``attention_bias`` must be false: biases on q/k/v/o without MLP biases (Qwen3, OLMoE)
    are not expressible (our biases are on every linear layer, on none, or on q/k/v only)."""
    c.expect(
        "attention_bias",
        False,
        "false (biases on q/k/v/o without MLP biases are not supported)",
        default=False,
    )
