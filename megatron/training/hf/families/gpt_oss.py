"""GPT-OSS (``GptOssForCausalLM``, model_type ``gpt_oss``): attention with sinks, alternating
sliding-window and full layers, YaRN rotary embeddings, and a MoE block in every layer.

Attention: q/k/v/o with biases (``attention_bias`` must be true: the experts always have
biases, and our biases are on every linear layer or none), one learned sink logit per query
head (``self_attn.sinks``: our ``core_attention.softmax_offset``, ``softmax_type``
"learnable"), ``layer_types`` "sliding_attention" (a query sees itself and the
``sliding_window`` - 1 keys before it) or "full_attention" per layer (our
``window_attn_skip_freq`` list: 1 = sliding). RoPE: ``rope_parameters`` yarn (``factor``,
``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``truncate``: false is our
``--no-yarn-correction-range-round-to-int``); an explicit ``attention_factor``, ``mscale`` or
``mscale_all_dim`` is refused, as is any other rope type.

MoE: the router ``mlp.router`` (weight [E, h] and bias [E]: our router weight and bias), top
``num_experts_per_tok`` of the logits, a softmax over the selected ones (our
``moe_router_pre_softmax`` false). Expert g: ``gate_up = x gate_up_proj[g] + gate_up_proj_bias[g]``
with gate the even and up the odd columns, ``(clamp(up, -L, L) + 1) * g sigmoid(1.702 g)``,
g = clamp(gate, max=L), L = ``swiglu_limit``, then ``@ down_proj[g] + down_proj_bias[g]``,
times the routing weight: our ``--quick-geglu --glu-linear-offset 1
--activation-func-clamp-value L`` experts with biases (the routing weight scales the fc2 bias
too). Our expert g's ``linear_fc1.weight`` [2F, h] = [even columns; odd columns] of
``gate_up_proj[g]`` [h, 2F] transposed, its bias likewise from ``gate_up_proj_bias[g]``;
``linear_fc2.weight`` [h, F] = ``down_proj[g]`` [F, h] transposed. ``swiglu_alpha`` must be
1.702 (megatron-core's ``quick_gelu``). MXFP4-quantized checkpoints (``quantization_config``)
are refused for every family; dequantize them first (transformers' ``Mxfp4Config(dequantize=
True)``, then ``save_pretrained``).
"""

from typing import Any, Dict, Optional

from megatron.training.hf.families.llama import LlamaShaped, layer_prefix, rmsnorm_decoder
from megatron.training.hf.families.moe import read_routing, replace_mlp
from megatron.training.hf.family import ConfigReader, HFArchitecture, Segment, Source

ALPHA = 1.702
LAYER_TYPES = {"sliding_attention": 1, "full_attention": 0}


class GptOss(LlamaShaped):
    model_type = "gpt_oss"
    architecture = "GptOssForCausalLM"
    settings_hint = (
        "RMSNorm + --quick-geglu --glu-linear-offset 1 --activation-func-clamp-value L + "
        "--softmax-type learnable + --position-embedding-type yarn + biases + --num-experts "
        "in every layer (GPT-OSS)"
    )

    def read(self, c: ConfigReader) -> HFArchitecture:
        hidden = c.positive_int("hidden_size")
        heads = c.positive_int("num_attention_heads")
        groups = c.positive_int("num_key_value_heads", default=heads)
        c.require(heads % groups == 0, "num_key_value_heads", groups, f"a divisor of {heads}")
        head_dim = c.positive_int("head_dim", default=hidden // heads)
        c.require(head_dim % 2 == 0, "head_dim", head_dim, "an even integer (rotary pairs)")
        layers = c.positive_int("num_hidden_layers")
        experts = c.positive_int("num_local_experts")
        c.expect("attention_bias", True, "true (the experts always have biases)", default=True)
        c.expect("hidden_act", "silu", "silu (unused by GPT-OSS's experts)", default="silu")
        c.expect("swiglu_alpha", ALPHA, f"{ALPHA} (quick_gelu's gain)", default=ALPHA)
        limit = c.positive_float("swiglu_limit", default=7.0)
        theta, yarn = read_yarn(c)
        read_release_keys(c)
        return rmsnorm_decoder(
            c,
            self.model_type,
            {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=groups,
            kv_channels=head_dim,
            swiglu=False,
            activation="quick_gelu",
            position_embedding_type="yarn",
            rotary_base=theta,
            rope_scaling_factor=None,
            add_bias_linear=True,
            add_qkv_bias=False,
            **read_windows(c, layers),
            **read_routing(c, experts, norm_topk_prob=True),
            moe_ffn_hidden_size=c.positive_int("intermediate_size"),
            moe_layer_freq=(1,) * layers,
            softmax_type="learnable",
            glu_linear_offset=1.0,
            activation_func_clamp_value=limit,
            **yarn,
        )

    def write(self, arch: HFArchitecture) -> Dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_size": arch.hidden_size,
            "intermediate_size": arch.moe_ffn_hidden_size,
            "num_hidden_layers": arch.num_layers,
            "num_attention_heads": arch.num_attention_heads,
            "num_key_value_heads": arch.num_query_groups,
            "head_dim": arch.kv_channels,
            "num_local_experts": arch.num_moe_experts,
            "num_experts_per_tok": arch.moe_router_topk,
            "max_position_embeddings": arch.max_position_embeddings,
            "rms_norm_eps": arch.norm_epsilon,
            "vocab_size": arch.vocab_size,
            "tie_word_embeddings": arch.tied,
            "attention_bias": True,
            "swiglu_alpha": ALPHA,
            "swiglu_limit": arch.activation_func_clamp_value,
            "sliding_window": arch.window_size[0] + 1 if arch.window_size else None,
            "layer_types": [
                "sliding_attention" if sliding else "full_attention"
                for sliding in arch.sliding_layers()
            ],
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": arch.rotary_base,
                "factor": arch.rotary_scaling_factor,
                "original_max_position_embeddings": arch.yarn_original_max_position_embeddings,
                "beta_fast": arch.yarn_beta_fast,
                "beta_slow": arch.yarn_beta_slow,
                "truncate": not arch.no_yarn_correction_range_round_to_int,
            },
            "router_aux_loss_coef": 0.0,
        }

    def layer_sources(
        self, arch: HFArchitecture, layer: int, prefix: Optional[str]
    ) -> Dict[str, Source]:
        table = super().layer_sources(arch, layer, prefix)
        p = layer_prefix(prefix, layer)
        ours = f"decoder.layers.{layer}."
        table[ours + "self_attention.core_attention.softmax_offset"] = (
            Segment(f"{p}self_attn.sinks", 0, arch.num_attention_heads),
        )
        replace_mlp(table, layer, expert_sources(arch, layer, f"{p}mlp."))
        return table


