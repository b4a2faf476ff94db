"""The HuggingFace families the converter reads and writes: one module each, one line each.

To add a family: write ``families/NAME.py`` with a ``Family`` subclass (its ``config.json``
reading and writing, its weight table, its refusals) and ``FAMILY = NAME()``, then add one
line below. Order matters only for ``claims`` (the first family that claims a trained
model's settings writes it).
"""

from typing import Dict

from megatron.training.hf.families import (
    gpt2,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from megatron.training.hf.family import Family

REGISTRY: Dict[str, Family] = {
    family.model_type: family
    for family in (
        llama.FAMILY,
        mistral.FAMILY,
        qwen2.FAMILY,
        qwen3.FAMILY,
        gpt2.FAMILY,
        mixtral.FAMILY,
        qwen2_moe.FAMILY,
        qwen3_moe.FAMILY,
    )
}
# Families we know and cannot express exactly: model_type -> why (the import error says it).
REFUSED: Dict[str, str] = {
    "olmoe": (
        "OLMoE's q_norm / k_norm are RMSNorms over the whole q and k projections (all heads "
        "together, weights [num_attention_heads * head_dim] and [num_key_value_heads * "
        "head_dim]); our qk_layernorm normalizes each head on its own with one [head_dim] "
        "weight, so the model cannot be expressed exactly"
    ),
}


def family_of(model_type: str) -> Family:
    """The registered family of ``model_type`` (KeyError when none)."""
    return REGISTRY[model_type]
