"""Rotary position embeddings: the angles of each position (``RotaryEmbedding``, YaRN's
``YarnRotaryEmbedding``) and their application to queries and keys, on a floor below the
layers that use them (``transformer.attention``, ``transformer.multi_latent_attention``,
``fusions.fused_rope``, ``models.gpt``); megatron-core's ``models.common.embeddings``
modules re-export them.

For rotary dimension r = kv_channels * rotary_percent, inv_freq_i = base^(-2i / r) for
i < r/2, and position p has angles p * inv_freq (divided by ``seq_len_interpolation_factor``
when set). YaRN blends interpolated (``inv_freq / scaling_factor``) and original frequencies
by a linear ramp between the correction dims of ``beta_fast`` and ``beta_slow`` rotations
over ``original_max_position_embeddings``, and scales cos and sin by
mscale(factor, mscale) / mscale(factor, mscale_all_dim). Tables in float32.
"""

import functools
import math
from typing import Callable, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core.context_parallel import cp_shard_positions
from megatron.core.jit import jit_fuser
from megatron.core.process_groups_config import get_pg_rank, get_pg_size


class LayerAngles(NamedTuple):
    """The RoPE angles of a model whose sliding-window layers have a base of their own
    (``TransformerConfig.local_rotary_base``, Gemma 3): ``full`` for the full-attention
    layers, ``local`` for the windowed ones; each layer's attention takes its own."""

    full: Tensor
    local: Tensor

    def of_layer(self, window_layer: bool) -> Tensor:
        return self.local if window_layer else self.full


class RotaryEmbedding(torch.nn.Module):
    """RoPE angles (megatron-core 0.16.1's constructor). ``rope_scaling``: Llama 3.x frequency
    scaling by ``rope_scaling_factor`` (``llama3_scaled_inv_freq``). ``mscale``: a cos/sin
    scale (YaRN's), None for none; with one, ``forward`` returns (angles, mscale), as
    megatron-core's ``YarnRotaryEmbedding`` does. ``cached_angles``: the last length's angles
    kept on the activations' device (GPTModel's and ``MLASelfAttention``'s)."""

    mscale: Optional[float] = None
    _angles_cache: Optional[tuple] = None  # (key, (angles on the device, cos/sin scale))

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: Optional[float] = None,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        use_cpu_initialization: bool = False,
        cp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__()
        dim = kv_channels if rotary_percent >= 1.0 else int(kv_channels * rotary_percent)
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.cp_group = cp_group
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        self.inv_freq = 1.0 / (rotary_base**exponents)  # a plain attribute: not in state_dict
        if rope_scaling:
            self.inv_freq = llama3_scaled_inv_freq(self.inv_freq, rope_scaling_factor)

    def forward(
        self,
        max_seq_len: int,
        offset: int = 0,
        packed_seq: bool = False,
        cp_group: Optional[dist.ProcessGroup] = None,
    ) -> Union[Tensor, Tuple[Tensor, float]]:
        """Angles [s_local, 1, 1, r] of this CP rank's positions of a ``max_seq_len`` sequence
        (all of them with no CP group or ``packed_seq``), each angle repeated for the two
        halves (or, interleaved, the two members) of a rotated pair; (angles, ``mscale``)
        when the embedding has a cos/sin scale."""
        cp_group = self.cp_group if cp_group is None else cp_group
        cp_size, cp_rank = get_pg_size(cp_group), get_pg_rank(cp_group)
        if packed_seq or cp_size == 1:
            positions = torch.arange(max_seq_len)
        else:
            positions = cp_shard_positions(max_seq_len, cp_size, cp_rank)
        positions = positions.to(torch.float32) + offset
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = torch.outer(positions, self.inv_freq)
        if self.rotary_interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        emb = emb[:, None, None, :]
        return emb if self.mscale is None else (emb, self.mscale)

    def cached_angles(
        self,
        max_seq_len: int,
        device: torch.device,
        cp_group: Optional[dist.ProcessGroup] = None,
    ) -> Tuple[Tensor, float]:
        """(``forward``'s angles of this CP rank's positions on ``device``, cos/sin scale (1.0
        without one)). The last call's are kept, keyed by length, CP size and rank and device:
        built on the host and copied to the device once, not once per layer and microbatch.
        After changing the frequencies or ``seq_len_interpolation_factor``: ``clear_cache``."""
        cp_group = self.cp_group if cp_group is None else cp_group
        key = (max_seq_len, get_pg_size(cp_group), get_pg_rank(cp_group), device)
        cached = self._angles_cache
        if cached is None or cached[0] != key:
            angles = self(max_seq_len, cp_group=cp_group)
            angles, mscale = angles if isinstance(angles, tuple) else (angles, 1.0)
            self._angles_cache = cached = (key, (angles.to(device), mscale))
        return cached[1]

    def clear_cache(self) -> None:
        """Forget the angles ``cached_angles`` kept."""
        self._angles_cache = None


