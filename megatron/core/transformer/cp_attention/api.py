"""``context_parallel_attention``: the entry point the model calls, its checks and dispatch."""

import math
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron.core.config_rules import CP_COMM_TYPES
from megatron.core.process_groups_config import get_pg_size
from megatron.core.transformer.cp_attention.blocks import Kernel
from megatron.core.transformer.cp_attention.local import local_attention
from megatron.core.transformer.cp_attention.registry import STRATEGIES
from megatron.core.transformer.cp_attention.strategy import AttentionCall, Strategy


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cp_group: Union[None, dist.ProcessGroup, Sequence[dist.ProcessGroup]] = None,
    cp_comm_type: Optional[str] = "all_gather",
    softmax_scale: Optional[float] = None,
    packed_seq_params=None,
    kernel: Optional[str] = None,
    num_head_groups: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    ``query`` is [s_local, b, np, d]; ``key`` and ``value`` are [s_local, b, ng, d] with np a
    multiple of ng (grouped-query attention: query head i uses key/value head i // (np/ng)).
    ``cp_group`` None or of size 1 means the shard is the whole sequence; for
    ``cp_comm_type="a2a+p2p"`` it is the pair [all-to-all group of A ranks, ring group of P
    ranks] that ``parallel_state.get_hierarchical_context_parallel_groups()`` returns for
    ``hierarchical_context_parallel_sizes=[A, P]`` (the CP rank is ring rank * A + rank in
    the all-to-all group). Returns
    [s_local, b, np, d]: softmax(scale * Q K^T + causal mask) V, scale = ``softmax_scale``
    or 1/sqrt(d).

    ``packed_seq_params`` (``qkv_format="thd"``, b = 1): documents given by
    ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``) never attend to each other; each padded
    document is split over the CP ranks with the load-balanced rule (its padded length a
    multiple of 2C), tokens past the last document form one more document of padding. Rows
    at or past a document's real length (``cu_seqlens_q``) are padding: their output is 0
    and they pass no gradient. ``kernel`` picks the attention kernel (see
    ``cp_attention.kernels``); ``num_head_groups`` how many K/V head groups the all-gather
    is split into (default: one, unless the gathered K/V would exceed 2 GiB; see
    ``all_gather.head_groups``).
    """
    strategy = _check_arguments(query, key, value, cp_comm_type, cp_group, packed_seq_params)
    strategy.validate(query, key, cp_group)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
    call = AttentionCall(Kernel(kernel, scale), packed_seq_params, num_head_groups)
    if not strategy.group_pair and get_pg_size(cp_group) == 1:
        return local_attention(query, key, value, packed_seq_params, call.kernel)
    return strategy.run(query, key, value, cp_group, call)


def _check_arguments(query, key, value, cp_comm_type, cp_group, packed) -> Strategy:
    """Validate shapes and options before any collective; returns the strategy."""
    comm = "all_gather" if cp_comm_type is None else cp_comm_type
    if not isinstance(comm, str) or comm not in STRATEGIES:
        raise ValueError(
            f"context_parallel_attention: cp_comm_type must be one of {CP_COMM_TYPES} or None, "
            f"got {cp_comm_type!r}"
        )
    strategy = STRATEGIES[comm]
    pair = isinstance(cp_group, (list, tuple))
    if strategy.group_pair and not (
        pair and len(cp_group) == 2 and all(isinstance(g, dist.ProcessGroup) for g in cp_group)
    ):
        raise ValueError(
            f"context_parallel_attention: cp_comm_type={comm!r} needs cp_group = [all-to-all "
            "group, ring group] (parallel_state.get_hierarchical_context_parallel_groups() of "
            f"hierarchical_context_parallel_sizes=[A, P]), got {cp_group!r}"
        )
    if not strategy.group_pair and pair:
        takers = " or ".join(
            f"cp_comm_type={s.name!r}" for s in STRATEGIES.values() if s.group_pair
        )
        raise ValueError(
            f"context_parallel_attention: cp_group is a list of groups, which only {takers} "
            f"takes; got cp_comm_type={comm!r}"
        )
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        raise ValueError(
            "context_parallel_attention: query must be [s, b, np, d] and key/value [s, b, ng, d] "
            f"of equal shapes, got {tuple(query.shape)}, {tuple(key.shape)}, "
            f"{tuple(value.shape)}"
        )
    s, b, n_q, d = query.shape
    if key.shape[0] != s or key.shape[1] != b or key.shape[3] != d or n_q % key.shape[2]:
        raise ValueError(
            f"context_parallel_attention: key/value {tuple(key.shape)} do not fit query "
            f"{tuple(query.shape)} (same s, b, d; np a multiple of ng)"
        )
    if packed is not None and b != 1:
        raise ValueError(
            f"context_parallel_attention: packed sequences (thd) need batch size 1, got {b}"
        )
    return strategy