FAMILY = GptOss()


def expert_sources(arch: HFArchitecture, layer: int, mlp: str) -> Dict[str, Source]:
    """The MoE block of ``layer``: the router's weight and bias, and per expert g the
    de-interleaved, transposed slices of the stacked ``experts.*`` tensors."""
    h, f, e = arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_moe_experts
    ours = f"decoder.layers.{layer}.mlp."
    table = {
        ours + "router.weight": (Segment(f"{mlp}router.weight", 0, e),),
        ours + "router.bias": (Segment(f"{mlp}router.bias", 0, e),),
    }
    fused, down = f"{mlp}experts.gate_up_proj", f"{mlp}experts.down_proj"
    for g in range(e):
        name = f"{ours}experts.local_experts.{g}."
        table[name + "linear_fc1.weight"] = tuple(
            Segment(fused, half, 2 * f, transposed=True, step=2, index=g) for half in (0, 1)
        )
        table[name + "linear_fc1.bias"] = tuple(
            Segment(fused + "_bias", half, 2 * f, step=2, index=g) for half in (0, 1)
        )
        table[name + "linear_fc2.weight"] = (Segment(down, 0, h, transposed=True, index=g),)
        table[name + "linear_fc2.bias"] = (Segment(down + "_bias", 0, h, index=g),)
    return table


def read_release_keys(c: ConfigReader) -> None:
    """Keys of the released checkpoints' config.json that transformers' model does not read:
    ``experts_per_token`` (must equal ``num_experts_per_tok``) and ``initial_context_length``
    (the pre-YaRN length, informational: yarn's ``original_max_position_embeddings`` is
    what the model uses)."""
    topk = c.optional("num_experts_per_tok", None)
    alias = c.optional("experts_per_token", None)
    c.require(
        alias is None or alias == topk,
        "experts_per_token",
        alias,
        f"the same as num_experts_per_tok ({topk})",
    )
    length = c.optional("initial_context_length", None)
    c.require(
        length is None or (isinstance(length, int) and length >= 1),
        "initial_context_length",
        length,
        "a positive integer",
    )


def read_windows(c: ConfigReader, layers: int) -> Dict[str, Any]:
    """``sliding_window`` and ``layer_types`` as window_size and window_attn_skip_freq."""
    window = c.optional("sliding_window", None)
    default = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    types = c.optional("layer_types", default)
    c.require(
        isinstance(types, list) and len(types) == layers and set(types) <= set(LAYER_TYPES),
        "layer_types",
        types,
        f"{layers} entries of {sorted(LAYER_TYPES)}",
    )
    pattern = tuple(LAYER_TYPES[t] for t in types)
    if window is None or not any(pattern):
        return {}
    c.require(isinstance(window, int) and window >= 1, "sliding_window", window, "an int >= 1")
    return {"window_size": (window - 1, 0), "window_attn_skip_freq": pattern}


def read_yarn(c: ConfigReader) -> tuple:
    """(rope_theta, the YaRN fields) from ``rope_parameters`` (or ``rope_scaling`` and
    ``rope_theta``); only rope_type yarn without attention_factor / mscale overrides."""
    params = c.optional("rope_parameters", None) or c.optional("rope_scaling", None)
    c.seen("rope_scaling", "rope_parameters")
    c.require(isinstance(params, dict), "rope_parameters", params, "a yarn rope_parameters object")
    kind = params.get("rope_type", params.get("type"))
    c.require(kind == "yarn", "rope_parameters.rope_type", kind, "yarn")
    known = {
        "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
        "beta_fast", "beta_slow", "truncate",
    }  # fmt: skip
    unknown = sorted(set(params) - known)
    c.require(not unknown, "rope_parameters", params, f"no keys beyond {sorted(known)}")
    theta = params.get("rope_theta", c.optional("rope_theta", 150000.0))
    values = {k: params.get(k, d) for k, d in (("beta_fast", 32.0), ("beta_slow", 1.0))}
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        value = params.get(key, values.get(key))
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        c.require(ok, f"rope_parameters.{key}", value, "a number > 0")
    c.require(isinstance(theta, (int, float)) and theta > 0, "rope_theta", theta, "a number > 0")
    truncate = params.get("truncate", True)
    c.require(isinstance(truncate, bool), "rope_parameters.truncate", truncate, "true or false")
    return float(theta), dict(
        rotary_scaling_factor=float(params["factor"]),
        yarn_original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        yarn_beta_fast=float(values["beta_fast"]),
        yarn_beta_slow=float(values["beta_slow"]),
        no_yarn_correction_range_round_to_int=not truncate,
    )
