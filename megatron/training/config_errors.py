"""Errors of the library's configs told in the trainer's words: the flag and the value typed.

The trainer fills ``TransformerConfig``, ``OptimizerConfig``, ``GPTModel`` and the DDP config
from its own fields; an error the library raises names the library's field
(``attention_backend``, ``layernorm_epsilon``). ``name_the_flags`` puts the trainer flags
behind the fields a message mentions, with their values, in front of it::

    attention kernel 'cudnn' (attention_backend / ...) needs CUDA tensors, got cpu
    -> --attention-backend fused: attention kernel 'cudnn' (attention_backend / ...) ...

A field is the ``TrainingConfig`` field of the same name (every option declared in
``arguments.py``), or the one ``LIBRARY_NAMES`` lists for a library field the trainer sets
from a field of another name. A mention is the name as a whole word; a one-word name
(``lr``, ``fp16``) only as ``name=``, so that plain words are not taken for fields. A message
that already names a flag (the trainer's own errors) is left as it is. No torch here.
"""

import re
from dataclasses import fields
from typing import Any, Dict, List, Tuple

from megatron.training.options import option_of

# library field -> the TrainingConfig field it is set from (model.py, training.py)
LIBRARY_NAMES: Dict[str, str] = {
    "layernorm_epsilon": "norm_epsilon",
    "gated_linear_unit": "swiglu",
    "add_bias_linear": "disable_bias_linear",
    "max_sequence_length": "max_position_embeddings",
    "share_embeddings_and_output_weights": "untie_embeddings_and_output_weights",
    "rope_scaling": "use_rope_scaling",
    "lr_warmup_steps": "lr_warmup_iters",
    "lr_decay_steps": "train_iters",
    "fp8": "fp8_format",
    # megatron-core's fusion switches, set by --compile (model.FUSIONS)
    "bias_activation_fusion": "compile",
    "bias_dropout_fusion": "compile",
    "apply_rope_fusion": "compile",
    "persist_layer_norm": "compile",
    "cross_entropy_loss_fusion": "compile",
}


def name_the_flags(message: str, config: Any) -> str:
    """``message`` with ``--flag VALUE`` of each trainer field it mentions in front (module
    docstring); unchanged when it names a flag already or mentions no field."""
    if re.search(r"(^|[\s(`'\"])--[a-z]", message):
        return message
    named: List[str] = []
    for field_name, flag in _mentioned(message, type(config)):
        text = _flag_and_value(flag, field_name, config)
        if text not in named:
            named.append(text)
    return f"{', '.join(named)}: {message}" if named else message


def _mentioned(message: str, config_class: type) -> List[Tuple[str, str]]:
    """``(trainer field, its flag)`` for each field ``message`` mentions, in message order."""
    flags = {f.name: option_of(f).flag for f in fields(config_class)}
    names = {name: name for name in flags}
    names.update({k: v for k, v in LIBRARY_NAMES.items() if v in flags})
    found = []
    for name, field_name in names.items():
        if "_" in name:
            pattern = rf"(?<![\w-]){re.escape(name)}(?![\w-])"
        else:
            pattern = rf"(?<![\w-]){re.escape(name)}="
        hit = re.search(pattern, message)
        if hit:
            found.append((hit.start(), field_name))
    return [(field_name, flags[field_name]) for _, field_name in sorted(found)]


def _flag_and_value(flag: str, field_name: str, config: Any) -> str:
    value = getattr(config, field_name)
    default = next(f.default for f in fields(config) if f.name == field_name)
    if isinstance(default, bool):
        given = value != default
        return flag if given else f"{flag} (not given)"
    if value is None:
        return f"{flag} (not given)"
    if isinstance(value, (list, tuple)):
        return " ".join([flag, *map(str, value)])
    return f"{flag} {value}"
