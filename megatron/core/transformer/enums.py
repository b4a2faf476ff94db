"""Attention enums (megatron-core 0.16.1's names and values)."""

import enum


class AttnType(enum.Enum):
    """Self- or cross-attention."""

    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """How attention is masked; this core implements ``causal`` (and ``padding``/``no_mask``
    specs are accepted: the GPT is always causal)."""

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
