"""Causal multi-head self-attention, exact under context parallelism.

Each CP rank projects its own shard of the sequence to Q, K, V; ``context_parallel_attention``
lets every query see exactly the keys it would see in the unsharded sequence.
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.transformer.cp_attention import context_parallel_attention
from megatron.core.transformer.no_init import NoInitLinear
from megatron.core.transformer.transformer_config import TransformerConfig


class SelfAttention(nn.Module):
    """Causal self-attention on [s_local, b, h] hidden states, with K/V gathered over CP.

    out = linear_proj(softmax(Q K^T / sqrt(d) + M) V), M = 0 where key position <= query
    position (global positions), -inf elsewhere; d = kv_channels.
    """

    def __init__(
        self,
        config: TransformerConfig,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.kv_channels
        inner = self.num_heads * self.head_dim
        fusion = config.gradient_accumulation_fusion
        linear = dict(device=device, dtype=dtype, gradient_accumulation_fusion=fusion)
        self.linear_qkv = NoInitLinear(config.hidden_size, 3 * inner, **linear)
        self.linear_proj = NoInitLinear(inner, config.hidden_size, **linear)

    def forward(
        self, hidden_states: torch.Tensor, cp_group: Optional[dist.ProcessGroup] = None
    ) -> torch.Tensor:
        """Attend from this rank's shard [s_local, b, h] to the whole sequence.

        ``cp_group`` is the CP group of this step (None: C = 1); returns [s_local, b, h].
        """
        s_local, batch = hidden_states.shape[0], hidden_states.shape[1]
        query, key, value = (
            x.reshape(s_local, batch, self.num_heads, self.head_dim)
            for x in self.linear_qkv(hidden_states).chunk(3, dim=-1)
        )
        context = context_parallel_attention(query, key, value, cp_group=cp_group)
        return self.linear_proj(context.reshape(s_local, batch, -1))
