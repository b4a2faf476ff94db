"""YaRN rotary embeddings (megatron-core 0.16.1's ``YarnRotaryEmbedding``): the frequencies
blend interpolated (``inv_freq / scaling_factor``) and original ones by a linear ramp between
the correction dims of ``beta_fast`` and ``beta_slow`` rotations over
``original_max_position_embeddings``; cos and sin are scaled by
mscale(factor, mscale) / mscale(factor, mscale_all_dim). Tables in float32; the maths
are ``megatron.core.rope``'s.
"""

from typing import Optional, Tuple

import torch.distributed as dist
from torch import Tensor

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.rope import yarn_get_mscale, yarn_inv_freq


class YarnRotaryEmbedding(RotaryEmbedding):
    """YaRN angles; ``forward`` returns (angles [s_local, 1, 1, dim], cos/sin scale)."""

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
        self.mscale = yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(
            scaling_factor, mscale_all_dim
        )

    def forward(
        self,
        max_seq_len: int,
        offset: int = 0,
        packed_seq: bool = False,
        cp_group: Optional[dist.ProcessGroup] = None,
    ) -> Tuple[Tensor, float]:
        """(RoPE angles of this CP rank's positions, the cos/sin scale)."""
        return super().forward(max_seq_len, offset, packed_seq, cp_group), self.mscale
