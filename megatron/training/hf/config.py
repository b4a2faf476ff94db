"""HuggingFace ``config.json`` <-> the GPT architecture this core builds.

``read_hf_config(directory)`` reads ``config.json`` (no ``transformers`` needed) and returns an
``HFArchitecture``: the family (one of ``families.REGISTRY``) and every setting our GPT needs.
Every key of ``config.json`` is either mapped, checked against the one value we can express,
or known to leave the weights' meaning unchanged (generation defaults, token ids,
bookkeeping, dropout probabilities); anything else is refused with a ``ValueError`` naming the
key and its value, so a converted model is never silently a different model. What each
family reads and writes lives in its module under ``families/``; this module dispatches.

``hf_config_for_export`` goes back: the original ``config.json`` when the model came from one,
else a fresh one written by the first family that writes the trained model faithfully: its
``config.json`` reads back as the same model (``read(write(x)) == x``; no family knows about
the others). Per direction, one function: ``settings_of_hf_config`` (HF config -> the
trainer's settings) and ``hf_config_of_settings`` (settings -> HF config).
"""

import json
from collections import defaultdict
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from megatron.core.config_rules import moe_layer_pattern
from megatron.training.hf.families import REGISTRY
from megatron.training.hf.families.moe import (
    WRITTEN_ROUTING,
    moe_architecture_fields,
    written_moe_layer_freq,
)
from megatron.training.hf.family import ConfigReader, HFArchitecture
from megatron.training.hf.target import tensor_names
from megatron.training.model_settings import resolved_model

FAMILIES = tuple(REGISTRY)
__all__ = [
    "FAMILIES",
    "HFArchitecture",
    "read_hf_config",
    "architecture_from_config",
    "hf_config_for_export",
    "training_settings",
    "architecture_from_model_settings",
    "hf_config_of_settings",
    "settings_of_hf_config",
]


def read_hf_config(directory) -> "tuple[HFArchitecture, Dict[str, Any]]":
    """(architecture, the raw config dict) of the HuggingFace model in ``directory``."""
    path = Path(directory) / "config.json"
    if Path(directory).is_file():
        raise NotADirectoryError(
            f"HuggingFace model directory {str(directory)!r} is a file, not a directory; "
            f"expected the folder holding config.json and the safetensors (e.g. "
            f"{str(Path(directory).parent)!r})"
        )
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
    arch = architecture_from_config(raw, str(path))
    keys = tensor_names(directory)
    if keys is not None:  # the multi-token prediction layers the checkpoint holds
        mtp = REGISTRY[arch.family].mtp_layers(arch, raw, keys, str(directory))
        arch = replace(arch, mtp_num_layers=mtp)
    return arch, raw


def architecture_from_config(raw: Dict[str, Any], where: str = "config.json") -> HFArchitecture:
    """The architecture of a ``config.json`` dict; ValueError naming what we cannot express.
    Without the tensors, no multi-token prediction depths (``read_hf_config`` counts them)."""
    model_type = raw.get("model_type")
    if model_type not in REGISTRY:
        raise ValueError(
            f"{where}: model_type={model_type!r} is not supported; expected one of "
            f"{', '.join(FAMILIES)}"
        )
    family = REGISTRY[model_type]
    reader = ConfigReader(raw, where, model_type)
    architectures = raw.get("architectures")
    if architectures is not None and list(architectures) != [family.architecture]:
        raise ValueError(
            f"{where}: architectures={json.dumps(architectures)} is not supported; expected "
            f"{json.dumps([family.architecture])} (a causal language model)"
        )
    arch = family.read(reader)
    reader.refuse_unknown()
    return arch


def hf_config_for_export(
    arch: HFArchitecture, original: Optional[Dict[str, Any]], dtype: str
) -> Dict[str, Any]:
    """The ``config.json`` of an exported model: ``original`` (the imported one) with its
    dtype updated, or a fresh one for ``arch``."""
    if original is not None:
        config = dict(original)
        config.pop("torch_dtype", None)
    else:
        config = REGISTRY[arch.family].write(arch)
    config["dtype"] = dtype
    return config


# Multi-latent attention's fields (HFArchitecture and trainer settings alike): settings only
# of an MLA model.
MLA_FIELDS = (
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
    "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_scaling_factor",
    "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
)  # fmt: skip
_YARN_FIELDS = MLA_FIELDS[7:]

