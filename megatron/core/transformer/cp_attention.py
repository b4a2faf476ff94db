"""Causal core attention over a context-parallel (CP) shard: the one entry point the model calls.

``context_parallel_attention`` takes this CP rank's load-balanced shard of Q, K and V (chunks r
and 2C-1-r of the sequence, see ``megatron.core.context_parallel``) and returns the attention
output for its queries, exactly as the unsharded sequence would give it: query at global
position i sees keys at global positions j <= i (and, for packed sequences, only keys of its
own document).

Attention runs on flash-class kernels (``megatron.core.transformer.flash_kernels``: PyTorch's
SDPA backends on GPUs, the CPU flash op on CPUs); no score matrix is ever materialized. Three
ways to bring the keys to the queries (``cp_comm_type``, megatron-core's names):

- ``"all_gather"`` (default; also for None): K/V are all-gathered one group of heads at a
  time, the next group's gather running while the current group is computed. Each of the two
  local chunks (global chunk g) is one kernel call over keys [0, (g + 1) k) with a
  bottom-right causal mask. Backward re-gathers K/V (nothing of size s is saved), adds the
  key/value gradients of both chunks in float32 and reduce-scatters them in float32.
- ``"p2p"``: the load-balanced ring. K/V travel around the CP group in C steps overlapped
  with compute; at step i rank r holds the K/V of rank (r - i) mod C and computes only the
  blocks the causal mask keeps (the whole local block at i = 0; all local queries against
  the first source chunk when the source rank is lower; the second local query chunk
  against both source chunks when it is higher). Partial results are merged by their
  log-sum-exp in float32. Backward sends the float32 key/value gradients around the ring
  with the K/V, one extra hop bringing them home.
- ``"a2a"``: heads all-to-all (Ulysses): every rank gets the whole sequence for n/C of the
  heads, runs one causal kernel call, and sends the result back. Needs n and n_kv divisible
  by C.

Packed sequences (``PackedSeqParams``, THD) work in every mode: each document is split over
the ranks on its own, and each kernel call above becomes one varlen call over all documents
(a loop over documents where the varlen op is missing or the dtype is not half precision).

Each mode is a ``torch.autograd.Function`` that calls the kernels' forward and backward ops
itself (the kernels' log-sum-exp is not differentiable). Memory per rank: saved tensors are
the local Q, K, V, output and a float32 LSE, O(s/C); transient buffers hold K/V of one head
group for the whole sequence (all_gather) or of one peer (p2p).
"""

import functools
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.context_parallel import (
    cp_gathered_positions,
    cp_size_and_rank,
    thd_partitioned_indices,
)
from megatron.core.tensor_parallel.mappings import _adjoint_pair
from megatron.core.transformer import flash_kernels as fk