class YarnRotaryEmbedding(RotaryEmbedding):
    """YaRN angles (megatron-core 0.16.1's constructor; the module docstring);
    ``forward`` returns (angles [s_local, 1, 1, dim], cos/sin scale)."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: Optional[float] = None,
        rotary_base: float = 10000.0,
        scaling_factor: float = 1.0,
        original_max_position_embeddings: int = 4096,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        mscale: float = 1.0,
        mscale_all_dim: float = 0.0,
        correction_range_round_to_int: bool = True,
        use_cpu_initialization: bool = False,
        cp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__(
            kv_channels,
            rotary_percent,
            rotary_interleaved,
            seq_len_interpolation_factor,
            rotary_base,
            use_cpu_initialization=use_cpu_initialization,
            cp_group=cp_group,
        )
        self.inv_freq = yarn_inv_freq(
            kv_channels,
            rotary_base,
            scaling_factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            correction_range_round_to_int,
        )
        self.mscale = yarn_cos_sin_scale(scaling_factor, mscale, mscale_all_dim)


def llama3_scaled_inv_freq(
    inv_freq: Tensor,
    factor: float,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> Tensor:
    """Llama 3.x frequency scaling (megatron-core's defaults for the last three values).

    With wavelength w = 2 pi / f and L = ``original_max_position_embeddings``: f is kept
    when w < L / high_freq_factor, divided by ``factor`` when w > L / low_freq_factor, and in
    between mixed as (1 - a) f / factor + a f with a = (L / w - low) / (high - low).
    """
    wavelength = 2 * math.pi / inv_freq
    long_wave = original_max_position_embeddings / low_freq_factor
    short_wave = original_max_position_embeddings / high_freq_factor
    mix = (original_max_position_embeddings / wavelength - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    scaled = torch.where(wavelength > long_wave, inv_freq / factor, inv_freq)
    mixed = (1 - mix) * scaled / factor + mix * scaled
    middle = (wavelength >= short_wave) & (wavelength <= long_wave)
    return torch.where(middle, mixed, scaled)


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
    whole = rot_dim == t.shape[-1]  # no channels pass through: no slice, no final copy
    rotated = t if whole else t[..., :rot_dim]
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    cos, sin = cos.to(t.dtype), sin.to(t.dtype)
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        half_turn = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        x1, x2 = rotated.chunk(2, dim=-1)
        half_turn = torch.cat((-x2, x1), dim=-1)
    out = rotated * cos + half_turn * sin  # (contiguous, as the concatenation was)
    return out.contiguous() if whole else torch.cat((out, t[..., rot_dim:]), dim=-1)


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


def yarn_config_mscales(config) -> Tuple[float, float]:
    """(``yarn_mscale``, ``yarn_mscale_all_dim``) of a TransformerConfig, None read as YaRN's
    defaults 1.0 and 0.0."""
    mscale = config.yarn_mscale if config.yarn_mscale is not None else 1.0
    return mscale, config.yarn_mscale_all_dim or 0.0


def yarn_cos_sin_scale(scale: float, mscale: float, mscale_all_dim: float) -> float:
    """YaRN's cos/sin scale: mscale(scale, mscale) / mscale(scale, mscale_all_dim)."""
    return yarn_get_mscale(scale, mscale) / yarn_get_mscale(scale, mscale_all_dim)
