"""HuggingFace ``config.json`` <-> the GPT architecture this core builds.

``read_hf_config(directory)`` reads ``config.json`` (no ``transformers`` needed) and returns an
``HFArchitecture``: the family (llama, mistral, qwen2, gpt2) and every setting our GPT needs.
Every key of ``config.json`` is either mapped, checked against the one value we can express,
or known to leave the weights' meaning unchanged (generation defaults, token ids,
bookkeeping, dropout probabilities); anything else is refused with a ``ValueError`` naming the
key and its value, so a converted model is never silently a different model.

``hf_config_for_export`` goes back: the original ``config.json`` when the model came from one,
else a Llama / Qwen2 / GPT-2 configuration written from the architecture.
"""

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from megatron.training.model_settings import resolved_model

FAMILIES = ("llama", "mistral", "qwen2", "gpt2")
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "gpt2": ("GPT2LMHeadModel",),
}
# Llama 3.x frequency scaling as megatron-core's RotaryEmbedding(rope_scaling=True) has it:
# only the factor is a parameter there; the other three are fixed.
LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Keys that do not change what the weights compute: bookkeeping, generation defaults, token
# ids (the tokenizer's business), initialization and dropout (training-time choices; our
# trainer trains without dropout).
_IGNORED = {
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype",
    "torch_dtype", "use_cache", "initializer_range", "id2label", "label2id", "problem_type",
    "return_dict", "output_attentions", "output_hidden_states", "chunk_size_feed_forward",
    "is_encoder_decoder", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "tokenizer_class", "prefix", "task_specific_params",
    "finetuning_task", "torchscript", "use_bfloat16", "tf_legacy_loss", "bad_words_ids",
    "begin_suppress_tokens", "suppress_tokens", "diversity_penalty", "do_sample",
    "early_stopping", "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty",
    "forced_bos_token_id", "forced_eos_token_id", "length_penalty", "max_length",
    "min_length", "no_repeat_ngram_size", "num_beam_groups", "num_beams",
    "num_return_sequences", "output_scores", "remove_invalid_values", "repetition_penalty",
    "return_dict_in_generate", "temperature", "top_k", "top_p", "typical_p",
    "cross_attention_hidden_size", "tie_encoder_decoder", "attention_dropout",
    "attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_activation", "summary_first_dropout",
    "summary_proj_to_labels", "summary_type", "summary_use_proj", "n_ctx",
}  # fmt: skip


@dataclass(frozen=True)
class HFArchitecture:
    """What a HuggingFace decoder is, in our GPT's terms.

    ``activation``: "silu" (gated: SwiGLU), "gelu" (erf) or "gelu_tanh" (OpenAI's tanh
    approximation, GPT-2's ``gelu_new``). ``rope_scaling_factor``: Llama 3.x frequency
    scaling (None: none). ``dtype``: the dtype the checkpoint declares (a torch name).
    """

    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int
    normalization: str
    norm_epsilon: float
    swiglu: bool
    activation: str
    position_embedding_type: str
    max_position_embeddings: int
    rotary_base: float
    rope_scaling_factor: Optional[float]
    add_bias_linear: bool
    add_qkv_bias: bool
    tied: bool
    dtype: str = "float32"
    window_size: Optional[Tuple[int, int]] = None  # (left, 0): sliding-window attention

    def to_dict(self) -> Dict[str, Any]:
        """Plain values (kept in checkpoints)."""
        return asdict(self)


