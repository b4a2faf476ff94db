"""The model a run's settings describe, with the derived defaults resolved in one place.

A model setting left out takes a value derived from others, as megatron's arguments (and
megatron-core's ``TransformerConfig``) derive it:

    num_query_groups        = num_attention_heads        (one key/value head per head)
    ffn_hidden_size         = 4 x hidden_size
    kv_channels             = hidden_size // num_attention_heads
    max_position_embeddings = seq_length                 (rows of the learned table)

``resolved_model`` applies these to a ``TrainingConfig`` or to the plain settings recorded
in a checkpoint (which may predate a setting: only what the given keys determine is
resolved). The validation of flags, the resume comparison (``checkpointing``) and the
HuggingFace export (``hf.config``) all read the model through it. No torch here.
"""

from dataclasses import fields, is_dataclass
from typing import Any, Callable, Dict, Mapping, Tuple, Union

# setting -> (the settings it is derived from, the rule)
DERIVED_DEFAULTS: Dict[str, Tuple[Tuple[str, ...], Callable[[Mapping[str, Any]], Any]]] = {
    "num_query_groups": (("num_attention_heads",), lambda s: s["num_attention_heads"]),
    "ffn_hidden_size": (("hidden_size",), lambda s: 4 * s["hidden_size"]),
    "kv_channels": (
        ("hidden_size", "num_attention_heads"),
        lambda s: s["hidden_size"] // s["num_attention_heads"],
    ),
    "max_position_embeddings": (("seq_length",), lambda s: s["seq_length"]),
}


def resolved_model(settings: Union[Mapping[str, Any], Any]) -> Dict[str, Any]:
    """``settings`` (a ``TrainingConfig`` or a mapping of its field names) as a dict, with
    each derived default above filled in where it is None or absent and the settings it
    derives from are present."""
    if is_dataclass(settings):
        out = {f.name: getattr(settings, f.name) for f in fields(settings)}
    else:
        out = dict(settings)
    for name, (sources, rule) in DERIVED_DEFAULTS.items():
        if out.get(name) is None and all(out.get(s) is not None for s in sources):
            out[name] = rule(out)
    return out
