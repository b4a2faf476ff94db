"""``cp_comm_type="a2a"`` (Ulysses) and ``"a2a+p2p"`` (hierarchical): heads all-to-all.

a2a: every rank gets the whole sequence for n/C of the heads, runs one causal kernel call,
and sends the result back. Needs n and n_kv divisible by C.

a2a+p2p (C = A x P): heads all-to-all within groups of A consecutive CP ranks, after which
each rank holds n/A heads of a load-balanced shard of a split over P ranks; the p2p ring
runs over those P ranks, and the heads go back. Needs n and n_kv divisible by A. (The
all-to-all suits fast links within a node, the ring the links between nodes.)
"""

from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.process_groups_config import get_pg_rank, get_pg_size
from megatron.core.transformer.cp_attention.collectives import HeadsToSeq, SeqToHeads
from megatron.core.transformer.cp_attention.local import local_attention
from megatron.core.transformer.cp_attention.plans import exchange_order
from megatron.core.transformer.cp_attention.ring import ring_attention
from megatron.core.transformer.cp_attention.sinks import heads_share
from megatron.core.transformer.cp_attention.strategy import AttentionCall, Strategy


def a2a_attention(query, key, value, group, call: AttentionCall) -> torch.Tensor:
    """Ulysses over ``group``: the whole sequence for this rank's share of the heads."""
    return _all_to_all_attention(query, key, value, group, call)


def hierarchical_attention(query, key, value, groups, call: AttentionCall) -> torch.Tensor:
    """a2a+p2p over ``groups`` = [all-to-all group of A ranks, ring group of P ranks]."""
    a2a_group, ring = groups
    return _all_to_all_attention(query, key, value, a2a_group, call, ring)


def validate_a2a(query: torch.Tensor, key: torch.Tensor, group) -> None:
    """Query and key/value heads divisible by C."""
    _check_heads(query, key, group, "a2a")


def validate_hierarchical(query: torch.Tensor, key: torch.Tensor, groups) -> None:
    """Query and key/value heads divisible by the all-to-all group's size A."""
    _check_heads(query, key, groups[0], "a2a+p2p")


# a2a attends the whole sequence on each rank: a sliding window is the local one, exactly.
STRATEGY = Strategy("a2a", a2a_attention, validate_a2a, sliding_window=True)
HIERARCHICAL = Strategy("a2a+p2p", hierarchical_attention, validate_hierarchical, group_pair=True)


def _check_heads(query, key, group, name: str) -> None:
    a2a_size = get_pg_size(group)
    n_q, n_kv = query.shape[2], key.shape[2]
    if n_q % a2a_size or n_kv % a2a_size:
        raise ValueError(
            f"context_parallel_attention: cp_comm_type={name!r} needs the query heads ({n_q}) "
            f"and key/value heads ({n_kv}) divisible by the all-to-all group size ({a2a_size})"
        )


def _all_to_all_attention(
    query, key, value, group, call: AttentionCall, ring: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """Sequence shards -> head shards over ``group``, causal attention, and back.

    Without ``ring`` the exchanged rows are the whole sequence for n/C of the heads: one
    local causal call. With ``ring`` (a2a+p2p; CP rank = ring rank * A + rank in ``group``)
    they are ring rank j's load-balanced shard of the sequence split over the ring's P
    ranks (``exchange_order``), and the load-balanced ring attends them for n/A heads.
    """
    a2a_size = get_pg_size(group)
    ring_size, ring_rank = get_pg_size(ring), get_pg_rank(ring)
    n_kv = key.shape[2]
    s_local = query.shape[0]
    order, back = exchange_order(s_local, a2a_size, ring_size, ring_rank, call.packed, query.device)
    # Heads [k_0..k_g, v_0..v_g] regrouped so that rank r's share holds its k heads then its
    # v heads: [s, b, A, 2, ng / A, d] -> one exchange for both.
    s, b, _, d = key.shape
    kv = torch.stack([x.view(s, b, a2a_size, n_kv // a2a_size, d) for x in (key, value)], dim=3)
    kv = kv.view(s, b, 2 * n_kv, d)
    q_heads = SeqToHeads.apply(query, group).index_select(0, order)
    kv_heads = SeqToHeads.apply(kv.contiguous(), group).index_select(0, order)
    k_heads, v_heads = kv_heads.chunk(2, dim=2)
    # this rank's heads' sinks: their gradient is this rank's share (summed over CP)
    sink = heads_share(call.sink, get_pg_rank(group), a2a_size)
    if ring is None:
        out = local_attention(q_heads, k_heads, v_heads, call.packed, call.kernel, sink)
    else:
        out = ring_attention(q_heads, k_heads, v_heads, ring, replace(call, sink=sink))
    return HeadsToSeq.apply(out.index_select(0, back), group)