# HFArchitecture fields that are not the trainer setting of the same name -> the settings
# they give; every other field that names a TrainingConfig option is that option's value.
TRANSLATED: Dict[str, Callable[[HFArchitecture], Dict[str, Any]]] = {
    "family": lambda a: {},
    "dtype": lambda a: {},
    "activation": lambda a: {
        "openai_gelu": a.activation == "gelu_tanh",
        "quick_geglu": a.activation == "quick_gelu",
    },
    "window_attn_skip_freq": lambda a: {
        "window_attn_skip_freq": (
            list(a.window_attn_skip_freq)
            if isinstance(a.window_attn_skip_freq, tuple)
            else a.window_attn_skip_freq
        )
    },
    "max_position_embeddings": lambda a: {
        "max_position_embeddings": (
            None if a.position_embedding_type in ("rope", "yarn") else a.max_position_embeddings
        )
    },
    "rope_scaling_factor": lambda a: {
        "use_rope_scaling": a.rope_scaling_factor is not None,
        "rope_scaling_factor": a.rope_scaling_factor or 8.0,
    },
    "add_bias_linear": lambda a: {"disable_bias_linear": not a.add_bias_linear},
    "tied": lambda a: {"untie_embeddings_and_output_weights": not a.tied},
    "window_size": lambda a: {
        "window_size": None if a.window_size is None else list(a.window_size)
    },
    "num_moe_experts": lambda a: {"num_experts": a.num_moe_experts},
    "moe_layer_freq": lambda a: {"moe_layer_freq": written_moe_layer_freq(a)},
}


def training_settings(arch: HFArchitecture) -> Dict[str, Any]:
    """The trainer's model settings (``TrainingConfig`` fields) that build ``arch``: each
    field by its name or through ``TRANSLATED``. A MoE model's: softmax routing without
    scaling, groups or expert bias (``WRITTEN_ROUTING``), as the families compute it; no
    router loss: HuggingFace's ``router_aux_loss_coef`` is a different loss
    (docs/huggingface.md), ``--moe-aux-loss-coeff`` and ``--moe-z-loss-coeff`` stay the
    user's choice."""
    options = _option_names()
    moe = arch.num_moe_experts is not None
    out: Dict[str, Any] = {}
    for f in fields(HFArchitecture):
        if f.name.startswith("moe_") and not moe:
            continue
        if f.name in TRANSLATED:
            out.update(TRANSLATED[f.name](arch))
        elif f.name in options:
            out[f.name] = getattr(arch, f.name)
    return {**WRITTEN_ROUTING, **out} if moe else out


def _option_names() -> set:
    from megatron.training.arguments import TrainingConfig  # no torch

    return {f.name for f in fields(TrainingConfig)}


def settings_of_hf_config(raw: Dict[str, Any], where: str = "config.json") -> Dict[str, Any]:
    """HF config -> settings: the trainer's model settings of a ``config.json`` dict."""
    return training_settings(architecture_from_config(raw, where))


def hf_config_of_settings(settings: Dict[str, Any]) -> Dict[str, Any]:
    """Settings -> HF config: the fresh ``config.json`` (without ``dtype``) of a model our
    trainer built, in the first family that writes it faithfully."""
    arch = architecture_from_model_settings(settings)
    return REGISTRY[arch.family].write(arch)


def architecture_from_model_settings(settings: Dict[str, Any]) -> HFArchitecture:
    """The HuggingFace family and architecture of a model our trainer built (its saved run
    settings): the first family (registry order) whose ``config.json`` reads back as the
    same model, ``read(write(x)) == x``; ValueError when none does (multi-token prediction
    depths: only a family that carries them, DeepSeek-V3)."""
    full = _with_defaults(settings)
    base = _architecture_of_settings(full)
    for name, family in REGISTRY.items():
        arch = replace(base, family=name)
        if _round_trips(family, arch, full):
            return arch
    if base.mtp_num_layers:
        _refuse_mtp_family(base, full)
    hints = [f.settings_hint for f in REGISTRY.values() if f.settings_hint]
    raise ValueError(
        "export: this model (normalization={!r}, swiglu={}, position_embedding_type={!r}, "
        "biases={}, add_qkv_bias={}) matches no HuggingFace family we write; expected "
        "one of: {}".format(
            full["normalization"],
            bool(full["swiglu"]),
            full["position_embedding_type"],
            not full["disable_bias_linear"],
            bool(full["add_qkv_bias"]),
            "; ".join(hints),
        )
    )


