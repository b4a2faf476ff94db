"""``cp_comm_type="all_gather"`` (the default): K/V gathered one group of heads at a time.

Per head group: the local block (both local chunks against the local K/V, one square causal
call) runs while the gather is in flight, and the next group's gather starts once this one
has arrived; then one mask-free call per other rank j: every local query against j's first
chunk when j < r, the second local chunk against both of j's chunks when j > r. Partial
results are merged by their log-sum-exp in float32. Backward re-gathers K/V (nothing of size
s is saved) and reduce-scatters the float32 key/value gradients of the other ranks' keys
while it computes the local block.
"""

import math
from typing import List, Optional, Tuple

import torch

from megatron.core.process_groups_config import get_pg_rank, get_pg_size
from megatron.core.transformer.cp_attention.blocks import (
    Accumulator,
    KeyValues,
    Saved,
    add_scaled,
    backward_block,
    block_grads,
    forward_block,
    heads_of,
    query_side,
    save_merged,
)
from megatron.core.transformer.cp_attention.collectives import (
    start_gather,
    start_reduce_scatter,
)
from megatron.core.transformer.cp_attention.kernels import Kernel
from megatron.core.transformer.cp_attention.plans import BlockPlan, block_plan
from megatron.core.transformer.cp_attention.rescale import Rescale
from megatron.core.transformer.cp_attention.strategy import AttentionCall, Strategy


def all_gather_attention(query, key, value, group, call: AttentionCall) -> torch.Tensor:
    """All-gather CP attention of this rank's shard over ``group`` (C > 1)."""
    cp_size, cp_rank = get_pg_size(group), get_pg_rank(group)
    plan = block_plan(query.shape[0], cp_size, cp_rank, call.packed, query.device)
    gathered_bytes = 2 * key.numel() * key.element_size() * cp_size
    groups = head_groups(key.shape[2], call.num_head_groups, gathered_bytes)
    return AllGatherAttention.apply(query, key, value, group, plan, call.kernel, groups, call.sink)


def validate(query: torch.Tensor, key: torch.Tensor, group) -> None:
    """Nothing beyond the common checks: the (dense: even) local length is checked where the
    plan is built, before any collective."""


STRATEGY = Strategy("all_gather", all_gather_attention, validate)


def head_groups(
    num_kv_heads: int, num_groups: Optional[int], gathered_bytes: int
) -> List[Tuple[int, int]]:
    """Split kv heads [0, n) into ``num_groups`` contiguous groups.

    Default: one group while the gathered K/V of all heads (``gathered_bytes``) is at most
    2 GiB, else as many as keep a group's within it. The local block already hides the
    gather (measured on 2 H200s: one group is 0.1-3% faster than two from 8k to 128k
    tokens), so groups only bound the transient memory: the gathered K/V and, in backward,
    its float32 gradient.
    """
    if num_groups is None:
        count = min(num_kv_heads, max(1, math.ceil(gathered_bytes / 2**31)))
    else:
        count = num_groups
    if not 1 <= count <= num_kv_heads:
        raise ValueError(
            f"context_parallel_attention: num_head_groups must be in [1, {num_kv_heads}], "
            f"got {num_groups!r}"
        )
    bounds = [round(i * num_kv_heads / count) for i in range(count + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


class AllGatherAttention(torch.autograd.Function):
    """All-gather CP attention, one head group at a time (see the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, group, plan: BlockPlan, kernel: Kernel, head_groups, sink):
        world, rank = get_pg_size(group), get_pg_rank(group)
        s_local, rep = query.shape[0], query.shape[2] // key.shape[2]
        rescale = Rescale.for_inputs(query, key, value, group)
        kv_local = rescale.key_values(key, value)  # [K | V] heads: what the gather sends
        pending = start_gather(kv_local, head_groups[0], group)
        q, own = rescale.query(query), KeyValues(*kv_local.chunk(2, dim=2))
        acc = Accumulator.like(query)
        for i, (h0, h1) in enumerate(head_groups):
            heads, kv_heads = slice(h0 * rep, h1 * rep), slice(h0, h1)
            q_h, acc_h = heads_of(q, heads), acc.heads(heads)
            # the local block needs no communication: it runs while the gather is in flight
            forward_block(plan.local, q_h, own.heads(kv_heads), kernel, acc_h, first=True)
            kv = pending.wait()
            if i + 1 < len(head_groups):
                pending = start_gather(kv_local, head_groups[i + 1], group)
            for source in range(world):
                if source != rank:
                    rows = kv[source * s_local : (source + 1) * s_local]
                    part = plan.part(source, rank)
                    forward_block(part, q_h, KeyValues(*rows.chunk(2, dim=2)), kernel, acc_h)
            del kv
        ctx.head_groups = head_groups
        return save_merged(ctx, query, q, kv_local, acc, group, plan, kernel, rescale, sink)

    @staticmethod
    def backward(ctx, grad_out):
        saved = Saved.of(ctx)
        kv_local, group, plan, kernel = saved.kv, saved.group, saved.plan, saved.kernel
        world, rank, own, dtype = saved.world, saved.rank, saved.own, saved.dtype
        pending = start_gather(kv_local, ctx.head_groups[0], group)
        side, factors = query_side(ctx, grad_out, saved)
        s_local, rep = saved.q.shape[0], saved.q.shape[2] // own.k.shape[2]
        dk, dv = (torch.empty(x.shape, device=x.device, dtype=dtype) for x in (own.k, own.v))
        local_grads, reductions = [], []
        last = len(ctx.head_groups) - 1
        for i, (h0, h1) in enumerate(ctx.head_groups):
            side_h = side.heads(slice(h0 * rep, h1 * rep))
            own_h = own.heads(slice(h0, h1))
            # The local block needs no communication: it runs while the first group's
            # gather is in flight, or, in later groups, while their reduction is. Its key
            # and value gradients wait for the other ranks' sums to be added in one pass.
            if i == 0 and last > 0:
                local_grads.append(block_grads(plan.local, side_h, own_h, kernel, factors))
            kv = pending.wait()
            if i + 1 < len(ctx.head_groups):
                pending = start_gather(kv_local, ctx.head_groups[i + 1], group)
            dkv = torch.zeros(kv.shape, device=kv.device, dtype=side.dq.dtype)
            for source in range(world):
                if source != rank:
                    rows = slice(source * s_local, (source + 1) * s_local)
                    source_kv = KeyValues(*kv[rows].chunk(2, dim=2))
                    grads = KeyValues(*dkv[rows].chunk(2, dim=2))
                    part = plan.part(source, rank)
                    backward_block(part, side_h, source_kv, kernel, factors, grads)
            del kv
            reductions.append(start_reduce_scatter(dkv, group))
            if i > 0 or last == 0:
                local_grads.append(block_grads(plan.local, side_h, own_h, kernel, factors))
        for (h0, h1), reduction, (gk, gv) in zip(ctx.head_groups, reductions, local_grads):
            dk_in, dv_in = reduction.wait().chunk(2, dim=2)
            add_scaled(dk[:, :, h0:h1], dk_in, gk, factors.dk)
            add_scaled(dv[:, :, h0:h1], dv_in, gv, factors.dv)
        return side.dq.to(dtype), dk, dv, None, None, None, None, ctx.sink_grad
