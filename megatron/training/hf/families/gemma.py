"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``, ``gemma3_text``).

Both: RMSNorm with a zero-centred weight, y = x / sqrt(mean(x^2) + eps) * (1 + w)
(``--apply-layernorm-1p``); a norm before and after attention and before and after the MLP
(``--sandwich-layernorm``: ``post_attention_layernorm`` -> ``post_self_attn_layernorm``,
``pre_feedforward_layernorm`` -> ``pre_mlp_layernorm``, ``post_feedforward_layernorm`` ->
``post_mlp_layernorm``); the embeddings times sqrt(hidden) in their dtype
(``--embedding-scale-sqrt-hidden``); attention scale ``query_pre_attn_scalar`` ** -0.5
(``--softmax-scale``); the gated tanh-GELU MLP (``--geglu --openai-gelu``); sliding-window
layers (a query sees ``sliding_window`` keys, itself included) with full attention every
N-th layer (``layer_types``, ``--window-attn-skip-freq N``); attention and final-logit
soft-capping (``attn_logit_softcapping``, ``final_logit_softcapping``). Gemma 3 adds per-head
q/k norms (zero-centred too) and a RoPE base of the sliding-window layers of its own
(``rope_local_base_freq``, ``--local-rotary-base``). Refused by name: attention biases,
bidirectional attention, a layer pattern that is not "full every N-th layer", RoPE scaling
but Gemma 3's linear factor of the full-attention layers (the 4B+ models; a power of two,
``--rotary-seq-len-interpolation-factor``, so that dividing the positions is bit for bit
transformers' dividing the frequencies), another activation.
"""

import math
from typing import Any, Dict, List, Optional

from megatron.training.hf.families.llama import (
    LlamaShaped,
    check_heads,
    layer_prefix,
    read_rope,
    rmsnorm_decoder,
)
from megatron.training.hf.families.qwen3 import qk_norm_sources, refuse_attention_bias
from megatron.training.hf.family import ConfigReader, HFArchitecture, Segment, Source

SLIDING, FULL = "sliding_attention", "full_attention"


class Gemma2(LlamaShaped):
    """Gemma 2 (the module docstring); Llama's writing and weight table with Gemma's keys
    and norms."""

    model_type = "gemma2"
    architecture = "Gemma2ForCausalLM"
    settings_hint = (
        "RMSNorm + --geglu --openai-gelu + rope + --apply-layernorm-1p --sandwich-layernorm "
        "--embedding-scale-sqrt-hidden (Gemma 2)"
    )
    qk_norms = False

    # transformers' defaults of the keys a config.json may leave out (the soft-caps: absent
    # is the default, null is off)
    defaults = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    sizes = {"hidden_size": 2304, "vocab_size": 256000, "max_position_embeddings": 8192}

    def read(self, c: ConfigReader) -> HFArchitecture:
        hidden = c.positive_int("hidden_size", default=self.sizes["hidden_size"])
        heads = c.positive_int("num_attention_heads", default=8)
        groups = c.optional("num_key_value_heads", 4)
        head_dim = c.optional("head_dim", 256)
        check_heads(c, heads, groups, head_dim)
        activation = c.optional("hidden_activation", "gelu_pytorch_tanh")
        c.require(
            activation == "gelu_pytorch_tanh",
            "hidden_activation",
            activation,
            "gelu_pytorch_tanh (GELU's tanh approximation, gated)",
        )
        c.expect("hidden_act", activation, f"absent or {activation!r}", default=activation)
        refuse_attention_bias(c)
        c.seen("cache_implementation")  # generation's cache kind ("hybrid"): not the weights
        c.expect(
            "use_bidirectional_attention",
            False,
            "false or null (causal attention)",
            default=False,
            allow=lambda v: not v,
        )
        full_base, local_base, factor = self.read_rope_bases(c)
        window = self.read_layers(c)
        own = local_base != full_base or factor is not None  # the window layers' own rope
        local = local_base if window["window_size"] is not None and own else None
        scalar = c.positive_float("query_pre_attn_scalar", default=256)
        defaults = dict(
            self.sizes, intermediate_size=9216, rms_norm_eps=1e-6, tie_word_embeddings=True
        )
        return rmsnorm_decoder(
            c,
            self.model_type,
            defaults,
            num_layers=c.positive_int("num_hidden_layers", default=26),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=groups,
            kv_channels=head_dim,
            swiglu=False,
            geglu=True,
            activation="gelu_tanh",
            position_embedding_type="rope",
            rotary_base=full_base,
            rope_scaling_factor=None,
            add_bias_linear=False,
            add_qkv_bias=False,
            qk_layernorm=self.qk_norms,
            apply_layernorm_1p=True,
            sandwich_layernorm=True,
            embedding_scale_sqrt_hidden=True,
            softmax_scale=scalar**-0.5,
            attn_logit_softcapping=self.softcap(c, "attn_logit_softcapping"),
            final_logit_softcapping=self.softcap(c, "final_logit_softcapping"),
            local_rotary_base=local,
            rotary_seq_len_interpolation_factor=factor,
            **window,
        )

    def softcap(self, c: ConfigReader, key: str) -> Optional[float]:
        """A soft-cap: transformers' default when the key is absent, None when null."""
        c.seen(key)
        value = c.raw[key] if key in c.raw else self.defaults.get(key)
        if value is None:
            return None
        ok = isinstance(value, (int, float)) and math.isfinite(value) and value > 0
        c.require(ok, key, value, "null or a number > 0")
        return float(value)

    def read_rope_bases(self, c: ConfigReader):
        """(the base of the full layers, of the sliding ones, the full layers' linear
        scaling factor or None): one ``rope_theta``, no scaling."""
        theta, scaling = read_rope(c)
        c.require(scaling is None, "rope_scaling", c.raw.get("rope_scaling"), "null")
        return theta, theta, None

    def read_layers(self, c: ConfigReader) -> Dict[str, Any]:
        """The window and its pattern (every other layer full, by default)."""
        return read_window(c, default_freq=2)

    def write_extra(self, arch: HFArchitecture) -> Dict[str, Any]:
        config = {
            "hidden_activation": "gelu_pytorch_tanh",
            "attention_bias": False,
            "query_pre_attn_scalar": _query_pre_attn_scalar(arch.softmax_scale, arch.kv_channels),
            "attn_logit_softcapping": arch.attn_logit_softcapping,
            "final_logit_softcapping": arch.final_logit_softcapping,
        }
        config.update(write_window(arch))
        return config

    def write(self, arch: HFArchitecture) -> Dict[str, Any]:
        """Llama's keys without its ``hidden_act`` (Gemma's is ``hidden_activation``)."""
        config = super().write(arch)
        config.pop("hidden_act")
        return config

    def layer_sources(
        self, arch: HFArchitecture, layer: int, prefix: Optional[str]
    ) -> Dict[str, Source]:
        h = arch.hidden_size
        p = layer_prefix(prefix, layer)
        ours = f"decoder.layers.{layer}."
        table = super().layer_sources(arch, layer, prefix)
        norms = {  # ours -> HuggingFace's; Llama's post_attention_layernorm is pre-MLP
            "post_self_attn_layernorm": "post_attention_layernorm",
            "pre_mlp_layernorm": "pre_feedforward_layernorm",
            "post_mlp_layernorm": "post_feedforward_layernorm",
        }
        for name, theirs in norms.items():
            table[f"{ours}{name}.weight"] = (Segment(f"{p}{theirs}.weight", 0, h),)
        if self.qk_norms:
            table.update(qk_norm_sources(arch, layer, prefix))
        return table


