"""Kernel calls on plan parts: forward blocks merged by log-sum-exp, backward blocks summed.

Tensors are [rows, b, n, d] (megatron's layout); LSEs [b, n, rows]. A part's rows are a
slice (dense) or an index tensor (packed). ``Kernel`` (``kernels``') says how each block is
computed; ``Accumulator`` holds the float32 running output and LSE of a forward;
``QuerySide`` the query-side tensors a backward block reads and the float32 query gradient
it adds into.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron.core.process_groups_config import get_pg_rank, get_pg_size
from megatron.core.transformer.cp_attention import kernels as fk
from megatron.core.transformer.cp_attention import varlen
from megatron.core.transformer.cp_attention.kernels import Kernel
from megatron.core.transformer.cp_attention.plans import BlockPlan, Part, Rows
from megatron.core.transformer.cp_attention.rescale import (
    Factor,
    GradFactors,
    Rescale,
    kernel_grad_inputs,
)
from megatron.core.transformer.cp_attention.sinks import sink_forward, sink_grad


@dataclass
class KeyValues:
    """Keys and values (or their gradients) of one source, [rows, b, n_kv, d] each."""

    k: torch.Tensor
    v: torch.Tensor

    def heads(self, heads: slice) -> "KeyValues":
        return KeyValues(heads_of(self.k, heads), heads_of(self.v, heads))


@dataclass
class Accumulator:
    """Float32 (float64 for float64) running output [s, b, n, d] and LSE [b, n, s]."""

    out: torch.Tensor
    lse: torch.Tensor

    @classmethod
    def like(cls, query: torch.Tensor) -> "Accumulator":
        s, b, n, d = query.shape
        out = torch.empty((s, b, n, d), device=query.device, dtype=fk.acc_dtype(query.dtype))
        return cls(out, query.new_empty((b, n, s), dtype=out.dtype))

    def heads(self, heads: slice) -> "Accumulator":
        return Accumulator(heads_of(self.out, heads), heads_of(self.lse, heads, 1))


@dataclass
class QuerySide:
    """What the backward blocks of one head group share: dO, Q and O as the kernels take
    them, the merged LSE, and the float32 query gradient ``dq`` the blocks add into."""

    do: torch.Tensor
    q: torch.Tensor
    o: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor

    def heads(self, heads: slice) -> "QuerySide":
        do, q, o, dq = (heads_of(x, heads) for x in (self.do, self.q, self.o, self.dq))
        return QuerySide(do, q, o, heads_of(self.lse, heads, 1), dq)


def save_merged(
    ctx, query, q, kv_local, acc: Accumulator, group, plan, kernel: Kernel, rescale: Rescale,
    sink=None,
) -> torch.Tensor:  # fmt: skip
    """End of a CP attention forward (all-gather, ring): the attention sinks (``sink``, None:
    none) joined to the merged output and LSE once, the output in ``query``'s dtype, with
    what ``query_side`` reads in the backward saved on ``ctx``: q, this rank's [K | V] (fp16
    when rescaled), out, the LSE, the sinks, the group, plan, kernel, rescaling, dtype."""
    ctx.has_sink = sink is not None
    if sink is not None:
        acc = Accumulator(*sink_forward(acc.out, acc.lse, sink))
    out = rescale.output(acc.out, query.dtype, plan.valid)
    ctx.save_for_backward(q, kv_local, out, acc.lse, sink)
    ctx.group, ctx.plan, ctx.kernel, ctx.rescale = group, plan, kernel, rescale
    ctx.dtype = query.dtype
    return out


@dataclass
class Saved:
    """What ``save_merged`` kept, as a backward reads it: Q as the kernels take it, this
    rank's [K | V] (``own``: as ``KeyValues``), the merged output and LSE, the sinks (None:
    none), the group, the plan, the kernel and the inputs' dtype."""

    q: torch.Tensor
    kv: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    sink: Optional[torch.Tensor]
    group: object
    plan: BlockPlan
    kernel: Kernel
    dtype: torch.dtype

    @classmethod
    def of(cls, ctx) -> "Saved":
        q, kv, out, lse, sink = ctx.saved_tensors
        sink = sink if ctx.has_sink else None
        return cls(q, kv, out, lse, sink, ctx.group, ctx.plan, ctx.kernel, ctx.dtype)

    @property
    def own(self) -> KeyValues:
        return KeyValues(*self.kv.chunk(2, dim=2))

    @property
    def world(self) -> int:
        return get_pg_size(self.group)

    @property
    def rank(self) -> int:
        return get_pg_rank(self.group)


