"""HuggingFace ``config.json`` <-> the GPT architecture this core builds.

``read_hf_config(directory)`` reads ``config.json`` (no ``transformers`` needed) and returns an
``HFArchitecture``: the family (one of ``families.REGISTRY``) and every setting our GPT needs.
Every key of ``config.json`` is either mapped, checked against the one value we can express,
or known to leave the weights' meaning unchanged (generation defaults, token ids,
bookkeeping, dropout probabilities); anything else is refused with a ``ValueError`` naming the
key and its value, so a converted model is never silently a different model. What each
family reads and writes lives in its module under ``families/``; this module dispatches.

``hf_config_for_export`` goes back: the original ``config.json`` when the model came from one,
else a fresh one written by the family that claims the trained model's settings.
"""

import json
from pathlib import Path
from typing import Any, Dict, Optional

from megatron.training.hf.families import REGISTRY
from megatron.training.hf.families.moe import (
    WRITTEN_ROUTING,
    moe_architecture_fields,
    written_moe_layer_freq,
)
from megatron.training.hf.family import ConfigReader, HFArchitecture
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
    return architecture_from_config(raw, str(path)), raw


def architecture_from_config(raw: Dict[str, Any], where: str = "config.json") -> HFArchitecture:
    """The architecture of a ``config.json`` dict; ValueError naming what we cannot express."""
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
        "qk_layernorm": arch.qk_layernorm,
        "qk_layernorm_whole_projection": arch.qk_layernorm_whole_projection,
        "num_experts": arch.num_moe_experts,
        **moe_training_settings(arch),
    }


def moe_training_settings(arch: HFArchitecture) -> Dict[str, Any]:
    """The trainer's MoE model settings of ``arch`` (none for a dense model): softmax
    routing without scaling, groups or expert bias, as the families compute it. No router
    loss: HuggingFace's ``router_aux_loss_coef`` is a different loss (docs/huggingface.md);
    ``--moe-aux-loss-coeff`` and ``--moe-z-loss-coeff`` stay the user's choice."""
    if arch.num_moe_experts is None:
        return {}
    return {
        "moe_router_topk": arch.moe_router_topk,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_router_pre_softmax": arch.moe_router_pre_softmax,
        "moe_shared_expert_intermediate_size": arch.moe_shared_expert_intermediate_size,
        "moe_shared_expert_gate": arch.moe_shared_expert_gate,
        "moe_layer_freq": written_moe_layer_freq(arch),
        **WRITTEN_ROUTING,
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
    family = next((name for name, f in REGISTRY.items() if f.claims(model)), None)
    if family is None:
        hints = [f.settings_hint for f in REGISTRY.values() if f.settings_hint]
        raise ValueError(
            "export: this model (normalization={!r}, swiglu={}, position_embedding_type={!r}, "
            "biases={}, add_qkv_bias={}) matches no HuggingFace family we write; expected "
            "one of: {}".format(
                norm,
                swiglu,
                settings.get("position_embedding_type"),
                bias,
                qkv_bias,
                "; ".join(hints),
            )
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
        window_size=tuple(settings["window_size"]) if settings.get("window_size") else None,
        qk_layernorm=bool(settings.get("qk_layernorm", False)),
        qk_layernorm_whole_projection=bool(settings.get("qk_layernorm_whole_projection", False)),
        **moe_architecture_fields(model),
    )