class Gemma3(Gemma2):
    """Gemma 3 text: Gemma 2's layer with q/k norms, a local RoPE base, the full layers'
    linear RoPE scaling, full attention every sixth layer by default, no soft-caps by
    default."""

    model_type = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    settings_hint = (
        "RMSNorm + --geglu --openai-gelu + rope + --apply-layernorm-1p --sandwich-layernorm "
        "--embedding-scale-sqrt-hidden --qk-layernorm (Gemma 3)"
    )
    qk_norms = True

    defaults: Dict[str, float] = {}
    sizes = {"hidden_size": 2304, "vocab_size": 262208, "max_position_embeddings": 131072}

    def read_rope_bases(self, c: ConfigReader):
        return read_gemma3_rope(c)

    def read_layers(self, c: ConfigReader) -> Dict[str, Any]:
        return read_window(c, default_freq=6)

    def write_extra(self, arch: HFArchitecture) -> Dict[str, Any]:
        config = super().write_extra(arch)
        local = arch.local_rotary_base if arch.local_rotary_base is not None else arch.rotary_base
        config.update({"rope_theta": arch.rotary_base, "rope_local_base_freq": local})
        factor = arch.rotary_seq_len_interpolation_factor
        if factor is not None:
            config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        return config


def read_window(c: ConfigReader, default_freq: int) -> Dict[str, Any]:
    """``window_size`` and ``window_attn_skip_freq`` from ``sliding_window`` and
    ``layer_types`` (or the pattern ``sliding_window_pattern``: every N-th layer full)."""
    layers = c.positive_int("num_hidden_layers", default=26)
    window = c.optional("sliding_window", 4096)
    pattern = c.optional("sliding_window_pattern", c.optional("_sliding_window_pattern", None))
    pattern = default_freq if pattern is None else pattern
    c.require(
        isinstance(pattern, int) and pattern >= 1,
        "sliding_window_pattern",
        pattern,
        "a positive integer",
    )
    types = c.optional("layer_types", None)
    if types is None:
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    c.require(
        isinstance(types, list) and len(types) == layers and set(types) <= {SLIDING, FULL},
        "layer_types",
        types,
        f"{layers} entries of {SLIDING!r} / {FULL!r}",
    )
    if SLIDING not in types:
        return {"window_size": None, "window_attn_skip_freq": None}
    c.require(
        isinstance(window, int) and window >= 1, "sliding_window", window, "a positive integer"
    )
    freq = _skip_freq(types)
    c.require(
        freq is not False,
        "layer_types",
        types,
        "full attention on every N-th layer (1-based) and the sliding window on the others",
    )
    return {"window_size": (window - 1, 0), "window_attn_skip_freq": freq}


