"""Phi-3 and Phi-4 (``Phi3ForCausalLM``, model_type ``phi3``): Llama-shaped with HuggingFace's
fused projections, an optional sliding window and partial rotary embeddings.

Weights: ``self_attn.qkv_proj`` rows are [q (every head); k (every group); v (every group)],
cut per query group into our ``linear_qkv`` [q heads of g, k_g, v_g]; ``mlp.gate_up_proj``
rows are [gate; up], as our ``linear_fc1``. ``sliding_window`` W: a query sees itself and
the W - 1 keys before it (transformers' mask), our ``window_size`` (W - 1, 0).
``partial_rotary_factor`` f -> ``rotary_percent`` (the first int(head_dim * f) channels of
each head rotate). LongRoPE (``rope_scaling`` type ``longrope`` / ``su`` / ``yarn``: the 128k
models, Phi-3.5, Phi-4-mini) is refused by name.
"""

from typing import Any, Dict, Optional, Tuple

from megatron.training.hf.families.llama import (
    LlamaShaped,
    layer_prefix,
    read_rope,
    require_implied_head_dim,
)
from megatron.training.hf.families.mistral import read_sliding_window, write_sliding_window
from megatron.training.hf.family import ConfigReader, HFArchitecture, Segment, Source

LONG_ROPE = ("longrope", "su", "yarn")  # transformers reads "su" and "yarn" as "longrope"


class Phi3(LlamaShaped):
    model_type = "phi3"
    architecture = "Phi3ForCausalLM"
    settings_hint = "as Llama or Mistral with --rotary-percent < 1 (Phi-3)"

    def read(self, c: ConfigReader) -> HFArchitecture:
        arch = super().read(c)
        rotary = int(arch.kv_channels * arch.rotary_percent)
        c.require(
            rotary >= 2 and rotary % 2 == 0,
            "partial_rotary_factor",
            arch.rotary_percent,
            f"a fraction of the head size ({arch.kv_channels}) giving an even number >= 2 of "
            f"rotated channels (got int({arch.kv_channels} x {arch.rotary_percent}) = {rotary})",
        )
        return arch

    def read_rotary(self, c: ConfigReader) -> Tuple[float, Optional[float], float]:
        params = c.optional("rope_parameters", None)
        inner = params.get("partial_rotary_factor") if isinstance(params, dict) else None
        top = c.optional("partial_rotary_factor", None)
        c.require(
            top is None or inner is None or top == inner,
            "partial_rotary_factor",
            top,
            f"the same as rope_parameters.partial_rotary_factor ({inner})",
        )
        factor = top if top is not None else (1.0 if inner is None else inner)
        c.require(
            isinstance(factor, (int, float)) and 0 < factor <= 1,
            "partial_rotary_factor",
            factor,
            "a number in (0, 1]",
        )
        for key, value in (
            ("rope_scaling", c.optional("rope_scaling", None)),
            ("rope_parameters", params),
        ):
            kind = value.get("rope_type", value.get("type")) if isinstance(value, dict) else None
            c.require(
                kind not in LONG_ROPE,
                f"{key}.rope_type",
                kind,
                "default or null: LongRoPE (short and long factors chosen by the sequence "
                "length: Phi-3-*-128k, Phi-3.5, Phi-4-mini) is not supported; the models "
                "without it (Phi-3-mini-4k, Phi-3-medium-4k, Phi-4) are",
            )
            c.require(
                kind in (None, "default"),
                f"{key}.rope_type",
                kind,
                "default or null (transformers' Phi-3 knows default and longrope only)",
            )
        raw = dict(c.raw)
        if isinstance(params, dict):
            raw["rope_parameters"] = {
                k: v for k, v in params.items() if k != "partial_rotary_factor"
            }
        theta, _ = read_rope(ConfigReader(raw, c.where, c.family))  # no scaling: checked above
        c.seen("rope_theta")
        return theta, None, float(factor)

    def read_extra(self, c: ConfigReader) -> Dict[str, Any]:
        c.expect("attention_bias", False, "false (transformers' Phi-3 has no biases)", False)
        auto_map = c.optional("auto_map", {})  # the hub's remote code: Phi3* classes
        c.require(
            isinstance(auto_map, dict)
            and all(str(v).rsplit(".", 1)[-1].startswith("Phi3") for v in auto_map.values()),
            "auto_map",
            auto_map,
            "Phi3* classes only (transformers' own Phi-3 computes them; other remote code "
            "is another model)",
        )
        hidden, heads = c.raw.get("hidden_size"), c.raw.get("num_attention_heads")
        require_implied_head_dim(
            c, hidden, heads, "transformers' Phi-3 sizes its rotary factors by the latter"
        )
        original = c.optional("original_max_position_embeddings", None)
        c.require(
            original is None or (isinstance(original, int) and original >= 1),
            "original_max_position_embeddings",
            original,
            "a positive integer (used by LongRoPE only)",
        )
        return read_sliding_window(c)

    def write_extra(self, arch: HFArchitecture) -> Dict[str, Any]:
        return {
            **write_sliding_window(arch),
            "partial_rotary_factor": arch.rotary_percent,
            "original_max_position_embeddings": arch.max_position_embeddings,
            # transformers' default 32000 would be an embedding row with no gradient (and
            # outside a smaller vocabulary); our models train every row
            "pad_token_id": None,
        }

    def layer_sources(
        self, arch: HFArchitecture, layer: int, prefix: Optional[str]
    ) -> Dict[str, Source]:
        table = super().layer_sources(arch, layer, prefix)
        p = f"decoder.layers.{layer}."
        attn = layer_prefix(prefix, layer) + "self_attn."
        mlp = layer_prefix(prefix, layer) + "mlp."
        ffn = arch.ffn_hidden_size
        table[f"{p}self_attention.linear_qkv.weight"] = fused_qkv(arch, f"{attn}qkv_proj.weight")
        table[f"{p}mlp.linear_fc1.weight"] = (
            Segment(f"{mlp}gate_up_proj.weight", 0, ffn),
            Segment(f"{mlp}gate_up_proj.weight", ffn, 2 * ffn),
        )
        return table


FAMILY = Phi3()


def fused_qkv(arch: HFArchitecture, key: str) -> Source:
    """Our ``linear_qkv`` rows from HuggingFace's fused [q; k; v] rows: per query group g,
    its query heads, its key head, its value head."""
    d, groups, heads = arch.kv_channels, arch.num_query_groups, arch.num_attention_heads
    per_group, k0, v0 = heads // groups, heads * d, (heads + groups) * d
    out = []
    for g in range(groups):
        out.append(Segment(key, g * per_group * d, (g + 1) * per_group * d))
        out.append(Segment(key, k0 + g * d, k0 + (g + 1) * d))
        out.append(Segment(key, v0 + g * d, v0 + (g + 1) * d))
    return tuple(out)
