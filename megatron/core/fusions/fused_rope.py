"""Rotary position embeddings applied in one fused pass (``apply_rope_fusion``)."""

import torch

from megatron.core.jit import jit_fuser


@jit_fuser
def _rotate(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool, mscale: float):
    rot_dim = freqs.shape[-1]
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    cos = (torch.cos(freqs) * mscale).to(t.dtype)
    sin = (torch.sin(freqs) * mscale).to(t.dtype)
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        half_turn = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        x1, x2 = rotated.chunk(2, dim=-1)
        half_turn = torch.cat((-x2, x1), dim=-1)
    return torch.cat((rotated * cos + half_turn * sin, passed), dim=-1)


def fused_apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, mscale: float = 1.0
) -> torch.Tensor:
    """``t`` [s, b, n, d] rotated by ``freqs`` [s, 1, 1, r]: t * cos + rotate(t) * sin on the
    first r channels (the rest pass through), as ``rope_utils.apply_rotary_pos_emb``."""
    return _rotate(t, freqs.to(t.device), interleaved, float(mscale))
