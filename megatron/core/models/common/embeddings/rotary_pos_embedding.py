"""Rotary position embeddings (RoPE): the angles each position rotates query/key pairs by.

For rotary dimension r = kv_channels * rotary_percent, inv_freq_i = base^(-2i / r) for
i < r/2, and position p has angles p * inv_freq (divided by ``seq_len_interpolation_factor``
when set). ``forward`` returns them as [s_local, 1, 1, r] for this CP rank's positions of the
load-balanced shard (``rope_utils.apply_rotary_pos_emb`` rotates
a tensor by them).
"""

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core.context_parallel import cp_shard_positions
from megatron.core.process_groups_config import get_pg_rank, get_pg_size


class RotaryEmbedding(torch.nn.Module):
    """RoPE angles (megatron-core 0.16.1's constructor). ``rope_scaling``: Llama 3.x frequency
    scaling by ``rope_scaling_factor`` (``llama3_scaled_inv_freq``)."""

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
    ) -> Tensor:
        """Angles [s_local, 1, 1, r] of this CP rank's positions of a ``max_seq_len`` sequence
        (all of them with no CP group or ``packed_seq``), each angle repeated for the two
        halves (or, interleaved, the two members) of a rotated pair."""
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
        return emb[:, None, None, :]


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