def _refuse_mtp_family(base: HFArchitecture, settings: Dict[str, Any]) -> None:
    """ValueError naming ``mtp_num_layers`` when the model without its MTP depths has a
    family, but none that writes the depths."""
    plain = replace(base, mtp_num_layers=None)
    for name, family in REGISTRY.items():
        if _round_trips(family, replace(plain, family=name), dict(settings, mtp_num_layers=None)):
            carriers = [n for n, f in REGISTRY.items() if f.carries_mtp]
            raise ValueError(
                f"export: this model has mtp_num_layers={base.mtp_num_layers} (multi-token "
                f"prediction depths), which the {name} HuggingFace format cannot carry; "
                f"expected a {' or '.join(carriers)} model ("
                + "; ".join(REGISTRY[n].settings_hint or n for n in carriers)
                + "), or one without --mtp-num-layers"
            )


def _round_trips(family, arch: HFArchitecture, settings: Dict[str, Any]) -> bool:
    """Whether ``family`` writes ``arch`` as a ``config.json`` that reads back (with the
    family's refusals) as the model ``settings`` describe (the MTP depths: those the written
    config declares, the tensors being written with it)."""
    try:  # a family writes only what it has keys for (GPT-2: no silu; a MoE one: no dense)
        written = family.write(arch)
        read = architecture_from_config(written)
        read = replace(read, mtp_num_layers=family.declared_mtp_layers(written))
        back = training_settings(read)
    except (KeyError, TypeError, ValueError):
        return False
    keys = set(back) | set(training_settings(arch))  # the MoE ones of either side
    return model_meaning({k: back.get(k) for k in keys}) == model_meaning(
        {k: settings.get(k) for k in keys}
    )


def model_meaning(settings: Dict[str, Any]) -> Dict[str, Any]:
    """``settings`` (``training_settings``'s keys) with those that leave the model unchanged
    dropped or normalized: rotary settings of learned positions, the position table of RoPE,
    the rope factor without scaling, --openai-gelu under --swiglu, a q/k/v bias beside all
    biases, the whole-projection switch without q/k norms, MoE settings of a dense model,
    a shared-expert gate without a shared expert, the dense FFN size when every layer is a
    MoE layer; the default attention scale written out (1 / sqrt(kv_channels))."""
    out = dict(settings)
    if out["position_embedding_type"] in ("rope", "yarn"):
        out.pop("max_position_embeddings")
        out["rotary_base"] = float(out["rotary_base"])
        out["rotary_percent"] = float(out["rotary_percent"])
    else:
        for key in ("rotary_base", "use_rope_scaling", "rope_scaling_factor", "rotary_percent"):
            out.pop(key)
    if not out.get("use_rope_scaling"):
        out.pop("rope_scaling_factor", None)
    if out["position_embedding_type"] != "yarn":
        for key in _YARN_SETTINGS[1:]:  # (rotary_scaling_factor: MLA's too, _mla_meaning)
            out.pop(key, None)
    out["window_attn_skip_freq"] = _skip_pattern(
        out.get("window_attn_skip_freq"), out["window_size"], out["num_layers"]
    )
    out["glu_linear_offset"] = float(out.get("glu_linear_offset") or 0.0) or None
    out["openai_gelu"] = bool(out["openai_gelu"]) and not out["swiglu"]
    out["add_qkv_bias"] = bool(out["add_qkv_bias"]) and bool(out["disable_bias_linear"])
    out["qk_layernorm_whole_projection"] = bool(
        out["qk_layernorm_whole_projection"] and out["qk_layernorm"]
    )
    out["window_size"] = list(out["window_size"]) if out["window_size"] else None
    out["norm_epsilon"] = float(out["norm_epsilon"])
    out["mtp_num_layers"] = out.get("mtp_num_layers") or None  # 0: none
    _mla_meaning(out)
    if "softmax_scale" in out and out["softmax_scale"] is None:  # the default, written out
        kv = out.get("kv_channels") or out["hidden_size"] // out["num_attention_heads"]
        out["softmax_scale"] = kv**-0.5
    out = {k: None if v is False else v for k, v in out.items()}  # off: False or absent
    if out["num_experts"] is None:
        return {k: v for k, v in out.items() if not k.startswith("moe_")}
    pattern = list(moe_layer_pattern(out["moe_layer_freq"], out["num_layers"]))
    out["moe_layer_freq"] = pattern
    out["moe_ffn_hidden_size"] = out["moe_ffn_hidden_size"] or out["ffn_hidden_size"]
    if out.get("moe_router_topk_scaling_factor") in (None, 1, 1.0):  # x 1: no scaling
        out["moe_router_topk_scaling_factor"] = None
    shared = out["moe_shared_expert_intermediate_size"] is not None
    out["moe_shared_expert_gate"] = bool(out["moe_shared_expert_gate"]) and shared or None
    if all(pattern):
        out.pop("ffn_hidden_size")
    return out