CP_COMM_TYPES = ("all_gather", "p2p", "a2a")


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cp_group: Optional[dist.ProcessGroup] = None,
    cp_comm_type: Optional[str] = "all_gather",
    softmax_scale: Optional[float] = None,
    packed_seq_params=None,
    kernel: Optional[str] = None,
    num_head_groups: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    ``query`` is [s_local, b, np, d]; ``key`` and ``value`` are [s_local, b, ng, d] with np a
    multiple of ng (grouped-query attention: query head i uses key/value head i // (np/ng)).
    ``cp_group`` None or of size 1 means the shard is the whole sequence. Returns
    [s_local, b, np, d]: softmax(scale * Q K^T + causal mask) V, scale = ``softmax_scale``
    or 1/sqrt(d).

    ``packed_seq_params`` (``qkv_format="thd"``, b = 1): documents given by
    ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``) never attend to each other; each padded
    document is split over the CP ranks with the load-balanced rule (its padded length a
    multiple of 2C), tokens past the last document form one more document of padding. Rows
    at or past a document's real length (``cu_seqlens_q``) are padding: their output is 0
    and they pass no gradient. ``kernel`` picks the attention kernel (see
    ``flash_kernels``); ``num_head_groups`` how many K/V head groups the all-gather is
    split into (default: 2 for long sequences, 1 for short ones; see ``_head_groups``).
    """
    comm = _check_arguments(query, key, value, cp_comm_type, packed_seq_params)
    cp_size, cp_rank = cp_size_and_rank(cp_group)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
    s_local = query.shape[0]
    if cp_size == 1:
        plan = _local_plan(s_local, 1, packed_seq_params, query.device)
        return _LocalAttention.apply(query, key, value, plan, scale, kernel)
    if comm == "a2a":
        return _all_to_all_attention(query, key, value, cp_group, packed_seq_params, scale, kernel)
    if packed_seq_params is None and s_local % 2 != 0:
        raise ValueError(
            f"context_parallel_attention: the local sequence length ({s_local}) must be even "
            "(two load-balanced chunks per CP rank)"
        )
    if comm == "p2p":
        if packed_seq_params is not None:
            plan = _ring_plan(s_local, cp_size, cp_rank, packed_seq_params, query.device)
            return _PackedRingAttention.apply(query, key, value, cp_group, plan, scale, kernel)
        return _RingAttention.apply(query, key, value, cp_group, scale, kernel)
    plan = _gather_plan(s_local, cp_size, cp_rank, packed_seq_params, query.device)
    work_rows = (s_local // 2) * query.shape[2] * query.shape[1]
    groups = _head_groups(key.shape[2], num_head_groups, work_rows)
    return _AllGatherAttention.apply(query, key, value, cp_group, plan, scale, kernel, groups)


# ----------------------------------------------------------------------------- plans


Rows = Union[slice, torch.Tensor]


@dataclass
class _Part:
    """One kernel call: local query rows against rows of the natural-order keys.

    Dense (``cu_q`` None): one bottom-right causal block. Packed: varlen with cumulative
    lengths, each document's queries against that document's key prefix.
    """

    q_rows: Rows
    k_rows: Rows
    cu_q: Optional[torch.Tensor] = None
    cu_k: Optional[torch.Tensor] = None
    max_q: int = 0
    max_k: int = 0
    causal: bool = True


@dataclass
class _Plan:
    """How this rank's attention is cut into kernel calls.

    ``natural``: index taking gathered (rank-order) rows to natural (position) order, and
    ``gathered`` its inverse (None: already natural). ``valid``: float mask of real local rows
    [s_local, 1, 1, 1] (None: all real).
    """

    parts: List[_Part]
    natural: Optional[torch.Tensor] = None
    gathered: Optional[torch.Tensor] = None
    valid: Optional[torch.Tensor] = None


def _local_plan(s_local: int, cp_size: int, packed, device) -> _Plan:
    """The whole (gathered, natural-order) sequence at once: C = 1, or a2a after the exchange."""
    total = s_local * cp_size
    if packed is None:
        return _Plan([_Part(slice(None), slice(None))])
    docs = _documents(packed, total, cp_size)
    cu = torch.tensor(docs.padded_offsets, dtype=torch.int32, device=device)
    part = _Part(slice(None), slice(None), cu, cu, max(docs.lengths), max(docs.lengths))
    natural = gathered = None
    if cp_size > 1:
        gathered = torch.cat(
            [thd_partitioned_indices(cu, total, cp_size, r) for r in range(cp_size)]
        ).to(device)
        natural = torch.argsort(gathered)
    positions = torch.arange(total, device=device)
    return _Plan([part], natural, gathered, _valid_mask(docs, positions, device))


def _gather_plan(s_local: int, cp_size: int, cp_rank: int, packed, device) -> _Plan:
    """The two local chunks, each one call over its key prefix (all-gather mode)."""
    total = s_local * cp_size
    if packed is None:
        natural, gathered = _dense_orders(total, cp_size, device)
        chunk = s_local // 2
        parts = []
        for half, g in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
            parts.append(_Part(slice(half * chunk, (half + 1) * chunk), slice(0, (g + 1) * chunk)))
        return _Plan(parts, natural, gathered)
    docs = _documents(packed, total, cp_size)
    local = thd_partitioned_indices(docs.padded_offsets, total, cp_size, cp_rank)
    gathered = torch.cat(
        [thd_partitioned_indices(docs.padded_offsets, total, cp_size, r) for r in range(cp_size)]
    )
    parts = []
    for half, g in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        q_rows, k_rows, len_q, len_k = [], [], [], []
        local_start = 0
        for start, length in zip(docs.padded_offsets[:-1], docs.padded_lengths):
            k = length // (2 * cp_size)
            q_rows.append(torch.arange(local_start + half * k, local_start + (half + 1) * k))
            k_rows.append(torch.arange(start, start + (g + 1) * k))
            len_q.append(k)
            len_k.append((g + 1) * k)
            local_start += 2 * k
        parts.append(
            _Part(
                torch.cat(q_rows).to(device),
                torch.cat(k_rows).to(device),
                _cumulative(len_q, device),
                _cumulative(len_k, device),
                max(len_q),
                max(len_k),
            )
        )
    return _Plan(
        parts,
        torch.argsort(gathered).to(device),
        gathered.to(device),
        _valid_mask(docs, local.to(device), device),
    )


@functools.lru_cache(maxsize=16)
def _dense_orders(total: int, cp_size: int, device: torch.device):
    """(natural, gathered) row orders of a gathered dense sequence, built once per shape:
    gathered[j] is the position of gathered row j, natural its inverse permutation."""
    gathered = cp_gathered_positions(total, cp_size).to(device)
    return torch.argsort(gathered), gathered


@dataclass
class _Documents:
    padded_offsets: List[int]  # cumulative padded lengths, from 0 to the packed length
    padded_lengths: List[int]
    lengths: List[int]  # real lengths


def _documents(packed, total: int, cp_size: int) -> _Documents:
    """Documents of a THD batch of ``total`` tokens, checked against the CP split."""
    if getattr(packed, "qkv_format", "thd") not in ("thd", None):
        raise ValueError(
            f"context_parallel_attention: packed_seq_params.qkv_format must be 'thd', got "
            f"{packed.qkv_format!r}"
        )
    real = packed.cu_seqlens_q
    padded = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else real
    if real is None:
        raise ValueError("context_parallel_attention: packed_seq_params.cu_seqlens_q is None")
    real, padded = [int(x) for x in real.tolist()], [int(x) for x in padded.tolist()]
    if len(real) != len(padded) or padded[0] != 0 or real[0] != 0:
        raise ValueError(
            "context_parallel_attention: cu_seqlens_q and cu_seqlens_q_padded must start at 0 "
            f"and have equal lengths, got {real} and {padded}"
        )
    if padded[-1] > total:
        raise ValueError(
            f"context_parallel_attention: cu_seqlens_q_padded ends at {padded[-1]}, past the "
            f"packed length {total} (= s_local * C)"
        )
    if padded[-1] < total:  # the tail: one more document, all padding
        padded, real = padded + [total], real + [real[-1]]
    padded_lengths = [b - a for a, b in zip(padded[:-1], padded[1:])]
    lengths = [b - a for a, b in zip(real[:-1], real[1:])]
    for i, (length, padded_length) in enumerate(zip(lengths, padded_lengths)):
        if not 0 <= length <= padded_length or padded_length % (2 * cp_size if cp_size > 1 else 1):
            raise ValueError(
                f"context_parallel_attention: document {i} has real length {length} and padded "
                f"length {padded_length}; expected 0 <= real <= padded and padded a multiple "
                f"of 2 * context_parallel_size ({2 * cp_size})"
            )
    return _Documents(padded, padded_lengths, lengths)


def _valid_mask(docs: _Documents, positions: torch.Tensor, device) -> Optional[torch.Tensor]:
    """1 where the natural position ``positions[i]`` is a real token, as [n, 1, 1, 1]."""
    if all(a == b for a, b in zip(docs.lengths, docs.padded_lengths)):
        return None
    starts = torch.tensor(docs.padded_offsets[:-1], device=device)
    lengths = torch.tensor(docs.lengths, device=device)
    doc = torch.searchsorted(starts, positions, right=True) - 1
    valid = (positions - starts[doc]) < lengths[doc]
    return valid.view(-1, 1, 1, 1)


def _cumulative(lengths: List[int], device) -> torch.Tensor:
    return torch.tensor([0] + lengths, device=device, dtype=torch.int32).cumsum(0).int()


def _head_groups(
    num_kv_heads: int, num_groups: Optional[int], work_rows: int
) -> List[Tuple[int, int]]:
    """Split kv heads [0, n) into ``num_groups`` contiguous groups.

    Default: 2 (the second group's gather overlaps the first group's compute) once a group
    still gives the kernels enough parallel work, i.e. when ``work_rows`` (local chunk
    length x query heads x batch) >= 131072; else 1 (short sequences: one call per chunk
    keeps every multiprocessor busy, and the gather is small).
    """
    if num_groups is None:
        count = min(num_kv_heads, 2) if work_rows >= 131072 else 1
    else:
        count = num_groups
    if not 1 <= count <= num_kv_heads:
        raise ValueError(
            f"context_parallel_attention: num_head_groups must be in [1, {num_kv_heads}], "
            f"got {num_groups!r}"
        )
    bounds = [round(i * num_kv_heads / count) for i in range(count + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


# ----------------------------------------------------------------------------- row helpers


def _rows(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _put_rows(dst: torch.Tensor, rows: Rows, src: torch.Tensor) -> None:
    if isinstance(rows, slice):
        dst[rows] = src
    else:
        dst.index_copy_(0, rows, src.to(dst.dtype))


def _add_rows(dst: torch.Tensor, rows: Rows, src: torch.Tensor) -> None:
    if isinstance(rows, slice):
        dst[rows] += src
    else:
        dst.index_add_(0, rows, src.to(dst.dtype))


def _lse_rows(lse: torch.Tensor, rows: Rows) -> torch.Tensor:
    return lse[:, :, rows] if isinstance(rows, slice) else lse.index_select(2, rows)


def _put_lse_rows(dst: torch.Tensor, rows: Rows, src: torch.Tensor) -> None:
    if isinstance(rows, slice):
        dst[:, :, rows] = src
    else:
        dst.index_copy_(2, rows, src)


def _attend(part: _Part, q, k, v, scale, kernel):
    """Kernel forward on [rows, b, n, d] tensors -> (out [rows, b, n, d], lse [b, n, rows])."""
    if part.cu_q is None:
        out, lse = fk.attention_forward(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), part.causal, scale, kernel
        )
        return out.transpose(0, 1), lse
    out, lse = fk.varlen_forward(
        q[:, 0],
        k[:, 0],
        v[:, 0],
        part.cu_q,
        part.cu_k,
        part.max_q,
        part.max_k,
        part.causal,
        scale,
        kernel,
    )
    return out.unsqueeze(1), lse.unsqueeze(0)


def _attend_backward(part: _Part, dout, q, k, v, out, lse, scale, kernel):
    """Kernel backward on [rows, b, n, d] tensors -> (dq, dk, dv) in the same layout."""
    if part.cu_q is None:
        grads = fk.attention_backward(
            dout.transpose(0, 1),
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            out.transpose(0, 1),
            lse,
            part.causal,
            scale,
            kernel,
        )
        return tuple(g.transpose(0, 1) for g in grads)
    grads = fk.varlen_backward(
        dout[:, 0],
        q[:, 0],
        k[:, 0],
        v[:, 0],
        out[:, 0],
        lse[0],
        part.cu_q,
        part.cu_k,
        part.max_q,
        part.max_k,
        part.causal,
        scale,
        kernel,
    )
    return tuple(g.unsqueeze(1) for g in grads)


# ----------------------------------------------------------------------------- C = 1 / a2a


class _LocalAttention(torch.autograd.Function):
    """Causal attention of a whole (natural-order) sequence: one kernel call per part."""

    @staticmethod
    def forward(ctx, query, key, value, plan: _Plan, scale: float, kernel):
        ctx.plan, ctx.scale, ctx.kernel = plan, scale, kernel
        if _whole(plan):  # one call over everything: use the kernel's tensors as they are
            out, lse = _attend(plan.parts[0], query, key, value, scale, kernel)
            if plan.valid is not None:
                out = out * plan.valid
            ctx.save_for_backward(query, key, value, out, lse)
            return out
        out = torch.empty_like(query)
        lse = query.new_empty(
            (query.shape[1], query.shape[2], query.shape[0]), dtype=fk.acc_dtype(query.dtype)
        )
        for part in plan.parts:
            o, lse_blk = _attend(part, _rows(query, part.q_rows), key, value, scale, kernel)
            _put_rows(out, part.q_rows, o)
            _put_lse_rows(lse, part.q_rows, lse_blk)
        if plan.valid is not None:
            out = out * plan.valid
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        plan = ctx.plan
        if plan.valid is not None:
            grad_out = grad_out * plan.valid
        if _whole(plan):
            grads = _attend_backward(
                plan.parts[0], grad_out, query, key, value, out, lse, ctx.scale, ctx.kernel
            )
            dq, dk, dv = (g.to(x.dtype) for g, x in zip(grads, (query, key, value)))
            return dq, dk, dv, None, None, None
        dq = torch.zeros_like(query)
        dk = torch.zeros(key.shape, device=key.device, dtype=fk.acc_dtype(key.dtype))
        dv = torch.zeros_like(dk)
        for part in plan.parts:
            rows = part.q_rows
            gq, gk, gv = _attend_backward(
                part,
                _rows(grad_out, rows),
                _rows(query, rows),
                key,
                value,
                _rows(out, rows),
                _lse_rows(lse, rows),
                ctx.scale,
                ctx.kernel,
            )
            _put_rows(dq, rows, gq)
            dk += gk.to(dk.dtype)
            dv += gv.to(dv.dtype)
        return dq, dk.to(key.dtype), dv.to(value.dtype), None, None, None


def _whole(plan: _Plan) -> bool:
    """The plan is one kernel call over all rows."""
    rows = plan.parts[0].q_rows
    return len(plan.parts) == 1 and isinstance(rows, slice) and rows == slice(None)


def _all_to_all_attention(query, key, value, group, packed, scale, kernel):
    """Ulysses: sequence shards -> head shards, local causal attention, and back."""
    cp_size = dist.get_world_size(group=group)
    n_q, n_kv = query.shape[2], key.shape[2]
    if n_q % cp_size or n_kv % cp_size:
        raise ValueError(
            f"context_parallel_attention: cp_comm_type='a2a' needs the query heads ({n_q}) and "
            f"key/value heads ({n_kv}) divisible by the CP size ({cp_size})"
        )
    s_local = query.shape[0]
    if packed is None:
        natural, gathered = _dense_orders(s_local * cp_size, cp_size, query.device)
        plan = _Plan([_Part(slice(None), slice(None))], natural, gathered)
    else:
        plan = _local_plan(s_local, cp_size, packed, query.device)
    # Heads [k_0..k_g, v_0..v_g] regrouped so that rank r's share holds its k heads then its
    # v heads: [s, b, C, 2, ng / C, d] -> one exchange for both.
    s, b, _, d = key.shape
    kv = torch.stack([x.view(s, b, cp_size, n_kv // cp_size, d) for x in (key, value)], dim=3)
    kv = kv.view(s, b, 2 * n_kv, d)
    q_full = _SeqToHeads.apply(query, group).index_select(0, plan.natural)
    kv_full = _SeqToHeads.apply(kv.contiguous(), group).index_select(0, plan.natural)
    k_full, v_full = kv_full.chunk(2, dim=2)
    out = _LocalAttention.apply(q_full, k_full, v_full, plan, scale, kernel)
    return _HeadsToSeq.apply(out.index_select(0, plan.gathered), group)


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    c = dist.get_world_size(group=group)
    s, b, n, d = x.shape
    send = x.reshape(s, b, c, n // c, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.view(c * s, b, n // c, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    c = dist.get_world_size(group=group)
    s_total, b, m, d = x.shape
    send = x.contiguous().view(c, s_total // c, b, m, d)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(s_total // c, b, c * m, d)


_SeqToHeads = _adjoint_pair(
    "_SeqToHeads",
    "[s_local, b, n, d] sequence shard -> [C * s_local, b, n / C, d] (rank order) for this "
    "rank's heads n/C * r .. n/C * (r + 1); backward is the inverse exchange.",
    _seq_to_heads,
    _heads_to_seq,
)
_HeadsToSeq = _adjoint_pair(
    "_HeadsToSeq", "Inverse of ``_SeqToHeads``.", _heads_to_seq, _seq_to_heads
)


# ----------------------------------------------------------------------------- all-gather


class _AllGatherAttention(torch.autograd.Function):
    """All-gather CP attention, one head group at a time (see the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, group, plan: _Plan, scale, kernel, head_groups):
        rep = query.shape[2] // key.shape[2]
        out = torch.empty_like(query)
        lse = query.new_empty(
            (query.shape[1], query.shape[2], query.shape[0]), dtype=fk.acc_dtype(query.dtype)
        )
        pending = _start_gather(key, value, head_groups[0], group)
        for i, (h0, h1) in enumerate(head_groups):
            kv = pending.result().index_select(0, plan.natural)
            if i + 1 < len(head_groups):
                pending = _start_gather(key, value, head_groups[i + 1], group)
            k_all, v_all = kv.chunk(2, dim=2)
            heads = slice(h0 * rep, h1 * rep)
            for part in plan.parts:
                o, lse_blk = _attend(
                    part,
                    _rows(query[:, :, heads], part.q_rows),
                    _rows(k_all, part.k_rows),
                    _rows(v_all, part.k_rows),
                    scale,
                    kernel,
                )
                _put_rows(out[:, :, heads], part.q_rows, o)
                _put_lse_rows(lse[:, heads], part.q_rows, lse_blk)
            del kv, k_all, v_all
        if plan.valid is not None:
            out = out * plan.valid
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.plan, ctx.scale, ctx.kernel, ctx.head_groups = (
            group,
            plan,
            scale,
            kernel,
            head_groups,
        )
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        plan, group, scale, kernel = ctx.plan, ctx.group, ctx.scale, ctx.kernel
        if plan.valid is not None:
            grad_out = grad_out * plan.valid
        rep = query.shape[2] // key.shape[2]
        dq = torch.zeros_like(query)
        dk, dv = torch.empty_like(key), torch.empty_like(value)
        reductions = []
        pending = _start_gather(key, value, ctx.head_groups[0], group)
        for i, (h0, h1) in enumerate(ctx.head_groups):
            kv = pending.result().index_select(0, plan.natural)
            if i + 1 < len(ctx.head_groups):
                pending = _start_gather(key, value, ctx.head_groups[i + 1], group)
            k_all, v_all = kv.chunk(2, dim=2)
            dkv = torch.zeros(kv.shape, device=kv.device, dtype=fk.acc_dtype(kv.dtype))
            dk_all, dv_all = dkv.chunk(2, dim=2)
            heads = slice(h0 * rep, h1 * rep)
            for part in plan.parts:
                rows = part.q_rows
                gq, gk, gv = _attend_backward(
                    part,
                    _rows(grad_out[:, :, heads], rows),
                    _rows(query[:, :, heads], rows),
                    _rows(k_all, part.k_rows),
                    _rows(v_all, part.k_rows),
                    _rows(out[:, :, heads], rows),
                    _lse_rows(lse[:, heads], rows),
                    scale,
                    kernel,
                )
                _put_rows(dq[:, :, heads], rows, gq)
                _add_rows(dk_all, part.k_rows, gk)
                _add_rows(dv_all, part.k_rows, gv)
            del kv, k_all, v_all
            reductions.append(((h0, h1), _start_reduce_scatter(dkv, plan, group)))
        for (h0, h1), reduction in reductions:
            local = reduction.result()
            dk[:, :, h0:h1], dv[:, :, h0:h1] = local.chunk(2, dim=2)
        return dq, dk, dv, None, None, None, None, None


