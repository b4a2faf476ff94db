"""``cp_comm_type="p2p"``: the load-balanced ring with float32 log-sum-exp merging.

The same kernel calls as all_gather, with K/V travelling around the CP group in C steps
overlapped with compute: at step i rank r holds the K/V of rank (r - i) mod C and computes
the plan's part for that source. Backward sends the float32 key/value gradients around the
ring with the K/V, one extra hop bringing them home.
"""

import torch

from megatron.core.process_groups_config import get_pg_rank, get_pg_size
from megatron.core.transformer.cp_attention.blocks import (
    Accumulator,
    KeyValues,
    Saved,
    add_rows,
    block_grads,
    forward_block,
    query_side,
    save_merged,
)
from megatron.core.transformer.cp_attention.collectives import ring_exchange
from megatron.core.transformer.cp_attention.kernels import Kernel
from megatron.core.transformer.cp_attention.local import local_attention
from megatron.core.transformer.cp_attention.plans import BlockPlan, block_plan
from megatron.core.transformer.cp_attention.rescale import Rescale
from megatron.core.transformer.cp_attention.strategy import AttentionCall, Strategy


def ring_attention(query, key, value, group, call: AttentionCall) -> torch.Tensor:
    """Ring CP attention of this rank's shard over ``group`` (one rank: local attention;
    a2a+p2p calls it with its ring group)."""
    cp_size, cp_rank = get_pg_size(group), get_pg_rank(group)
    if cp_size == 1:
        return local_attention(query, key, value, call.packed, call.kernel, call.sink)
    plan = block_plan(query.shape[0], cp_size, cp_rank, call.packed, query.device)
    return RingAttention.apply(query, key, value, group, plan, call.kernel, call.sink)


def validate(query: torch.Tensor, key: torch.Tensor, group) -> None:
    """Nothing beyond the common checks: the (dense: even) local length is checked where the
    plan is built, before any collective."""


STRATEGY = Strategy("p2p", ring_attention, validate)


class RingAttention(torch.autograd.Function):
    """Load-balanced ring CP attention with float32 LSE merging (see the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, group, plan: BlockPlan, kernel: Kernel, sink):
        world, rank = get_pg_size(group), get_pg_rank(group)
        n_kv = key.shape[2]
        rescale = Rescale.for_inputs(query, key, value, group)
        q, kv_local = rescale.query(query), rescale.key_values(key, value)
        acc = Accumulator.like(query)
        kv = kv_local
        for step in range(world):
            exchange = ring_exchange(kv, group, tag=0) if step + 1 < world else None
            part = plan.part((rank - step) % world, rank)
            source = KeyValues(*kv.split(n_kv, dim=2))
            forward_block(part, q, source, kernel, acc, first=step == 0)
            if exchange is not None:
                kv = exchange.wait()
        return save_merged(ctx, query, q, kv_local, acc, group, plan, kernel, rescale, sink)

    @staticmethod
    def backward(ctx, grad_out):
        saved = Saved.of(ctx)
        side, factors = query_side(ctx, grad_out, saved)
        kv, n_kv, world, rank = saved.kv, saved.kv.shape[2] // 2, saved.world, saved.rank
        dkv = torch.zeros(kv.shape, device=kv.device, dtype=side.dq.dtype)
        dkv_exchange = None
        for step in range(world):
            exchange = ring_exchange(kv, saved.group, tag=1) if step + 1 < world else None
            part = saved.plan.part((rank - step) % world, rank)
            source = KeyValues(*kv.split(n_kv, dim=2))
            gk, gv = block_grads(part, side, source, saved.kernel, factors)
            if dkv_exchange is not None:  # the gradient buffer arrives while computing
                dkv = dkv_exchange.wait()
            dk_src, dv_src = dkv.split(n_kv, dim=2)
            add_rows(dk_src, part.k_rows, gk, factors.dk)
            add_rows(dv_src, part.k_rows, gv, factors.dv)
            dkv_exchange = ring_exchange(dkv, saved.group, tag=2)
            if exchange is not None:
                kv = exchange.wait()
        dk, dv = dkv_exchange.wait().split(n_kv, dim=2)  # after C hops: this rank's own
        dq, dk, dv = (x.to(saved.dtype) for x in (side.dq, dk, dv))
        return dq, dk, dv, None, None, None, ctx.sink_grad