def query_side(ctx, grad_out, saved: Saved) -> Tuple[QuerySide, GradFactors]:
    """Start of the matching backward: the ``QuerySide`` (dO, O as the kernels take them, a
    zero float32 dq) and the factors that undo the rescaling. The sinks' gradient (None
    without sinks) is left on ``ctx.sink_grad``."""
    q, out, lse, valid = saved.q, saved.out, saved.lse, saved.plan.valid
    ctx.sink_grad = sink_grad(grad_out if valid is None else grad_out * valid, out, lse, saved.sink)
    do, o, factors = kernel_grad_inputs(
        grad_out, out, q, saved.own.k, valid, saved.kernel.scale, ctx.rescale
    )
    dq = torch.zeros(q.shape, device=q.device, dtype=fk.acc_dtype(saved.dtype))
    return QuerySide(do, q, o, lse, dq), factors


def attend(part: Part, q, k, v, kernel: Kernel) -> Tuple[torch.Tensor, torch.Tensor]:
    """Kernel forward on [rows, b, n, d] tensors -> (out [rows, b, n, d], lse [b, n, rows])."""
    if part.cu_q is None:
        return fk.attention_forward(q, k, v, part.causal, kernel, layout="sbnd")
    packed = (x[:, 0] for x in (q, k, v))
    out, lse = varlen.varlen_forward(*packed, _lengths(part), part.causal, kernel)
    return out.unsqueeze(1), lse.unsqueeze(0)


def attend_backward(part: Part, dout, q, k, v, out, lse, kernel: Kernel):
    """Kernel backward on [rows, b, n, d] tensors -> (dq, dk, dv) in the same layout."""
    if part.cu_q is None:
        return fk.attention_backward(dout, q, k, v, out, lse, part.causal, kernel, layout="sbnd")
    packed = [x[:, 0] for x in (dout, q, k, v, out)] + [lse[0]]
    grads = varlen.varlen_backward(*packed, _lengths(part), part.causal, kernel)
    return tuple(g.unsqueeze(1) for g in grads)


def _lengths(part: Part) -> varlen.SeqLens:
    return varlen.SeqLens(part.cu_q, part.cu_k, part.max_q, part.max_k)


def forward_block(
    part: Part, q, kv: KeyValues, kernel: Kernel, acc: Accumulator, first: bool = False
) -> None:
    """One kernel call of ``part``; ``first`` (the local part: every row, each with at least
    its own key) starts the accumulators, later parts are merged into them by LSE."""
    k, v = rows_of(kv.k, part.k_rows), rows_of(kv.v, part.k_rows)
    o, lse = attend(part, rows_of(q, part.q_rows), k, v, kernel)
    if first:
        acc.out.copy_(o)
        acc.lse.copy_(lse)
        return
    rows = part.q_rows
    acc_rows, lse_rows = rows_of(acc.out, rows), lse_rows_of(acc.lse, rows)
    if isinstance(rows, slice):  # dense: every query row has keys in every part
        fk.merge_into(acc_rows, lse_rows, o, lse, layout="sbnd", rows_have_keys=True)
        return
    lse_rows = lse_rows.clone()  # index rows: merge copies, then put them back
    fk.merge_into(acc_rows, lse_rows, o, lse, layout="sbnd")
    put_rows(acc.out, rows, acc_rows)
    put_lse_rows(acc.lse, rows, lse_rows)