def read_hf_config(directory) -> "tuple[HFArchitecture, Dict[str, Any]]":
    """(architecture, the raw config dict) of the HuggingFace model in ``directory``."""
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"HuggingFace model directory {str(directory)!r} does not exist")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json; expected a HuggingFace model directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: line {err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return architecture_from_config(raw, str(path)), raw


def architecture_from_config(raw: Dict[str, Any], where: str = "config.json") -> HFArchitecture:
    """The architecture of a ``config.json`` dict; ValueError naming what we cannot express."""
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise ValueError(
            f"{where}: model_type={family!r} is not supported; expected one of "
            f"{', '.join(FAMILIES)}"
        )
    checker = _Checker(raw, where, family)
    architectures = raw.get("architectures")
    if architectures is not None and list(architectures) != list(ARCHITECTURES[family][:1]):
        raise ValueError(
            f"{where}: architectures={json.dumps(architectures)} is not supported; expected "
            f"{json.dumps(list(ARCHITECTURES[family][:1]))} (a causal language model)"
        )
    if family == "gpt2":
        arch = _gpt2(checker)
    else:
        arch = _llama_like(checker, family)
    checker.refuse_unknown()
    return arch


def hf_config_for_export(
    arch: HFArchitecture, original: Optional[Dict[str, Any]], dtype: str
) -> Dict[str, Any]:
    """The ``config.json`` of an exported model: ``original`` (the imported one) with its
    dtype updated, or a fresh one for ``arch``."""
    if original is not None:
        config = dict(original)
        config.pop("torch_dtype", None)
        config["dtype"] = dtype
        return config
    if arch.family == "gpt2":
        config = {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "activation_function": {"gelu_tanh": "gelu_new", "gelu": "gelu"}[arch.activation],
            "n_embd": arch.hidden_size,
            "n_head": arch.num_attention_heads,
            "n_inner": arch.ffn_hidden_size,
            "n_layer": arch.num_layers,
            "n_positions": arch.max_position_embeddings,
            "layer_norm_epsilon": arch.norm_epsilon,
            "vocab_size": arch.vocab_size,
            "tie_word_embeddings": arch.tied,
            "scale_attn_weights": True,
            "attn_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "resid_pdrop": 0.0,
        }
    else:
        config = {
            "architectures": list(ARCHITECTURES[arch.family][:1]),
            "model_type": arch.family,
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
        if arch.family == "llama":
            config.update(attention_bias=arch.add_bias_linear, mlp_bias=arch.add_bias_linear)
        if arch.family == "mistral":
            window = arch.window_size
            config["sliding_window"] = None if window is None else window[0] + 1
    config["dtype"] = dtype
    return config


def training_settings(arch: HFArchitecture) -> Dict[str, Any]:
    """The trainer's model settings (``TrainingConfig`` fields) that build ``arch``."""
    return {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_query_groups": arch.num_query_groups,
        "kv_channels": arch.kv_channels,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "vocab_size": arch.vocab_size,
        "normalization": arch.normalization,
        "norm_epsilon": arch.norm_epsilon,
        "swiglu": arch.swiglu,
        "openai_gelu": arch.activation == "gelu_tanh",
        "position_embedding_type": arch.position_embedding_type,
        "max_position_embeddings": (
            arch.max_position_embeddings if arch.position_embedding_type != "rope" else None
        ),
        "rotary_base": arch.rotary_base,
        "use_rope_scaling": arch.rope_scaling_factor is not None,
        "rope_scaling_factor": arch.rope_scaling_factor or 8.0,
        "disable_bias_linear": not arch.add_bias_linear,
        "add_qkv_bias": arch.add_qkv_bias,
        "untie_embeddings_and_output_weights": not arch.tied,
        "window_size": None if arch.window_size is None else list(arch.window_size),
    }


def architecture_from_model_settings(settings: Dict[str, Any]) -> HFArchitecture:
    """The HuggingFace family and architecture of a model our trainer built (its saved run
    settings); ValueError when no supported family has it."""
    swiglu = bool(settings.get("swiglu"))
    rope = settings.get("position_embedding_type") == "rope"
    bias = not settings.get("disable_bias_linear", False)
    qkv_bias = bool(settings.get("add_qkv_bias", False))
    norm = settings.get("normalization", "LayerNorm")
    model = resolved_model(settings)
    hidden, heads = settings["hidden_size"], settings["num_attention_heads"]
    kv = model["kv_channels"]
    if norm == "RMSNorm" and swiglu and rope:
        family = "qwen2" if (qkv_bias and not bias) else "llama"
    elif norm == "LayerNorm" and not swiglu and not rope and bias and kv * heads == hidden:
        family = "gpt2"
    else:
        family = None
    if family is None:
        raise ValueError(
            "export: this model (normalization={!r}, swiglu={}, position_embedding_type={!r}, "
            "biases={}, add_qkv_bias={}) matches no HuggingFace family we write; expected "
            "RMSNorm + swiglu + rope (Llama, Qwen2 with --add-qkv-bias "
            "--disable-bias-linear) or LayerNorm + gelu + learned positions + biases (GPT-2)"
            "".format(norm, swiglu, settings.get("position_embedding_type"), bias, qkv_bias)
        )
    scaling = settings.get("rope_scaling_factor") if settings.get("use_rope_scaling") else None
    return HFArchitecture(
        family=family,
        num_layers=settings["num_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=model["num_query_groups"],
        kv_channels=kv,
        ffn_hidden_size=model["ffn_hidden_size"],
        vocab_size=settings["vocab_size"],
        normalization=norm,
        norm_epsilon=settings.get("norm_epsilon", 1e-5),
        swiglu=swiglu,
        activation="silu" if swiglu else ("gelu_tanh" if settings.get("openai_gelu") else "gelu"),
        position_embedding_type="rope" if rope else "learned_absolute",
        max_position_embeddings=model["max_position_embeddings"],
        rotary_base=float(settings.get("rotary_base", 10000)),
        rope_scaling_factor=scaling,
        add_bias_linear=bias,
        add_qkv_bias=qkv_bias and not bias,
        tied=not settings.get("untie_embeddings_and_output_weights", False),
    )


# ----------------------------------------------------------------------------------------
# families


def _llama_like(c: "_Checker", family: str) -> HFArchitecture:
    hidden = c.positive_int("hidden_size")
    heads = c.positive_int("num_attention_heads")
    groups = c.optional("num_key_value_heads", heads)
    head_dim = c.optional("head_dim", None)
    if head_dim is None:
        head_dim = hidden // heads
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
    c.expect("hidden_act", "silu", "silu (SwiGLU)", default="silu")
    c.expect("pretraining_tp", 1, "1", default=1, allow=lambda v: isinstance(v, int) and v >= 1)
    c.expect("partial_rotary_factor", 1.0, "1.0 (rotary embeddings on the whole head)", default=1.0)
    rotary_base, scaling = _rope(c)
    qkv_bias, linear_bias = False, False
    window_size = None
    if family == "llama":
        attention_bias = c.optional("attention_bias", False)
        mlp_bias = c.optional("mlp_bias", False)
        c.require(
            attention_bias == mlp_bias,
            "attention_bias",
            attention_bias,
            f"the same as mlp_bias ({mlp_bias}): our GPT has biases on every linear "
            "layer or on none",
        )
        linear_bias = bool(attention_bias)
    if family == "mistral":
        window = c.optional("sliding_window", None)
        c.require(
            window is None or (isinstance(window, int) and window >= 1),
            "sliding_window",
            window,
            "null or a positive integer",
        )
        if window is not None:  # a query sees itself and the window - 1 keys before it
            window_size = (window - 1, 0)
    if family == "qwen2":
        qkv_bias = True
        use_window = c.optional("use_sliding_window", False)
        c.require(
            use_window is False,
            "use_sliding_window",
            use_window,
            "false (sliding-window attention is not supported)",
        )
        c.seen("sliding_window", "max_window_layers")  # unused without use_sliding_window
        layer_types = c.optional("layer_types", None)
        c.require(
            layer_types is None or set(layer_types) <= {"full_attention"},
            "layer_types",
            layer_types,
            "full_attention for every layer",
        )
        c.expect("use_mrope", False, "false", default=False)
    return HFArchitecture(
        family=family,
        num_layers=c.positive_int("num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        ffn_hidden_size=c.positive_int("intermediate_size"),
        vocab_size=c.positive_int("vocab_size"),
        normalization="RMSNorm",
        norm_epsilon=c.positive_float("rms_norm_eps", default=1e-6),
        swiglu=True,
        activation="silu",
        position_embedding_type="rope",
        max_position_embeddings=c.positive_int("max_position_embeddings", default=2048),
        rotary_base=rotary_base,
        rope_scaling_factor=scaling,
        add_bias_linear=linear_bias,
        add_qkv_bias=qkv_bias,
        tied=bool(c.optional("tie_word_embeddings", False)),
        dtype=_dtype(c),
        window_size=window_size,
    )


def _gpt2(c: "_Checker") -> HFArchitecture:
    hidden = c.positive_int("n_embd")
    heads = c.positive_int("n_head")
    c.require(hidden % heads == 0, "n_head", heads, f"a divisor of n_embd ({hidden})")
    activations = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    act = c.optional("activation_function", "gelu_new")
    c.require(act in activations, "activation_function", act, f"one of {sorted(activations)}")
    c.expect("scale_attn_weights", True, "true (scores scaled by 1/sqrt(head size))", True)
    c.expect("scale_attn_by_inverse_layer_idx", False, "false", default=False)
    c.expect("add_cross_attention", False, "false", default=False)
    c.seen("reorder_and_upcast_attn")  # numerics only (float32 attention scores)
    inner = c.optional("n_inner", None)
    inner = 4 * hidden if inner is None else inner
    c.require(isinstance(inner, int) and inner >= 1, "n_inner", inner, "a positive integer or null")
    return HFArchitecture(
        family="gpt2",
        num_layers=c.positive_int("n_layer"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=heads,
        kv_channels=hidden // heads,
        ffn_hidden_size=inner,
        vocab_size=c.positive_int("vocab_size"),
        normalization="LayerNorm",
        norm_epsilon=c.positive_float("layer_norm_epsilon", default=1e-5),
        swiglu=False,
        activation=activations[act],
        position_embedding_type="learned_absolute",
        max_position_embeddings=c.positive_int("n_positions", default=1024),
        rotary_base=10000.0,
        rope_scaling_factor=None,
        add_bias_linear=True,
        add_qkv_bias=False,
        tied=bool(c.optional("tie_word_embeddings", True)),
        dtype=_dtype(c),
    )


def _rope(c: "_Checker") -> "tuple[float, Optional[float]]":
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
        "null or rope_type 'llama3' (linear, dynamic, yarn, longrope, ... are not " "supported)",
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


def _dtype(c: "_Checker") -> str:
    value = c.raw.get("dtype", c.raw.get("torch_dtype")) or "float32"
    c.require(
        value in ("float32", "bfloat16", "float16"), "dtype", value, "float32, bfloat16 or float16"
    )
    return value


class _Checker:
    """Reads keys of a config dict, remembering which were looked at; every failure is a
    ValueError naming the file, the key, its value and what was expected."""

    def __init__(self, raw: Dict[str, Any], where: str, family: str):
        self.raw, self.where, self.family = raw, where, family
        self._seen = set(_IGNORED)
        for key in ("quantization_config", "pruned_heads", "is_decoder"):
            value = raw.get(key)
            if value:
                self.fail(
                    key,
                    value,
                    "absent (quantized / pruned / decoder-with-cross-attention "
                    "models are not supported)",
                )
            self._seen.add(key)

    def fail(self, key: str, value: Any, expected: str) -> None:
        raise ValueError(
            f"{self.where}: {key}={json.dumps(value)} is not supported for model_type "
            f"{self.family!r}; expected {expected}"
        )

    def require(self, condition: bool, key: str, value: Any, expected: str) -> None:
        if not condition:
            self.fail(key, value, expected)

    def seen(self, *keys: str) -> None:
        self._seen.update(keys)

    def optional(self, key: str, default: Any) -> Any:
        self._seen.add(key)
        return self.raw.get(key, default) if self.raw.get(key) is not None else default

    def expect(self, key: str, value: Any, expected: str, default: Any = None, allow=None) -> None:
        got = self.optional(key, default)
        ok = allow(got) if allow is not None else got == value
        self.require(ok, key, got, expected)

    def positive_int(self, key: str, default: Optional[int] = None) -> int:
        value = self.optional(key, default)
        self.require(isinstance(value, int) and value >= 1, key, value, "a positive integer")
        return value

    def positive_float(self, key: str, default: Optional[float] = None) -> float:
        value = self.optional(key, default)
        ok = isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
        self.require(ok, key, value, "a number > 0")
        return float(value)

    def refuse_unknown(self) -> None:
        unknown = sorted(set(self.raw) - self._seen)
        if unknown:
            key = unknown[0]
            raise ValueError(
                f"{self.where}: {key}={json.dumps(self.raw[key])} is an option the converter "
                f"does not know for model_type {self.family!r} (unknown: {', '.join(unknown)}); "
                "refusing rather than building a possibly different model"
            )


def resolve_hf_model(config, explicit=None):
    """``config`` (a ``TrainingConfig``) with ``--hf-model DIR``'s model settings filled in.

    Each model option not given explicitly takes config.json's value; one given explicitly
    with another value is a ValueError naming the flag and both values. ``explicit``: the
    fields given on the command line (None: those that differ from their defaults). With
    ``--data-path`` and no ``--tokenizer``, the tokenizer is DIR's (``tokenizer.json``).
    Idempotent.
    """
    from dataclasses import fields, replace

    from megatron.training.arguments import flag_of

    if config.hf_model is None:
        return config
    arch, _ = read_hf_config(config.hf_model)
    defaults = {f.name: f.default for f in fields(config)}
    changes, conflicts = {}, []
    for name, value in training_settings(arch).items():
        current = getattr(config, name)
        if current == value:
            continue
        given = name in explicit if explicit is not None else current != defaults[name]
        if not given:
            changes[name] = value
        else:
            conflicts.append(f"{flag_of(name)} {current} (config.json gives {value})")
    if conflicts:
        raise ValueError(
            f"--hf-model {config.hf_model} sets the model from its config.json, but "
            f"{'; '.join(conflicts)}; leave these flags out"
        )
    tokenizer = Path(config.hf_model) / "tokenizer.json"
    if config.data_path is not None and config.tokenizer is None and tokenizer.is_file():
        changes["tokenizer"] = str(config.hf_model)
    return replace(config, **changes)
