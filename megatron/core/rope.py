"""Rotary position embeddings applied to queries and keys: the maths, on a floor below the
layers that use it (``transformer.attention``, ``fusions.fused_rope``); megatron-core's
``models.common.embeddings.rope_utils`` re-exports it."""

import functools
import math
from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core.jit import jit_fuser


class LayerAngles(NamedTuple):
    """The RoPE angles of a model whose sliding-window layers have a base of their own
    (``TransformerConfig.local_rotary_base``, Gemma 3): ``full`` for the full-attention
    layers, ``local`` for the windowed ones; each layer's attention takes its own."""

    full: Tensor
    local: Tensor

    def of_layer(self, window_layer: bool) -> Tensor:
        return self.local if window_layer else self.full


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


def yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float,
    beta_slow: float,
    round_to_int: bool = True,
) -> Tensor:
    """YaRN frequencies [dim / 2] (float32): base^(-2i / dim) kept below the ramp's low end,
    divided by ``factor`` above its high end, linearly blended between (the ramp's ends are
    the dims making ``beta_fast`` / ``beta_slow`` turns over the original length)."""
    powers = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra, inter = 1.0 / powers, 1.0 / (factor * powers)  # (megatron-core's and HF's roundings)
    low, high = yarn_correction_range(
        beta_fast, beta_slow, dim, base, original_max_position_embeddings, round_to_int
    )
    keep = 1.0 - yarn_linear_ramp(low, high, dim // 2)
    return inter * (1 - keep) + extra * keep


def yarn_correction_dim(
    rotations: float, dim: int, base: float, max_position_embeddings: int
) -> float:
    """The (fractional) rotary dim whose wavelength makes ``rotations`` turns over
    ``max_position_embeddings`` positions."""
    return (
        dim * math.log(max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))
    )


def yarn_correction_range(
    low_rot: float,
    high_rot: float,
    dim: int,
    base: float,
    max_position_embeddings: int,
    round_to_int: bool = True,
) -> Tuple[float, float]:
    """The ramp's ends, floored / ceiled with ``round_to_int``, clamped to [0, dim - 1]."""
    low = yarn_correction_dim(low_rot, dim, base, max_position_embeddings)
    high = yarn_correction_dim(high_rot, dim, base, max_position_embeddings)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_linear_ramp(low: float, high: float, dim: int) -> Tensor:
    """clamp((i - low) / (high - low), 0, 1) for i < dim (float32)."""
    if low == high:
        high += 0.001
    return ((torch.arange(dim, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """0.1 mscale ln(scale) + 1 for scale > 1, else 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
