"""Llama (``LlamaForCausalLM``) and the Llama-shaped families built on it.

``LlamaShaped`` is the common reading and writing of a RMSNorm + SwiGLU + RoPE decoder with
separate q/k/v and gate/up projections (Mistral and Qwen2 add or refuse a few keys through
``read_extra`` / ``write_extra``). Weights: our ``linear_qkv`` rows are, per query group g,
[q heads of g, k_g, v_g] (megatron-core's layout), made of row ranges of ``q_proj``,
``k_proj`` and ``v_proj``; ``linear_fc1`` is [gate; up].
"""

from typing import Any, Dict, List, Optional, Tuple

from megatron.training.hf.family import ConfigReader, Family, HFArchitecture, Segment, Source

# Llama 3.x frequency scaling as megatron-core's RotaryEmbedding(rope_scaling=True) has it:
# only the factor is a parameter there; the other three are fixed.
LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class LlamaShaped(Family):
    """The shared part of Llama, Mistral and Qwen2."""

    def read(self, c: ConfigReader) -> HFArchitecture:
        hidden = c.positive_int("hidden_size")
        heads = c.positive_int("num_attention_heads")
        groups = c.optional("num_key_value_heads", heads)
        head_dim = c.optional("head_dim", None)
        if head_dim is None:
            head_dim = hidden // heads
        check_heads(c, heads, groups, head_dim)
        c.expect("hidden_act", "silu", "silu (SwiGLU)", default="silu")
        c.expect("pretraining_tp", 1, "1", default=1, allow=lambda v: isinstance(v, int) and v >= 1)
        rotary_base, scaling, rotary_percent = self.read_rotary(c)
        extra = self.read_extra(c)
        return rmsnorm_decoder(
            c,
            self.model_type,
            {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
            num_layers=c.positive_int("num_hidden_layers"),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=groups,
            kv_channels=head_dim,
            swiglu=True,
            activation="silu",
            position_embedding_type="rope",
            rotary_base=rotary_base,
            rope_scaling_factor=scaling,
            rotary_percent=rotary_percent,
            **{"add_bias_linear": False, "add_qkv_bias": False, **extra},
        )

    def read_rotary(self, c: ConfigReader) -> Tuple[float, Optional[float], float]:
        """(rope_theta, Llama 3 scaling factor or None, the rotated fraction of a head)."""
        c.expect(
            "partial_rotary_factor", 1.0, "1.0 (rotary embeddings on the whole head)", default=1.0
        )
        return (*read_rope(c), 1.0)

    def read_extra(self, c: ConfigReader) -> Dict[str, Any]:
        """The family's own keys: the HFArchitecture fields (``add_bias_linear``,
        ``add_qkv_bias``, ``window_size``, ``qk_layernorm``, the MoE fields, ...) that differ
        from the plain Llama shape, passed on as they are."""
        return {}

    def write(self, arch: HFArchitecture) -> Dict[str, Any]:
        config = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_act": "silu",
            "hidden_size": arch.hidden_size,
            "intermediate_size": arch.ffn_hidden_size,
            "num_hidden_layers": arch.num_layers,
            "num_attention_heads": arch.num_attention_heads,
            "num_key_value_heads": arch.num_query_groups,
            "head_dim": arch.kv_channels,
            "max_position_embeddings": arch.max_position_embeddings,
            "rms_norm_eps": arch.norm_epsilon,
            "rope_theta": arch.rotary_base,
            "vocab_size": arch.vocab_size,
            "tie_word_embeddings": arch.tied,
        }
        if arch.rope_scaling_factor is not None:
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": arch.rope_scaling_factor,
                **LLAMA3_FIXED,
            }
        config.update(self.write_extra(arch))
        return config

    def write_extra(self, arch: HFArchitecture) -> Dict[str, Any]:
        """The family's own keys of an exported ``config.json``."""
        return {}

    def global_sources(self, arch: HFArchitecture, prefix: Optional[str]) -> Dict[str, Source]:
        p = "model." if prefix is None else prefix
        out = {
            "embedding.word_embeddings.weight": (
                Segment(f"{p}embed_tokens.weight", 0, arch.vocab_size),
            ),
            "decoder.final_layernorm.weight": (Segment(f"{p}norm.weight", 0, arch.hidden_size),),
        }
        if not arch.tied:
            out["output_layer.weight"] = (Segment("lm_head.weight", 0, arch.vocab_size),)
        return out

    def layer_sources(
        self, arch: HFArchitecture, layer: int, prefix: Optional[str]
    ) -> Dict[str, Source]:
        h, ffn = arch.hidden_size, arch.ffn_hidden_size
        p = layer_prefix(prefix, layer)
        attn, mlp = f"{p}self_attn.", f"{p}mlp."
        table = {
            "input_layernorm.weight": (Segment(f"{p}input_layernorm.weight", 0, h),),
            "self_attention.linear_qkv.weight": grouped_qkv(arch, attn, "weight"),
            "self_attention.linear_proj.weight": (Segment(f"{attn}o_proj.weight", 0, h),),
            "pre_mlp_layernorm.weight": (Segment(f"{p}post_attention_layernorm.weight", 0, h),),
            "mlp.linear_fc1.weight": (
                Segment(f"{mlp}gate_proj.weight", 0, ffn),
                Segment(f"{mlp}up_proj.weight", 0, ffn),
            ),
            "mlp.linear_fc2.weight": (Segment(f"{mlp}down_proj.weight", 0, h),),
        }
        if arch.add_bias_linear or arch.add_qkv_bias:
            table["self_attention.linear_qkv.bias"] = grouped_qkv(arch, attn, "bias")
        if arch.add_bias_linear:
            table["self_attention.linear_proj.bias"] = (Segment(f"{attn}o_proj.bias", 0, h),)
            table["mlp.linear_fc1.bias"] = (
                Segment(f"{mlp}gate_proj.bias", 0, ffn),
                Segment(f"{mlp}up_proj.bias", 0, ffn),
            )
            table["mlp.linear_fc2.bias"] = (Segment(f"{mlp}down_proj.bias", 0, h),)
        return {f"decoder.layers.{layer}.{name}": source for name, source in table.items()}


