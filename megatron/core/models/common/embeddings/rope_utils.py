"""Applying rotary position embeddings to queries and keys."""

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor


def apply_rotary_pos_emb(
    t: Tensor,
    freqs: Tensor,
    config,
    cu_seqlens: Optional[Tensor] = None,
    mscale: float = 1.0,
    cp_group: Optional[dist.ProcessGroup] = None,
) -> Tensor:
    """Rotate the first r channels of ``t`` [s, b, n, d] by ``freqs`` [s, 1, 1, r]:
    t * cos + rotate(t) * sin, rotate(x1, x2) = (-x2, x1) over halves (or, with
    ``config.rotary_interleaved``, over even/odd channels); channels beyond r pass through.
    ``config.apply_rope_fusion``: the same in one compiled function.
    """
    if cu_seqlens is not None:
        raise NotImplementedError("apply_rotary_pos_emb: packed sequences are not supported")
    if getattr(config, "apply_rope_fusion", False):  # one compiled pass
        from megatron.core.fusions.fused_rope import fused_apply_rotary_pos_emb

        return fused_apply_rotary_pos_emb(t, freqs, config.rotary_interleaved, mscale)
    rot_dim = freqs.shape[-1]
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    freqs = freqs.to(t.device)
    cos = (torch.cos(freqs) * mscale).to(t.dtype)
    sin = (torch.sin(freqs) * mscale).to(t.dtype)
    if config.rotary_interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        half_turn = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        x1, x2 = rotated.chunk(2, dim=-1)
        half_turn = torch.cat((-x2, x1), dim=-1)
    return torch.cat((rotated * cos + half_turn * sin, passed), dim=-1)
