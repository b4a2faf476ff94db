"""Rotary position embeddings applied in one fused pass (``apply_rope_fusion``): the one
rotation of ``megatron.core.rope`` compiled by ``jit_fuser``."""

import torch

from megatron.core.rope import fused_rotate


def fused_apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, mscale: float = 1.0
) -> torch.Tensor:
    """``t`` [s, b, n, d] rotated by ``freqs`` [s, 1, 1, r]: t * cos + rotate(t) * sin on the
    first r channels (the rest pass through), as ``rope.apply_rotary_pos_emb``."""
    return fused_rotate()(t, freqs.to(t.device), interleaved, float(mscale))