def _skip_freq(types: List[str]):
    """N when layer i (0-based) is full exactly when (i + 1) % N == 0 (None: no full layer;
    False: no such N)."""
    fulls = [i + 1 for i, t in enumerate(types) if t == FULL]
    if not fulls:
        return None
    n = fulls[0]
    ok = all((i + 1) % n == 0 if t == FULL else (i + 1) % n != 0 for i, t in enumerate(types))
    return n if ok else False


def write_window(arch: HFArchitecture) -> Dict[str, Any]:
    """``sliding_window`` and ``layer_types`` of ``arch`` (every layer full without a
    window)."""
    if arch.window_size is None:
        return {"sliding_window": None, "layer_types": [FULL] * arch.num_layers}
    types = [SLIDING if sliding else FULL for sliding in arch.sliding_layers()]
    return {"sliding_window": arch.window_size[0] + 1, "layer_types": types}


def read_gemma3_rope(c: ConfigReader):
    """(full layers' base, sliding layers' base, the full layers' linear factor or None)
    from ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` (transformers 4) or the
    per-layer-type ``rope_parameters`` (transformers 5)."""
    params = c.optional("rope_parameters", None)
    theta = c.optional("rope_theta", None)
    local = c.optional("rope_local_base_freq", None)
    scaling, where = c.optional("rope_scaling", None), "rope_scaling"
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        sliding = params.get(SLIDING) or {}
        c.require(
            sliding.get("rope_type", "default") == "default"
            and set(sliding) <= {"rope_type", "rope_theta"},
            f"rope_parameters.{SLIDING}",
            sliding,
            "rope_type 'default' (the sliding layers are not scaled)",
        )
        full = params.get(FULL) or {}
        theta = full.get("rope_theta", theta)
        local = sliding.get("rope_theta", local)
        if full.get("rope_type", "default") != "default" or set(full) - {"rope_type", "rope_theta"}:
            c.require(scaling is None, "rope_scaling", scaling, "null beside rope_parameters")
            scaling, where = full, f"rope_parameters.{FULL}"
    elif params is not None:
        c.fail("rope_parameters", params, f"an object of {FULL!r} and {SLIDING!r} entries")
    theta = 1_000_000.0 if theta is None else theta
    local = 10_000.0 if local is None else local
    for key, value in (("rope_theta", theta), ("rope_local_base_freq", local)):
        c.require(isinstance(value, (int, float)) and value > 0, key, value, "a number > 0")
    return float(theta), float(local), _linear_factor(c, scaling, where)


def _linear_factor(c: ConfigReader, scaling, where: str) -> Optional[float]:
    """The factor of a ``linear`` RoPE scaling (None: none): a power of two, so that our
    positions / factor are bit for bit transformers' frequencies / factor."""
    if scaling is None:
        return None
    c.require(isinstance(scaling, dict), where, scaling, "an object or null")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None
    factor = scaling.get("factor")
    extra = set(scaling) - {"rope_type", "type", "factor", "rope_theta"}
    c.require(
        kind == "linear" and not extra,
        where,
        scaling,
        "null or rope_type 'linear' with a factor (dynamic, yarn, ... are not supported)",
    )
    ok = isinstance(factor, (int, float)) and factor > 0 and math.frexp(factor)[0] == 0.5
    c.require(ok, f"{where}.factor", factor, "a power of two (2, 4, 8, ...), for exactness")
    return float(factor)


def _query_pre_attn_scalar(scale: Optional[float], head_dim: int):
    """``query_pre_attn_scalar`` of an attention scale (an int when it is one)."""
    if scale is None:
        return head_dim
    scalar = scale**-2
    return round(scalar) if abs(scalar - round(scalar)) < 1e-9 * scalar else scalar


GEMMA2 = Gemma2()
GEMMA3 = Gemma3()