_YARN_SETTINGS = (
    "rotary_scaling_factor",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "no_yarn_correction_range_round_to_int",
)


def _skip_pattern(freq, window, layers: int) -> Optional[list]:
    """``window_attn_skip_freq`` as one 0/1 per layer (None: no window, or every layer
    slides), so that 2 and [1, 0, 1, 0] compare equal."""
    if not window or freq is None:
        return None
    if isinstance(freq, int):
        pattern = [int((i + 1) % freq != 0) for i in range(layers)]
    else:
        pattern = [int(v) for v in freq]
    return None if all(pattern) else pattern


def _mla_meaning(out: Dict[str, Any]) -> None:
    """Multi-latent attention's settings normalized in place: none without it; with it the
    rope type resolved (MLATransformerConfig's default: yarn), the yarn settings dropped
    under plain rope, the unused GQA head settings dropped."""
    if not out.get("multi_latent_attention"):
        for key in MLA_FIELDS:
            if key != "rotary_scaling_factor" or out["position_embedding_type"] != "yarn":
                out.pop(key, None)
        return
    out["rope_type"] = out.get("rope_type") or "yarn"
    for key in ("kv_channels", "num_query_groups"):
        out.pop(key, None)
    if out["rope_type"] == "rope":
        for key in _YARN_FIELDS:
            out.pop(key, None)
    else:
        out["rotary_scaling_factor"] = out.get("rotary_scaling_factor") or 1.0  # the default
        for key in ("rotary_scaling_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            out[key] = float(out[key])


def _with_defaults(settings: Dict[str, Any]) -> Dict[str, Any]:
    """Recorded settings with the options they lack (or hold as None) at their defaults,
    derived ones resolved (``resolved_model``)."""
    from megatron.training.arguments import TrainingConfig  # no torch

    defaults = {f.name: f.default for f in fields(TrainingConfig)}
    given = {k: v for k, v in settings.items() if v is not None}
    return defaultdict(lambda: None, resolved_model({**defaults, **given}))


def _activation_of_settings(settings: Dict[str, Any]) -> str:
    if settings["quick_geglu"]:
        return "quick_gelu"
    if settings["swiglu"]:
        return "silu"
    return "gelu_tanh" if settings["openai_gelu"] else "gelu"


def _skip_tuple(settings: Dict[str, Any]):
    """``window_attn_skip_freq`` for ``HFArchitecture``: None (every layer slides), the int
    N as given, else one 0/1 per layer."""
    freq = settings["window_attn_skip_freq"]
    pattern = _skip_pattern(freq, settings["window_size"], settings["num_layers"])
    if pattern is None:
        return None
    return freq if isinstance(freq, int) else tuple(pattern)


def _architecture_of_settings(settings: Dict[str, Any]) -> HFArchitecture:
    """The architecture (no family yet) of a model our trainer built; ``settings`` has every
    option (``_with_defaults``). A field named as an option takes its value; the
    ``TRANSLATED`` ones (and the MoE fields) are computed back here."""
    options = _option_names()
    same = {
        f.name: settings[f.name]
        for f in fields(HFArchitecture)
        if f.name in options and f.name not in TRANSLATED and not f.name.startswith("moe_")
    }
    swiglu, bias = bool(settings["swiglu"]), not settings["disable_bias_linear"]
    rope = settings["position_embedding_type"] in ("rope", "yarn")
    translated = dict(
        family="",
        swiglu=swiglu,
        activation=_activation_of_settings(settings),
        position_embedding_type=settings["position_embedding_type"] if rope else "learned_absolute",
        max_position_embeddings=settings["max_position_embeddings"],
        rotary_base=float(settings["rotary_base"]),
        rope_scaling_factor=(
            settings["rope_scaling_factor"] if settings["use_rope_scaling"] else None
        ),
        add_bias_linear=bias,
        add_qkv_bias=bool(settings["add_qkv_bias"]) and not bias,
        tied=not settings["untie_embeddings_and_output_weights"],
        window_size=tuple(settings["window_size"]) if settings["window_size"] else None,
        window_attn_skip_freq=_skip_tuple(settings),
        mtp_num_layers=settings["mtp_num_layers"] or None,  # 0 (dropped): none
    )
    return HFArchitecture(**{**same, **translated}, **moe_architecture_fields(settings))
