"""Attention enums (megatron-core 0.16.1's names and values)."""

import enum

from megatron.core import config_rules


class AttnType(enum.Enum):
    """Self- or cross-attention."""

    self_attn = 1
    cross_attn = 2


class AttnBackend(enum.Enum):
    """The attention kernel family (``TransformerConfig.attention_backend``): ``flash``
    (PyTorch's flash kernel), ``fused`` (cuDNN), ``unfused`` and ``local`` (an explicit score
    matrix), ``auto`` (the kernel PyTorch's SDPA would pick; see
    ``cp_attention.kernel_choice``)."""

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


assert tuple(AttnBackend.__members__) == config_rules.ATTENTION_BACKENDS


class AttnMaskType(enum.Enum):
    """How attention is masked; this core implements ``causal`` (``padding`` specs are
    accepted: the GPT is always causal; the others are refused by ``DotProductAttention``)."""

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