class _Pending:
    """An asynchronous collective and how to turn its buffers into the result."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish()


def _start_gather(key, value, heads: Tuple[int, int], group) -> _Pending:
    """Start all-gathering K/V heads h0:h1 as one [C * s_local, b, 2 (h1 - h0), d] tensor."""
    h0, h1 = heads
    local = torch.cat([key[:, :, h0:h1], value[:, :, h0:h1]], dim=2).contiguous()
    world = dist.get_world_size(group=group)
    if _is_nccl(group):
        out = local.new_empty((world * local.shape[0],) + tuple(local.shape[1:]))
        work = dist.all_gather_into_tensor(out, local, group=group, async_op=True)
        return _Pending(work, lambda: out)
    parts = [torch.empty_like(local) for _ in range(world)]
    work = dist.all_gather(parts, local, group=group, async_op=True)
    return _Pending(work, lambda: torch.cat(parts, dim=0))


def _start_reduce_scatter(dkv_natural: torch.Tensor, plan: _Plan, group) -> _Pending:
    """Start summing the float32 K/V gradients over ranks, keeping this rank's rows."""
    full = dkv_natural.index_select(0, plan.gathered)
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    if _is_nccl(group):
        out = full.new_empty((full.shape[0] // world,) + tuple(full.shape[1:]))
        work = dist.reduce_scatter_tensor(out, full, group=group, async_op=True)
        return _Pending(work, lambda: out)
    work = dist.all_reduce(full, group=group, async_op=True)  # gloo has no reduce-scatter
    return _Pending(work, lambda: full.chunk(world, dim=0)[rank])


def _is_nccl(group) -> bool:
    return "nccl" in str(dist.get_backend(group)).lower()


# ----------------------------------------------------------------------------- ring (p2p)


class _RingAttention(torch.autograd.Function):
    """Load-balanced ring CP attention with float32 LSE merging (see the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, group, scale, kernel):
        world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        s_local, b, n_q, d = query.shape
        acc_dtype = fk.acc_dtype(query.dtype)
        acc = torch.empty((b, s_local, n_q, d), device=query.device, dtype=acc_dtype)
        acc_lse = torch.empty((b, n_q, s_local), device=query.device, dtype=acc_dtype)
        kv = torch.cat([key, value], dim=2).contiguous()
        q = query.transpose(0, 1)
        for step in range(world):
            exchange = _ring_exchange(kv, group, tag=0) if step + 1 < world else None
            q_rows, kv_rows, causal = _ring_block(step, rank, world, s_local)
            k_blk, v_blk = kv[kv_rows].transpose(0, 1).chunk(2, dim=2)
            o, lse_blk = fk.attention_forward(q[:, q_rows], k_blk, v_blk, causal, scale, kernel)
            if step == 0:  # the local block covers every row: it starts the accumulators
                acc.copy_(o)
                acc_lse.copy_(fk.finite_lse(lse_blk))
            else:
                fk.merge_into(acc[:, q_rows], acc_lse[:, :, q_rows], o, lse_blk)
            if exchange is not None:
                kv = exchange.result()
        out = acc.to(query.dtype).transpose(0, 1).contiguous()
        ctx.save_for_backward(query, key, value, out, acc_lse)
        ctx.group, ctx.scale, ctx.kernel = group, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        group, scale, kernel = ctx.group, ctx.scale, ctx.kernel
        world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        s_local, n_kv = query.shape[0], key.shape[2]
        q, o, do = (x.transpose(0, 1) for x in (query, out, grad_out))
        acc_dtype = fk.acc_dtype(query.dtype)
        dq = torch.zeros(q.shape, device=q.device, dtype=acc_dtype)
        kv = torch.cat([key, value], dim=2).contiguous()
        dkv = torch.zeros(kv.shape, device=kv.device, dtype=acc_dtype)
        dkv_exchange = None
        for step in range(world):
            exchange = _ring_exchange(kv, group, tag=1) if step + 1 < world else None
            q_rows, kv_rows, causal = _ring_block(step, rank, world, s_local)
            k_blk, v_blk = kv[kv_rows].transpose(0, 1).chunk(2, dim=2)
            gq, gk, gv = fk.attention_backward(
                do[:, q_rows],
                q[:, q_rows],
                k_blk,
                v_blk,
                o[:, q_rows],
                lse[:, :, q_rows],
                causal,
                scale,
                kernel,
            )
            dq[:, q_rows] += gq.to(acc_dtype)
            if dkv_exchange is not None:
                dkv = dkv_exchange.result()
            dkv[kv_rows, :, :n_kv] += gk.to(acc_dtype).transpose(0, 1)
            dkv[kv_rows, :, n_kv:] += gv.to(acc_dtype).transpose(0, 1)
            dkv_exchange = _ring_exchange(dkv, group, tag=2)
            if exchange is not None:
                kv = exchange.result()
        dkv = dkv_exchange.result()  # after C hops each rank holds its own K/V gradient
        dk, dv = dkv.chunk(2, dim=2)
        dq = dq.to(query.dtype).transpose(0, 1).contiguous()
        return dq, dk.to(key.dtype), dv.to(value.dtype), None, None, None


@dataclass
class _RingPlan:
    """Packed (THD) ring: the kernel call of each kind of step, and the real-row mask.

    Every rank lays document d out at the same local rows [o_d, o_d + 2 k_d) (its chunks r
    and 2C-1-r of k_d tokens), so one plan serves the K/V of every source rank.
    """

    local: _Part  # step 0: each document's two local chunks, causal
    lower: _Part  # source rank < r: every local query against the source's first chunks
    upper: _Part  # source rank > r: second local chunks against both source chunks
    valid: Optional[torch.Tensor]


def _ring_plan(s_local: int, cp_size: int, cp_rank: int, packed, device) -> _RingPlan:
    docs = _documents(packed, s_local * cp_size, cp_size)
    halves = [length // (2 * cp_size) for length in docs.padded_lengths]
    first, second, start = [], [], 0
    for k in halves:
        first.append(torch.arange(start, start + k))
        second.append(torch.arange(start + k, start + 2 * k))
        start += 2 * k
    first_rows, second_rows = torch.cat(first).to(device), torch.cat(second).to(device)
    whole = [2 * k for k in halves]
    cu_whole, cu_half = _cumulative(whole, device), _cumulative(halves, device)
    longest, longest_half = max(whole), max(halves)
    local_positions = thd_partitioned_indices(
        docs.padded_offsets, s_local * cp_size, cp_size, cp_rank
    )
    return _RingPlan(
        local=_Part(slice(None), slice(None), cu_whole, cu_whole, longest, longest, True),
        lower=_Part(slice(None), first_rows, cu_whole, cu_half, longest, longest_half, False),
        upper=_Part(second_rows, slice(None), cu_half, cu_whole, longest_half, longest, False),
        valid=_valid_mask(docs, local_positions.to(device), device),
    )


def _ring_part(plan: _RingPlan, step: int, rank: int, world: int) -> _Part:
    if step == 0:
        return plan.local
    return plan.lower if (rank - step) % world < rank else plan.upper


class _PackedRingAttention(torch.autograd.Function):
    """The load-balanced ring for packed sequences: the same steps as ``_RingAttention``,
    each one varlen call over all documents (see ``_RingPlan``)."""

    @staticmethod
    def forward(ctx, query, key, value, group, plan: _RingPlan, scale, kernel):
        world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        n_kv = key.shape[2]
        acc_dtype = fk.acc_dtype(query.dtype)
        kv = torch.cat([key, value], dim=2).contiguous()
        acc = acc_lse = None
        for step in range(world):
            exchange = _ring_exchange(kv, group, tag=3) if step + 1 < world else None
            part = _ring_part(plan, step, rank, world)
            rows = part.q_rows
            k_blk, v_blk = _rows(kv, part.k_rows).split(n_kv, dim=2)
            o, lse_blk = _attend(part, _rows(query, rows), k_blk, v_blk, scale, kernel)
            if step == 0:  # covers every row
                acc, acc_lse = o.to(acc_dtype), fk.finite_lse(lse_blk).to(acc_dtype)
            else:
                acc_rows, lse_rows = _rows(acc, rows), _lse_rows(acc_lse, rows).clone()
                fk.merge_into(acc_rows.transpose(0, 1), lse_rows, o.transpose(0, 1), lse_blk)
                _put_rows(acc, rows, acc_rows)
                _put_lse_rows(acc_lse, rows, lse_rows)
            if exchange is not None:
                kv = exchange.result()
        out = acc.to(query.dtype)
        if plan.valid is not None:
            out = out * plan.valid
        ctx.save_for_backward(query, key, value, out, acc_lse)
        ctx.group, ctx.plan, ctx.scale, ctx.kernel = group, plan, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        group, plan, scale, kernel = ctx.group, ctx.plan, ctx.scale, ctx.kernel
        world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        n_kv = key.shape[2]
        if plan.valid is not None:
            grad_out = grad_out * plan.valid
        acc_dtype = fk.acc_dtype(query.dtype)
        dq = torch.zeros(query.shape, device=query.device, dtype=acc_dtype)
        kv = torch.cat([key, value], dim=2).contiguous()
        dkv = torch.zeros(kv.shape, device=kv.device, dtype=acc_dtype)
        dkv_exchange = None
        for step in range(world):
            exchange = _ring_exchange(kv, group, tag=4) if step + 1 < world else None
            part = _ring_part(plan, step, rank, world)
            rows = part.q_rows
            k_blk, v_blk = _rows(kv, part.k_rows).split(n_kv, dim=2)
            gq, gk, gv = _attend_backward(
                part,
                _rows(grad_out, rows),
                _rows(query, rows),
                k_blk,
                v_blk,
                _rows(out, rows),
                _lse_rows(lse, rows),
                scale,
                kernel,
            )
            _add_rows(dq, rows, gq.to(acc_dtype))
            if dkv_exchange is not None:
                dkv = dkv_exchange.result()
            _add_rows(dkv, part.k_rows, torch.cat([gk, gv], dim=2).to(acc_dtype))
            dkv_exchange = _ring_exchange(dkv, group, tag=5)
            if exchange is not None:
                kv = exchange.result()
        dkv = dkv_exchange.result()
        dk, dv = dkv.split(n_kv, dim=2)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None, None


def _ring_block(step: int, rank: int, world: int, s_local: int):
    """(query rows, K/V rows, causal) rank ``rank`` computes at ring step ``step``.

    The K/V held then come from rank src = (rank - step) mod C, chunks src and 2C-1-src.
    """
    half = s_local // 2
    if step == 0:
        return slice(None), slice(None), True
    if (rank - step) % world < rank:  # source chunk src < r: every local query sees it
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False  # only chunk 2C-1-r sees both source chunks


def _ring_exchange(tensor: torch.Tensor, group, tag: int) -> _Pending:
    """Start sending ``tensor`` to the next rank of the ring and receiving the previous one's."""
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    ranks = dist.get_process_group_ranks(group)
    nxt, prv = ranks[(rank + 1) % world], ranks[(rank - 1) % world]
    recv = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, nxt, group, tag),
        dist.P2POp(dist.irecv, recv, prv, group, tag),
    ]
    works = dist.batch_isend_irecv(ops)

    def finish():
        return recv

    return _Pending(_WaitAll(works), finish)


class _WaitAll:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()


# ----------------------------------------------------------------------------- checks


def _check_arguments(query, key, value, cp_comm_type, packed) -> str:
    """Validate shapes and options before any collective; returns the comm type."""
    comm = "all_gather" if cp_comm_type is None else cp_comm_type
    if comm not in CP_COMM_TYPES:
        raise ValueError(
            f"context_parallel_attention: cp_comm_type must be one of {CP_COMM_TYPES} or None, "
            f"got {cp_comm_type!r}"
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
    return comm