class Llama(LlamaShaped):
    """Llama 2 / 3.x: optional biases on every linear layer (``attention_bias`` =
    ``mlp_bias``), Llama 3 frequency scaling."""

    model_type = "llama"
    architecture = "LlamaForCausalLM"
    settings_hint = "RMSNorm + swiglu + rope (Llama)"

    def read_extra(self, c: ConfigReader) -> Dict[str, Any]:
        attention_bias = c.optional("attention_bias", False)
        mlp_bias = c.optional("mlp_bias", False)
        c.require(
            attention_bias == mlp_bias,
            "attention_bias",
            attention_bias,
            f"the same as mlp_bias ({mlp_bias}): our GPT has biases on every linear "
            "layer or on none",
        )
        return {"add_bias_linear": bool(attention_bias)}

    def write_extra(self, arch: HFArchitecture) -> Dict[str, Any]:
        return {"attention_bias": arch.add_bias_linear, "mlp_bias": arch.add_bias_linear}


FAMILY = Llama()


def check_heads(c: ConfigReader, heads: int, groups: Any, head_dim: Any) -> None:
    """``num_key_value_heads`` divides ``num_attention_heads``; ``head_dim`` is even."""
    c.require(
        isinstance(groups, int) and groups >= 1 and heads % groups == 0,
        "num_key_value_heads",
        groups,
        f"a positive divisor of num_attention_heads ({heads})",
    )
    c.require(
        isinstance(head_dim, int) and head_dim >= 2 and head_dim % 2 == 0,
        "head_dim",
        head_dim,
        "an even positive integer (rotary embeddings rotate pairs)",
    )


def layer_prefix(prefix: Optional[str], layer: int) -> str:
    """HuggingFace's name prefix of decoder layer ``layer`` (``prefix``: the model's, None:
    ``model.``)."""
    return f"{'model.' if prefix is None else prefix}layers.{layer}."


