"""Causal multi-head self-attention, exact under context parallelism.

Each CP rank projects its own shard of the sequence to Q, K, V, gathers K and V from every
rank of the CP group (differentiably), and masks by GLOBAL position, so every query sees
exactly the keys it would see in the unsharded sequence.
"""

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.context_parallel import (
    cp_gathered_positions,
    cp_shard_positions,
    cp_size_and_rank,
    gather_from_context_parallel_region,
)
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
        query, key, value = self.linear_qkv(hidden_states).chunk(3, dim=-1)
        key_value = gather_from_context_parallel_region(torch.cat([key, value], dim=-1), cp_group)
        key, value = key_value.chunk(2, dim=-1)
        allowed = causal_mask_for_cp_rank(s_local, cp_group, hidden_states.device)
        context = attention(
            self._split_heads(query), self._split_heads(key), self._split_heads(value), allowed
        )
        # [b, n, s_local, d] -> [s_local, b, n * d]
        context = context.permute(2, 0, 1, 3).reshape(s_local, batch, -1)
        return self.linear_proj(context)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, n * d] -> [b, n, s, d]."""
        return x.reshape(x.shape[0], x.shape[1], self.num_heads, self.head_dim).permute(1, 2, 0, 3)


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d), restricted to ``allowed``) V on [b, n, s, d] tensors.

    ``allowed`` is a boolean [s_q, s_k] mask; half-precision scores use a float32 softmax.
    """
    scores = torch.matmul(query, key.transpose(-1, -2)) * (1.0 / math.sqrt(query.shape[-1]))
    scores = scores.masked_fill(~allowed, float("-inf"))
    softmax_dtype = torch.float32 if scores.element_size() < 4 else scores.dtype
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(value.dtype)
    return torch.matmul(probs, value)


def causal_mask_for_cp_rank(
    s_local: int, cp_group: Optional[dist.ProcessGroup], device: torch.device
) -> torch.Tensor:
    """Boolean [s_local, s] mask: query i of this rank may see gathered key j.

    allowed[i, j] = key_position[j] <= query_position[i], positions global (s = C * s_local).
    """
    cp_size, cp_rank = cp_size_and_rank(cp_group)
    seq_length = s_local * cp_size
    query_positions = cp_shard_positions(seq_length, cp_size, cp_rank).to(device)
    key_positions = cp_gathered_positions(seq_length, cp_size).to(device)
    return key_positions.unsqueeze(0) <= query_positions.unsqueeze(1)
