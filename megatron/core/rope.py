"""Rotary position embeddings applied to queries and keys: the maths, on a floor below the
layers that use it (``transformer.attention``, ``fusions.fused_rope``); megatron-core's
``models.common.embeddings.rope_utils`` re-exports it."""

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core.jit import jit_fuser


def apply_rotary_pos_emb(
    t: Tensor,
    freqs: Tensor,
    config,
    cu_seqlens: Optional[Tensor] = None,
    mscale: float = 1.0,
    cp_group: Optional[dist.ProcessGroup] = None,
) -> Tensor:
    """Rotate the first r channels of ``t`` [s, b, n, d] by ``freqs`` [s, 1, 1, r] (``rotate``).
    ``config.apply_rope_fusion``: the same function compiled (``fused_rotate``).
    """
    if cu_seqlens is not None:
        raise NotImplementedError("apply_rotary_pos_emb: packed sequences are not supported")
    fused = getattr(config, "apply_rope_fusion", False)
    function = fused_rotate() if fused else rotate
    return function(t, freqs.to(t.device), config.rotary_interleaved, float(mscale))


def rotate(t: Tensor, freqs: Tensor, interleaved: bool, mscale: float) -> Tensor:
    """t * cos + rotate(t) * sin on the first r = freqs.shape[-1] channels of ``t``,
    rotate(x1, x2) = (-x2, x1) over halves (``interleaved``: over even/odd channels);
    cos and sin are scaled by ``mscale``; channels beyond r pass through."""
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


@functools.lru_cache(maxsize=None)
def fused_rotate() -> Callable[..., Tensor]:
    """``rotate`` compiled by ``jit_fuser`` (made on first use: compiling is not free)."""
    return jit_fuser(rotate)