def rmsnorm_decoder(
    c: ConfigReader, family: str, defaults: Dict[str, Any], **fields: Any
) -> HFArchitecture:
    """The HFArchitecture of a RMSNorm decoder: the keys its config.json shares with Llama's
    (``intermediate_size``, ``vocab_size``, ``rms_norm_eps``, ``max_position_embeddings``,
    ``tie_word_embeddings``, the dtype) read with the family's ``defaults`` (by key; none:
    required), and ``fields``, the family's own."""
    return HFArchitecture(
        family=family,
        ffn_hidden_size=c.positive_int("intermediate_size", defaults.get("intermediate_size")),
        vocab_size=c.positive_int("vocab_size", defaults.get("vocab_size")),
        normalization="RMSNorm",
        norm_epsilon=c.positive_float("rms_norm_eps", defaults.get("rms_norm_eps")),
        max_position_embeddings=c.positive_int(
            "max_position_embeddings", defaults.get("max_position_embeddings")
        ),
        tied=bool(c.optional("tie_word_embeddings", defaults.get("tie_word_embeddings", False))),
        dtype=c.dtype(),
        **fields,
    )


def require_implied_head_dim(c: ConfigReader, hidden: Any, heads: Any, why: str) -> None:
    """``head_dim`` absent or hidden_size / num_attention_heads (``why``: what needs it)."""
    head_dim = c.optional("head_dim", None)
    c.require(
        head_dim is None or head_dim * heads == hidden,
        "head_dim",
        head_dim,
        f"absent or hidden_size / num_attention_heads ({hidden} / {heads}): {why}",
    )


def grouped_qkv(arch: HFArchitecture, attn: str, kind: str) -> Source:
    """Our ``linear_qkv`` rows from ``q_proj`` / ``k_proj`` / ``v_proj``: per query group,
    its query heads, then its key head, then its value head."""
    d, groups = arch.kv_channels, arch.num_query_groups
    per_group = arch.num_attention_heads // groups
    out: List[Segment] = []
    for g in range(groups):
        out.append(Segment(f"{attn}q_proj.{kind}", g * per_group * d, (g + 1) * per_group * d))
        out.append(Segment(f"{attn}k_proj.{kind}", g * d, (g + 1) * d))
        out.append(Segment(f"{attn}v_proj.{kind}", g * d, (g + 1) * d))
    return tuple(out)


def read_rope(c: ConfigReader) -> Tuple[float, Optional[float]]:
    """(rope_theta, Llama 3 scaling factor or None) from ``rope_theta`` / ``rope_scaling``
    (transformers 4) or ``rope_parameters`` (transformers 5)."""
    params = c.optional("rope_parameters", None)
    scaling = c.optional("rope_scaling", None)
    theta = c.optional("rope_theta", None)
    if params is not None:
        c.require(isinstance(params, dict), "rope_parameters", params, "an object")
        if theta is None:
            theta = params.get("rope_theta")
        if params.get("rope_type", "default") != "default":
            c.require(scaling is None, "rope_scaling", scaling, "null beside rope_parameters")
            scaling = params
        else:
            extra = sorted(set(params) - {"rope_theta", "rope_type"})
            c.require(not extra, "rope_parameters", params, "rope_theta and rope_type only")
    theta = 10000.0 if theta is None else theta
    c.require(isinstance(theta, (int, float)) and theta > 0, "rope_theta", theta, "a number > 0")
    if scaling is None:
        return float(theta), None
    c.require(isinstance(scaling, dict), "rope_scaling", scaling, "an object or null")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return float(theta), None
    c.require(
        kind == "llama3",
        "rope_scaling",
        scaling,
        "null or rope_type 'llama3' (linear, dynamic, yarn, longrope, ... are not supported)",
    )
    for key, value in LLAMA3_FIXED.items():
        got = scaling.get(key)
        c.require(
            got is not None and float(got) == value,
            f"rope_scaling.{key}",
            got,
            f"{value:g} (megatron-core's Llama 3 scaling fixes it)",
        )
    factor = scaling.get("factor")
    c.require(
        isinstance(factor, (int, float)) and factor > 0,
        "rope_scaling.factor",
        factor,
        "a number > 0",
    )
    known = set(LLAMA3_FIXED) | {"factor", "rope_type", "type", "rope_theta"}
    unknown = sorted(set(scaling) - known)
    c.require(not unknown, "rope_scaling", scaling, f"no keys beyond {sorted(known)}")
    return float(theta), float(factor)
