"""Attention of a whole natural-order sequence on one rank: C = 1, and a2a after its exchange."""

import torch

from megatron.core.transformer.cp_attention import kernels as fk
from megatron.core.transformer.cp_attention.blocks import (
    Kernel,
    attend,
    attend_backward,
    lse_rows_of,
    put_lse_rows,
    put_rows,
    rows_of,
)
from megatron.core.transformer.cp_attention.plans import Plan, local_plan


def local_attention(query, key, value, packed, kernel: Kernel) -> torch.Tensor:
    """Causal attention of the whole sequence held here (documents apart when packed)."""
    plan = local_plan(query.shape[0], packed, query.device)
    return LocalAttention.apply(query, key, value, plan, kernel)


class LocalAttention(torch.autograd.Function):
    """Causal attention of a whole (natural-order) sequence: one kernel call per part."""

    @staticmethod
    def forward(ctx, query, key, value, plan: Plan, kernel: Kernel):
        ctx.plan, ctx.kernel = plan, kernel
        if plan.whole():  # one call over everything: use the kernel's tensors as they are
            out, lse = attend(plan.parts[0], query, key, value, kernel)
            if plan.valid is not None:
                out = out * plan.valid
            ctx.save_for_backward(query, key, value, out, lse)
            return out
        out = torch.empty_like(query)
        lse = query.new_empty(
            (query.shape[1], query.shape[2], query.shape[0]), dtype=fk.acc_dtype(query.dtype)
        )
        for part in plan.parts:
            o, lse_blk = attend(part, rows_of(query, part.q_rows), key, value, kernel)
            put_rows(out, part.q_rows, o)
            put_lse_rows(lse, part.q_rows, lse_blk)
        if plan.valid is not None:
            out = out * plan.valid
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        plan, kernel = ctx.plan, ctx.kernel
        if plan.valid is not None:
            grad_out = grad_out * plan.valid
        if plan.whole():
            grads = attend_backward(plan.parts[0], grad_out, query, key, value, out, lse, kernel)
            dq, dk, dv = (g.to(x.dtype) for g, x in zip(grads, (query, key, value)))
            return dq, dk, dv, None, None
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
        return dq, dk.to(key.dtype), dv.to(value.dtype), None, None