def block_grads(
    part: Part, side: QuerySide, kv: KeyValues, kernel: Kernel, factors: GradFactors
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Kernel backward of ``part``: adds its query gradient (times ``factors.dq``) into
    ``side.dq`` and returns its key and value gradients (rows ``part.k_rows`` of kv)."""
    rows = part.q_rows
    gq, gk, gv = attend_backward(
        part,
        rows_of(side.do, rows),
        rows_of(side.q, rows),
        rows_of(kv.k, part.k_rows),
        rows_of(kv.v, part.k_rows),
        rows_of(side.o, rows),
        lse_rows_of(side.lse, rows),
        kernel,
    )
    add_rows(side.dq, rows, gq, factors.dq)
    return gk, gv


def backward_block(
    part: Part,
    side: QuerySide,
    kv: KeyValues,
    kernel: Kernel,
    factors: GradFactors,
    grads: KeyValues,
) -> None:
    """Kernel backward of ``part``, its gradients (times ``factors``) added into the float32
    ``side.dq`` and ``grads`` (the key and value gradients of kv's source)."""
    gk, gv = block_grads(part, side, kv, kernel, factors)
    add_rows(grads.k, part.k_rows, gk, factors.dk)
    add_rows(grads.v, part.k_rows, gv, factors.dv)


def add_scaled(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, factor: Factor) -> None:
    """dst = a + b * factor (None: 1; a float or a 0-d tensor) in one pass, rounded once to
    dst's dtype."""
    if factor is None:
        torch.add(a, b, out=dst)
    elif isinstance(factor, torch.Tensor):
        torch.addcmul(a, b, factor, out=dst)
    else:
        torch.add(a, b, alpha=factor, out=dst)


# ----------------------------------------------------------------------------- rows and heads


def rows_of(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Rows ``rows`` of x along dim 0 (x itself for all of them)."""
    if isinstance(rows, slice):
        return x if rows == slice(None) else x[rows]
    return x.index_select(0, rows)


def put_rows(dst: torch.Tensor, rows: Rows, src: torch.Tensor) -> None:
    """dst[rows] = src."""
    if isinstance(rows, slice):
        dst[rows] = src
    else:
        dst.index_copy_(0, rows, src.to(dst.dtype))


def add_rows(dst: torch.Tensor, rows: Rows, src: torch.Tensor, factor: Factor = None) -> None:
    """dst[rows] += src (times ``factor``, a float or a 0-d tensor, when given)."""
    if factor is None or not isinstance(factor, torch.Tensor):
        alpha = 1.0 if factor is None else factor
        if isinstance(rows, slice):
            rows_of(dst, rows).add_(src, alpha=alpha)
        else:
            dst.index_add_(0, rows, src.to(dst.dtype), alpha=alpha)
    elif isinstance(rows, slice):
        rows_of(dst, rows).addcmul_(src, factor)
    else:
        dst.index_add_(0, rows, src.to(dst.dtype) * factor)


def lse_rows_of(lse: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Rows ``rows`` of an LSE [b, n, s] (along its last dim)."""
    if isinstance(rows, slice):
        return lse if rows == slice(None) else lse[:, :, rows]
    return lse.index_select(2, rows)


def put_lse_rows(dst: torch.Tensor, rows: Rows, src: torch.Tensor) -> None:
    """dst[:, :, rows] = src."""
    if isinstance(rows, slice):
        dst[:, :, rows] = src
    else:
        dst.index_copy_(2, rows, src)


def heads_of(x: torch.Tensor, heads: slice, dim: int = 2) -> torch.Tensor:
    """Heads ``heads`` of x along ``dim`` (x itself when that is all of them)."""
    if heads.start == 0 and heads.stop == x.shape[dim]:
        return x
    return x.narrow(dim, heads.start, heads.stop - heads.start)
