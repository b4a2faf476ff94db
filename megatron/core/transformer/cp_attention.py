"""Causal core attention over a context-parallel (CP) shard: the one entry point the model calls.

``context_parallel_attention`` takes this CP rank's load-balanced shard of Q, K and V (chunks r
and 2C-1-r of the sequence, see ``megatron.core.context_parallel``) and returns the attention
output for its queries, exactly as the unsharded sequence would give it: query at global
position i sees keys at global positions j <= i.

This first version gathers K and V over the CP group and holds an explicit [s/C, s] score
matrix (``explicit_causal_attention``); it is the test oracle for the long-context kernels.
"""

import math
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.context_parallel import (
    cp_gathered_positions,
    cp_shard_positions,
    cp_size_and_rank,
    gather_from_context_parallel_region,
)


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cp_group: Optional[dist.ProcessGroup] = None,
    cp_comm_type: str = "all_gather",
    softmax_scale: Optional[float] = None,
    packed_seq_params=None,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    ``query`` is [s_local, b, np, d]; ``key`` and ``value`` are [s_local, b, ng, d] with np a
    multiple of ng (grouped-query attention: query head i uses key/value head i // (np/ng)).
    ``cp_group`` None or of size 1 means the shard is the whole sequence. Returns
    [s_local, b, np, d]: softmax(scale * Q K^T + causal mask) V, scale = ``softmax_scale``
    or 1/sqrt(d).
    """
    if packed_seq_params is not None:
        raise NotImplementedError("context_parallel_attention: packed sequences are not supported")
    if cp_comm_type not in ("all_gather", None):
        raise NotImplementedError(
            f"context_parallel_attention: cp_comm_type={cp_comm_type!r} is not supported"
        )
    s_local, ng = key.shape[0], key.shape[2]
    key_value = gather_from_context_parallel_region(torch.cat([key, value], dim=-1), cp_group)
    key, value = key_value.split(key.shape[-1], dim=-1)
    allowed = causal_mask_for_cp_rank(s_local, cp_group, query.device)
    heads_per_group = query.shape[2] // ng
    # [s, b, n, d] -> [b, n, s, d]; key/value heads repeated for their query heads.
    q = query.permute(1, 2, 0, 3)
    k = key.permute(1, 2, 0, 3).repeat_interleave(heads_per_group, dim=1)
    v = value.permute(1, 2, 0, 3).repeat_interleave(heads_per_group, dim=1)
    return explicit_causal_attention(q, k, v, allowed, softmax_scale).permute(2, 0, 1, 3)


def explicit_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """softmax(scale * Q K^T, restricted to ``allowed``) V on [b, n, s, d] tensors.

    ``allowed`` is a boolean [s_q, s_k] mask; half-precision scores use a float32 softmax.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
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
