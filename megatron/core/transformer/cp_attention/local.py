"""Attention of a whole natural-order sequence on one rank: C = 1, and a2a after its exchange."""

import torch

from megatron.core.transformer.cp_attention import kernels as fk
from megatron.core.transformer.cp_attention.blocks import (
    attend,
    attend_backward,
    lse_rows_of,
    put_lse_rows,
    put_rows,
    rows_of,
)
from megatron.core.transformer.cp_attention.kernels import Kernel
from megatron.core.transformer.cp_attention.plans import Plan, local_plan
from megatron.core.transformer.cp_attention.sinks import sink_forward, sink_grad


def local_attention(query, key, value, packed, kernel: Kernel, sink=None) -> torch.Tensor:
    """Causal attention of the whole sequence held here (documents apart when packed);
    ``sink`` [n]: attention sinks (``sinks``), None: none."""
    plan = local_plan(query.shape[0], packed, query.device)
    return LocalAttention.apply(query, key, value, plan, kernel, sink)


class LocalAttention(torch.autograd.Function):
    """Causal attention of a whole (natural-order) sequence: one kernel call per part."""

    @staticmethod
    def forward(ctx, query, key, value, plan: Plan, kernel: Kernel, sink):
        ctx.plan, ctx.kernel = plan, kernel
        if plan.whole():  # one call over everything: use the kernel's tensors as they are
            out, lse = attend(plan.parts[0], query, key, value, kernel)
            return _finish(ctx, query, key, value, out, lse, sink)
        out = torch.empty_like(query)
        lse = query.new_empty(
            (query.shape[1], query.shape[2], query.shape[0]), dtype=fk.acc_dtype(query.dtype)
        )
        for part in plan.parts:
            o, lse_blk = attend(part, rows_of(query, part.q_rows), key, value, kernel)
            put_rows(out, part.q_rows, o)
            put_lse_rows(lse, part.q_rows, lse_blk)
        return _finish(ctx, query, key, value, out, lse, sink)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, sink = ctx.saved_tensors
        plan, kernel = ctx.plan, ctx.kernel
        if plan.valid is not None:
            grad_out = grad_out * plan.valid
        dsink = sink_grad(grad_out, out, lse, sink if ctx.has_sink else None)
        if plan.whole():
            grads = attend_backward(plan.parts[0], grad_out, query, key, value, out, lse, kernel)
            dq, dk, dv = (g.to(x.dtype) for g, x in zip(grads, (query, key, value)))
            return dq, dk, dv, None, None, dsink
        dq = torch.zeros_like(query)
        dk = torch.zeros(key.shape, device=key.device, dtype=fk.acc_dtype(key.dtype))
        dv = torch.zeros_like(dk)
        for part in plan.parts:
            rows = part.q_rows
            gq, gk, gv = attend_backward(
                part,
                rows_of(grad_out, rows),
                rows_of(query, rows),
                key,
                value,
                rows_of(out, rows),
                lse_rows_of(lse, rows),
                kernel,
            )
            put_rows(dq, rows, gq)
            dk += gk.to(dk.dtype)
            dv += gv.to(dv.dtype)
        return dq, dk.to(key.dtype), dv.to(value.dtype), None, None, dsink


def _finish(ctx, query, key, value, out, lse, sink):
    """The forward's end: the sink joined to the merged (out, lse), padding rows zeroed,
    what the backward reads saved."""
    ctx.has_sink = sink is not None
    if sink is not None:
        out, lse = sink_forward(out, lse, sink)
        out = out.to(query.dtype)
    if ctx.plan.valid is not None:
        out = out * ctx.plan.valid
    ctx.save_for_backward(query, key, value, out, lse, sink)
    return out
