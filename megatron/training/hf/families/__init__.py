"""The HuggingFace families the converter reads and writes: one module each, one line each.

To add a family: write ``families/NAME.py`` with a ``Family`` subclass (its ``config.json``
reading and writing, its weight table, its refusals) and ``FAMILY = NAME()``, then add one
line below. Order matters only on export of a model trained from scratch: the first family
whose ``config.json`` reads back as the same model writes it (``read(write(x)) == x``).
"""

from typing import Dict

from megatron.training.hf.families import (
    deepseek,
    gemma,
    gpt2,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    olmoe,
    phi3,
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
        olmoe.FAMILY,
        gpt_oss.FAMILY,
        phi3.FAMILY,
        deepseek.FAMILY_V3,
        deepseek.FAMILY_V2,
        gemma.GEMMA2,
        gemma.GEMMA3,
    )
}


def family_of(model_type: str) -> Family:
    """The registered family of ``model_type`` (KeyError when none)."""
    return REGISTRY[model_type]
