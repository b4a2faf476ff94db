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
  time, the next group's gather running while the current group is computed. Per group:
  the local block (both local chunks against the local K/V, one square causal call) runs
  while the gather is in flight; then one mask-free call per other rank j: every local
  query against j's first chunk when j < r, the second local chunk against both of j's
  chunks when j > r. Partial results are merged by their log-sum-exp in float32.
  Backward re-gathers K/V (nothing of size s is saved), reduce-scatters the float32
  key/value gradients of the other ranks' keys while it computes the local block.
- ``"p2p"``: the load-balanced ring: the same calls, with K/V travelling around the CP
  group in C steps overlapped with compute (at step i rank r holds the K/V of rank
  (r - i) mod C). Backward sends the float32 key/value gradients around the ring with the
  K/V, one extra hop bringing them home.
- ``"a2a"``: heads all-to-all (Ulysses): every rank gets the whole sequence for n/C of the
  heads, runs one causal kernel call, and sends the result back. Needs n and n_kv divisible
  by C.
- ``"a2a+p2p"`` (hierarchical, C = A x P): heads all-to-all within groups of A consecutive
  CP ranks, after which each rank holds n/A heads of a load-balanced shard of a split over
  P ranks; the p2p ring runs over those P ranks, and the heads go back. Needs n and n_kv
  divisible by A. (The all-to-all suits fast links within a node, the ring the links
  between nodes.)

Packed sequences (``PackedSeqParams``, THD) work in every mode: each document is split over
the ranks on its own, and each kernel call above becomes one varlen call over all documents
(a loop over documents where the varlen op is missing or the dtype is not half precision).

Each mode is a ``torch.autograd.Function`` that calls the kernels' forward and backward ops
itself (the kernels' log-sum-exp is not differentiable). Only square blocks are causal, so
kernels whose causal mask is top-left aligned (cuDNN) need no split. In all_gather and p2p
every result is a sum of several calls' partials: bf16 inputs run on the fp16 kernels
through exact power-of-two factors (``_Rescale``) so that the partials keep 11 significant
bits and the float32 sum is rounded to bf16 once. Memory per rank: saved tensors are
the local Q, K, V, output and a float32 LSE, O(s/C); transient buffers hold K/V of one head
group for the whole sequence (all_gather) or of one peer (p2p).
"""

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar, Union

import torch
import torch.distributed as dist

from megatron.core.context_parallel import (
    cp_shard_positions,
    cp_size_and_rank,
    thd_document_positions,
    thd_partitioned_indices,
)
from megatron.core.tensor_parallel.mappings import _adjoint_pair
from megatron.core.transformer import flash_kernels as fk
from megatron.core.transformer.transformer_config import CP_COMM_TYPES


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
    ``flash_kernels``); ``num_head_groups`` how many K/V head groups the all-gather is
    split into (default: one, unless the gathered K/V would exceed 2 GiB; see
    ``_head_groups``).
    """
    comm = _check_arguments(query, key, value, cp_comm_type, cp_group, packed_seq_params)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
    if comm == "a2a+p2p":
        a2a_group, ring = cp_group
        return _all_to_all_attention(
            query, key, value, a2a_group, packed_seq_params, scale, kernel, ring
        )
    cp_size, cp_rank = cp_size_and_rank(cp_group)
    s_local = query.shape[0]
    if cp_size == 1:
        plan = _local_plan(s_local, packed_seq_params, query.device)
        return _LocalAttention.apply(query, key, value, plan, scale, kernel)
    if comm == "a2a":
        return _all_to_all_attention(query, key, value, cp_group, packed_seq_params, scale, kernel)
    if packed_seq_params is None and s_local % 2 != 0:
        raise ValueError(
            f"context_parallel_attention: the local sequence length ({s_local}) must be even "
            "(two load-balanced chunks per CP rank)"
        )
    plan = _block_plan(s_local, cp_size, cp_rank, packed_seq_params, query.device)
    if comm == "p2p":
        return _RingAttention.apply(query, key, value, cp_group, plan, scale, kernel)
    gathered_bytes = 2 * key.numel() * key.element_size() * cp_size
    groups = _head_groups(key.shape[2], num_head_groups, gathered_bytes)
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
    """How a whole (natural-order) sequence is cut into kernel calls. ``valid``: float mask of
    real rows [s, 1, 1, 1] (None: all real)."""

    parts: List[_Part]
    valid: Optional[torch.Tensor] = None


def _local_plan(total: int, packed, device) -> _Plan:
    """The whole natural-order sequence at once: C = 1, or a2a after the exchange."""
    if packed is None:
        return _Plan([_Part(slice(None), slice(None))])
    return _cached(
        packed, ("local", total, device), lambda: _packed_local_plan(total, packed, device)
    )


def _packed_local_plan(total: int, packed, device) -> _Plan:
    docs = _documents(packed, total, 1)
    cu = torch.tensor(docs.padded_offsets, dtype=torch.int32, device=device)
    part = _Part(slice(None), slice(None), cu, cu, max(docs.lengths), max(docs.lengths))
    return _Plan([part], _valid_mask(docs, torch.arange(total, device=device), device))


def _exchange_order(s_local: int, a2a_size: int, ring_size: int, ring_rank: int, packed, device):
    """Rows of a heads exchange over CP ranks jA .. jA+A-1 (j = ``ring_rank``, A =
    ``a2a_size``), in the order of ring rank j's load-balanced shard of a split over
    P = ``ring_size`` ranks (P = 1: natural order), and the inverse permutation.

    The exchanged rows are the shards of those A ranks in rank order (chunks jA+i and
    2C-1-jA-i of 2C, C = A * P; packed: of every document); together they are exactly the
    coarse chunks j and 2P-1-j of 2P, which the ring's plan expects.
    """
    cp_size, total = a2a_size * ring_size, s_local * a2a_size * ring_size
    if packed is None:
        return _dense_exchange_order(total, cp_size, a2a_size, ring_size, ring_rank, device)
    key = ("exchange", total, a2a_size, ring_size, ring_rank, device)
    return _cached(
        packed,
        key,
        lambda: _packed_exchange_order(total, a2a_size, ring_size, ring_rank, packed, device),
    )


def _packed_exchange_order(total, a2a_size, ring_size, ring_rank, packed, device):
    cp_size = a2a_size * ring_size
    members = range(ring_rank * a2a_size, (ring_rank + 1) * a2a_size)
    offsets = _documents(packed, total, cp_size).padded_offsets
    held = torch.cat([thd_partitioned_indices(offsets, total, cp_size, r) for r in members])
    target = thd_partitioned_indices(offsets, total, ring_size, ring_rank)
    return _inverse_lookup(held, target, total, device)


@functools.lru_cache(maxsize=16)
def _dense_exchange_order(total, cp_size, a2a_size, ring_size, ring_rank, device):
    """``_exchange_order`` of a dense sequence, built once per shape."""
    members = range(ring_rank * a2a_size, (ring_rank + 1) * a2a_size)
    held = torch.cat([cp_shard_positions(total, cp_size, r) for r in members])
    target = cp_shard_positions(total, ring_size, ring_rank)
    return _inverse_lookup(held, target, total, device)


def _inverse_lookup(held: torch.Tensor, target: torch.Tensor, total: int, device):
    """(order, back): held[order] == target and order[back] == arange."""
    row_of = torch.full((total,), -1, dtype=torch.long)
    row_of[held] = torch.arange(held.numel())
    order = row_of[target]
    return order.to(device), torch.argsort(order).to(device)


_T = TypeVar("_T")
_PLANS: "OrderedDict[tuple, tuple]" = OrderedDict()  # see _cached
_PLANS_KEPT = 16


def _cached(packed, key: tuple, build: Callable[[], _T]) -> _T:
    """``build()`` for packed sequences, remembered per ``cu_seqlens`` tensors.

    Written by hand because no library caches on a tensor's identity and version. Building a
    packed plan reads ``cu_seqlens_q`` (and ``_padded``) on the host and copies index tensors
    to the device: on a GPU each is a synchronization, and every layer of a forward pass
    attends with the same ``PackedSeqParams``. The plan is kept for the same tensor objects
    at the same ``_version`` (an in-place change bumps it; the entry holds the tensors, so
    their ids cannot be reused while it lives): one forward pass synchronizes once, not once
    per layer. The last ``_PLANS_KEPT`` plans are kept. Inference-mode tensors have no
    version counter and are not cached.
    """
    tensors = (packed.cu_seqlens_q, packed.cu_seqlens_q_padded)
    try:
        versions = tuple(None if t is None else (id(t), t._version) for t in tensors)
    except RuntimeError:  # inference tensors
        return build()
    full_key = key + versions
    hit = _PLANS.get(full_key)
    if hit is not None:
        _PLANS.move_to_end(full_key)
        return hit[1]
    plan = build()
    _PLANS[full_key] = (tensors, plan)
    while len(_PLANS) > _PLANS_KEPT:
        _PLANS.popitem(last=False)
    return plan


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
    doc, offset = thd_document_positions(positions, docs.padded_offsets, docs.padded_offsets[-1])
    valid = offset < torch.tensor(docs.lengths, device=device)[doc]
    return valid.view(-1, 1, 1, 1)


def _cumulative(lengths: List[int], device) -> torch.Tensor:
    return torch.tensor([0] + lengths, device=device, dtype=torch.int32).cumsum(0).int()


def _head_groups(
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


# ----------------------------------------------------------------------------- row helpers


def _rows(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    if isinstance(rows, slice):
        return x if rows == slice(None) else x[rows]
    return x.index_select(0, rows)


def _put_rows(dst: torch.Tensor, rows: Rows, src: torch.Tensor) -> None:
    if isinstance(rows, slice):
        dst[rows] = src
    else:
        dst.index_copy_(0, rows, src.to(dst.dtype))


def _add_rows(dst: torch.Tensor, rows: Rows, src: torch.Tensor, factor=None) -> None:
    """dst[rows] += src (times ``factor``, a float or a 0-d tensor, when given)."""
    if factor is None or not isinstance(factor, torch.Tensor):
        alpha = 1.0 if factor is None else factor
        if isinstance(rows, slice):
            _rows(dst, rows).add_(src, alpha=alpha)
        else:
            dst.index_add_(0, rows, src.to(dst.dtype), alpha=alpha)
    elif isinstance(rows, slice):
        _rows(dst, rows).addcmul_(src, factor)
    else:
        dst.index_add_(0, rows, src.to(dst.dtype) * factor)


def _heads(x: torch.Tensor, heads: slice, dim: int = 2) -> torch.Tensor:
    """Heads ``heads`` of x along ``dim`` (x itself when that is all of them)."""
    if heads.start == 0 and heads.stop == x.shape[dim]:
        return x
    return x.narrow(dim, heads.start, heads.stop - heads.start)


def _lse_rows(lse: torch.Tensor, rows: Rows) -> torch.Tensor:
    if isinstance(rows, slice):
        return lse if rows == slice(None) else lse[:, :, rows]
    return lse.index_select(2, rows)


def _put_lse_rows(dst: torch.Tensor, rows: Rows, src: torch.Tensor) -> None:
    if isinstance(rows, slice):
        dst[:, :, rows] = src
    else:
        dst.index_copy_(2, rows, src)


def _attend(part: _Part, q, k, v, scale, kernel):
    """Kernel forward on [rows, b, n, d] tensors -> (out [rows, b, n, d], lse [b, n, rows])."""
    if part.cu_q is None:
        return fk.attention_forward(q, k, v, part.causal, scale, kernel, layout="sbnd")
    out, lse = fk.varlen_forward(
        q[:, 0], k[:, 0], v[:, 0], part.cu_q, part.cu_k, part.max_q, part.max_k, part.causal,
        scale, kernel,
    )  # fmt: skip
    return out.unsqueeze(1), lse.unsqueeze(0)


def _attend_backward(part: _Part, dout, q, k, v, out, lse, scale, kernel):
    """Kernel backward on [rows, b, n, d] tensors -> (dq, dk, dv) in the same layout."""
    if part.cu_q is None:
        return fk.attention_backward(
            dout, q, k, v, out, lse, part.causal, scale, kernel, layout="sbnd"
        )
    grads = fk.varlen_backward(
        dout[:, 0], q[:, 0], k[:, 0], v[:, 0], out[:, 0], lse[0], part.cu_q, part.cu_k,
        part.max_q, part.max_k, part.causal, scale, kernel,
    )  # fmt: skip
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


def _all_to_all_attention(query, key, value, group, packed, scale, kernel, ring=None):
    """Ulysses: sequence shards -> head shards over ``group``, causal attention, and back.

    Without ``ring`` the exchanged rows are the whole sequence for n/C of the heads: one
    local causal call. With ``ring`` (a2a+p2p; CP rank = ring rank * A + rank in ``group``)
    they are ring rank j's load-balanced shard of the sequence split over the ring's P
    ranks (``_exchange_order``), and the load-balanced ring attends them for n/A heads.
    """
    a2a_size = dist.get_world_size(group=group)
    ring_size, ring_rank = cp_size_and_rank(ring)
    n_q, n_kv = query.shape[2], key.shape[2]
    if n_q % a2a_size or n_kv % a2a_size:
        raise ValueError(
            f"context_parallel_attention: cp_comm_type={'a2a' if ring is None else 'a2a+p2p'!r} "
            f"needs the query heads ({n_q}) and key/value heads ({n_kv}) divisible by the "
            f"all-to-all group size ({a2a_size})"
        )
    s_local = query.shape[0]
    order, back = _exchange_order(s_local, a2a_size, ring_size, ring_rank, packed, query.device)
    # Heads [k_0..k_g, v_0..v_g] regrouped so that rank r's share holds its k heads then its
    # v heads: [s, b, A, 2, ng / A, d] -> one exchange for both.
    s, b, _, d = key.shape
    kv = torch.stack([x.view(s, b, a2a_size, n_kv // a2a_size, d) for x in (key, value)], dim=3)
    kv = kv.view(s, b, 2 * n_kv, d)
    q_heads = _SeqToHeads.apply(query, group).index_select(0, order)
    kv_heads = _SeqToHeads.apply(kv.contiguous(), group).index_select(0, order)
    k_heads, v_heads = kv_heads.chunk(2, dim=2)
    if ring is None:
        plan = _local_plan(s_local * a2a_size, packed, query.device)
        out = _LocalAttention.apply(q_heads, k_heads, v_heads, plan, scale, kernel)
    else:
        out = context_parallel_attention(
            q_heads,
            k_heads,
            v_heads,
            cp_group=ring,
            cp_comm_type="p2p",
            softmax_scale=scale,
            packed_seq_params=packed,
            kernel=kernel,
        )
    return _HeadsToSeq.apply(out.index_select(0, back), group)


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


# ----------------------------------------------------------------------------- all-gather and p2p


@dataclass
class _BlockPlan:
    """The three kinds of kernel call of the all-gather and ring modes, and the real-row mask.

    Every rank lays its shard out alike (chunks r and 2C-1-r; packed: each document's two
    chunks at the same local rows on every rank), so one plan serves the K/V of any source
    rank: ``local`` (source = this rank: both local chunks, causal), ``lower`` (source rank
    < r: every local query against the source's first chunk(s)) and ``upper`` (source > r:
    the second local chunk(s) against all of the source's rows). Dense parts are slices of
    one block; packed parts are varlen calls over all documents.
    """

    local: _Part
    lower: _Part
    upper: _Part
    valid: Optional[torch.Tensor] = None

    def part(self, source: int, rank: int) -> _Part:
        if source == rank:
            return self.local
        return self.lower if source < rank else self.upper


def _block_plan(s_local: int, cp_size: int, cp_rank: int, packed, device) -> _BlockPlan:
    if packed is None:
        half = s_local // 2
        return _BlockPlan(
            local=_Part(slice(None), slice(None)),
            lower=_Part(slice(None), slice(0, half), causal=False),
            upper=_Part(slice(half, None), slice(None), causal=False),
        )
    key = ("block", s_local, cp_size, cp_rank, device)
    return _cached(
        packed, key, lambda: _packed_block_plan(s_local, cp_size, cp_rank, packed, device)
    )


def _packed_block_plan(s_local: int, cp_size: int, cp_rank: int, packed, device) -> _BlockPlan:
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
    return _BlockPlan(
        local=_Part(slice(None), slice(None), cu_whole, cu_whole, longest, longest, True),
        lower=_Part(slice(None), first_rows, cu_whole, cu_half, longest, longest_half, False),
        upper=_Part(second_rows, slice(None), cu_half, cu_whole, longest_half, longest, False),
        valid=_valid_mask(docs, local_positions.to(device), device),
    )


class _AllGatherAttention(torch.autograd.Function):
    """All-gather CP attention, one head group at a time (see the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, group, plan: _BlockPlan, scale, kernel, head_groups):
        world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        s_local, rep = query.shape[0], query.shape[2] // key.shape[2]
        rescale = _Rescale.for_inputs(query, key, value, group)
        kv_local = rescale.key_values(key, value)  # [K | V] heads: what the gather sends
        pending = _start_gather(kv_local, head_groups[0], group)
        q, (k, v) = rescale.query(query), kv_local.chunk(2, dim=2)
        acc, acc_lse = _accumulators(query)
        for i, (h0, h1) in enumerate(head_groups):
            heads, kv_heads = slice(h0 * rep, h1 * rep), slice(h0, h1)
            q_h, acc_h, lse_h = _heads(q, heads), _heads(acc, heads), _heads(acc_lse, heads, 1)
            # the local block needs no communication: it runs while the gather is in flight
            _forward_block(plan.local, q_h, _heads(k, kv_heads), _heads(v, kv_heads), scale, kernel,
                           acc_h, lse_h, first=True)  # fmt: skip
            kv = pending.result()
            if i + 1 < len(head_groups):
                pending = _start_gather(kv_local, head_groups[i + 1], group)
            for source in range(world):
                if source != rank:
                    k_src, v_src = kv[source * s_local : (source + 1) * s_local].chunk(2, dim=2)
                    part = plan.part(source, rank)
                    _forward_block(part, q_h, k_src, v_src, scale, kernel, acc_h, lse_h)
            del kv
        out = rescale.output(acc, query.dtype, plan.valid)
        ctx.save_for_backward(q, kv_local, out, acc_lse)  # fp16 when rescaled
        ctx.args = (group, plan, scale, kernel, rescale, query.dtype)
        ctx.head_groups = head_groups
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kv_local, out, lse = ctx.saved_tensors
        group, plan, scale, kernel, rescale, dtype = ctx.args
        world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        pending = _start_gather(kv_local, ctx.head_groups[0], group)
        k, v = kv_local.chunk(2, dim=2)
        do, o, factors = _kernel_grad_inputs(grad_out, out, q, k, plan, scale, rescale)
        s_local, rep = q.shape[0], q.shape[2] // k.shape[2]
        acc = fk.acc_dtype(dtype)
        dq = torch.zeros(q.shape, device=q.device, dtype=acc)
        dk, dv = (torch.empty(x.shape, device=x.device, dtype=dtype) for x in (k, v))
        local_grads, reductions = [], []
        last = len(ctx.head_groups) - 1
        for i, (h0, h1) in enumerate(ctx.head_groups):
            heads, kv_heads = slice(h0 * rep, h1 * rep), slice(h0, h1)
            blocks = (_heads(do, heads), _heads(q, heads), _heads(o, heads), _heads(lse, heads, 1))
            dq_h = _heads(dq, heads)
            local = (plan.local, *blocks, _heads(k, kv_heads), _heads(v, kv_heads), scale, kernel,
                     dq_h, factors)  # fmt: skip
            # The local block needs no communication: it runs while the first group's
            # gather is in flight, or, in later groups, while their reduction is. Its key
            # and value gradients wait for the other ranks' sums to be added in one pass.
            if i == 0 and last > 0:
                local_grads.append(_block_grads(*local))
            kv = pending.result()
            if i + 1 < len(ctx.head_groups):
                pending = _start_gather(kv_local, ctx.head_groups[i + 1], group)
            dkv = torch.zeros(kv.shape, device=kv.device, dtype=acc)
            for source in range(world):
                if source != rank:
                    rows = slice(source * s_local, (source + 1) * s_local)
                    k_src, v_src = kv[rows].chunk(2, dim=2)
                    dk_src, dv_src = dkv[rows].chunk(2, dim=2)
                    part = plan.part(source, rank)
                    remote = (k_src, v_src, scale, kernel, dq_h, dk_src, dv_src, factors)
                    _backward_block(part, *blocks, *remote)
            del kv
            reductions.append(_start_reduce_scatter(dkv, group))
            if i > 0 or last == 0:
                local_grads.append(_block_grads(*local))
        for (h0, h1), reduction, (gk, gv) in zip(ctx.head_groups, reductions, local_grads):
            dk_in, dv_in = reduction.result().chunk(2, dim=2)
            _add_scaled(dk[:, :, h0:h1], dk_in, gk, factors[1])
            _add_scaled(dv[:, :, h0:h1], dv_in, gv, factors[2])
        return dq.to(dtype), dk, dv, None, None, None, None, None


class _RingAttention(torch.autograd.Function):
    """Load-balanced ring CP attention with float32 LSE merging (see the module docstring).

    At step i this rank holds the K/V of source rank (r - i) mod C and computes the
    plan's part for that source.
    """

    @staticmethod
    def forward(ctx, query, key, value, group, plan: _BlockPlan, scale, kernel):
        world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        n_kv = key.shape[2]
        rescale = _Rescale.for_inputs(query, key, value, group)
        q, kv_local = rescale.query(query), rescale.key_values(key, value)
        acc, acc_lse = _accumulators(query)
        kv = kv_local
        for step in range(world):
            exchange = _ring_exchange(kv, group, tag=0) if step + 1 < world else None
            k_src, v_src = kv.split(n_kv, dim=2)
            part = plan.part((rank - step) % world, rank)
            _forward_block(part, q, k_src, v_src, scale, kernel, acc, acc_lse, first=step == 0)
            if exchange is not None:
                kv = exchange.result()
        out = rescale.output(acc, query.dtype, plan.valid)
        ctx.save_for_backward(q, kv_local, out, acc_lse)  # fp16 when rescaled
        ctx.args = (group, plan, scale, kernel, rescale, query.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, out, lse = ctx.saved_tensors
        group, plan, scale, kernel, rescale, dtype = ctx.args
        world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        n_kv = kv.shape[2] // 2
        do, o, factors = _kernel_grad_inputs(
            grad_out, out, q, kv[:, :, :n_kv], plan, scale, rescale
        )
        acc = fk.acc_dtype(dtype)
        dq = torch.zeros(q.shape, device=q.device, dtype=acc)
        dkv = torch.zeros(kv.shape, device=kv.device, dtype=acc)
        dkv_exchange = None
        for step in range(world):
            exchange = _ring_exchange(kv, group, tag=1) if step + 1 < world else None
            k_src, v_src = kv.split(n_kv, dim=2)
            part = plan.part((rank - step) % world, rank)
            gk, gv = _block_grads(part, do, q, o, lse, k_src, v_src, scale, kernel, dq, factors)
            if dkv_exchange is not None:  # the gradient buffer arrives while computing
                dkv = dkv_exchange.result()
            dk_src, dv_src = dkv.split(n_kv, dim=2)
            _add_rows(dk_src, part.k_rows, gk, factors[1])
            _add_rows(dv_src, part.k_rows, gv, factors[2])
            dkv_exchange = _ring_exchange(dkv, group, tag=2)
            if exchange is not None:
                kv = exchange.result()
        dk, dv = dkv_exchange.result().split(n_kv, dim=2)  # after C hops: this rank's own
        dq, dk, dv = (x.to(dtype) for x in (dq, dk, dv))
        return dq, dk, dv, None, None, None, None


def _kernel_grad_inputs(grad_out, out, q, k, plan: _BlockPlan, scale: float, rescale):
    """dO (padding rows zeroed) and O as the kernels take them, and the factors that undo
    the rescaling of the kernels' gradients (see ``_Rescale.grad_inputs``)."""
    if plan.valid is not None:
        grad_out = grad_out * plan.valid
    rows = q.shape[0] * (q.shape[2] // k.shape[2])  # query rows per key row in one call
    return rescale.grad_inputs(grad_out, out, rows, scale, q.shape[-1])


def _accumulators(query: torch.Tensor):
    """Float32 (float64 for float64) output [s, b, n, d] and LSE [b, n, s] accumulators."""
    s, b, n, d = query.shape
    acc = torch.empty((s, b, n, d), device=query.device, dtype=fk.acc_dtype(query.dtype))
    return acc, query.new_empty((b, n, s), dtype=acc.dtype)


def _forward_block(part: _Part, q, k, v, scale, kernel, acc, acc_lse, first: bool = False):
    """One kernel call of ``part``; ``first`` (the local part: every row, each with at least
    its own key) starts the accumulators, later parts are merged into them by LSE."""
    o, lse = _attend(part, _rows(q, part.q_rows), _rows(k, part.k_rows), _rows(v, part.k_rows),
                     scale, kernel)  # fmt: skip
    if first:
        acc.copy_(o)
        acc_lse.copy_(lse)
        return
    rows = part.q_rows
    acc_rows, lse_rows = _rows(acc, rows), _lse_rows(acc_lse, rows)
    if isinstance(rows, slice):  # dense: every query row has keys in every part
        fk.merge_into(acc_rows, lse_rows, o, lse, layout="sbnd", rows_have_keys=True)
        return
    lse_rows = lse_rows.clone()  # index rows: merge copies, then put them back
    fk.merge_into(acc_rows, lse_rows, o, lse, layout="sbnd")
    _put_rows(acc, rows, acc_rows)
    _put_lse_rows(acc_lse, rows, lse_rows)


def _block_grads(part: _Part, do, q, o, lse, k, v, scale, kernel, dq, factors):
    """Kernel backward of ``part``: adds its query gradient (times ``factors[0]``) into the
    float32 ``dq`` and returns its key and value gradients (rows ``part.k_rows`` of k, v)."""
    rows = part.q_rows
    gq, gk, gv = _attend_backward(
        part,
        _rows(do, rows),
        _rows(q, rows),
        _rows(k, part.k_rows),
        _rows(v, part.k_rows),
        _rows(o, rows),
        _lse_rows(lse, rows),
        scale,
        kernel,
    )
    _add_rows(dq, rows, gq, factors[0])
    return gk, gv


def _backward_block(part: _Part, do, q, o, lse, k, v, scale, kernel, dq, dk, dv, factors):
    """Kernel backward of ``part``, its gradients (times ``factors``) added into the float32
    dq, dk, dv."""
    gk, gv = _block_grads(part, do, q, o, lse, k, v, scale, kernel, dq, factors)
    _add_rows(dk, part.k_rows, gk, factors[1])
    _add_rows(dv, part.k_rows, gv, factors[2])


def _add_scaled(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, factor) -> None:
    """dst = a + b * factor (None: 1; a float or a 0-d tensor) in one pass, rounded once to
    dst's dtype."""
    if factor is None:
        torch.add(a, b, out=dst)
    elif isinstance(factor, torch.Tensor):
        torch.addcmul(a, b, factor, out=dst)
    else:
        torch.add(a, b, alpha=factor, out=dst)


class _Rescale:
    """bf16 attention on the fp16 kernels, through exact power-of-two factors.

    Why: in the all-gather and ring modes every output row, query gradient and key/value
    gradient is a sum of several kernel calls' results, and a bf16 kernel rounds each
    result to bf16 (8 significant bits) before the float32 sum: m partials carry m
    roundings where the one-device kernel has one (measured 1.24x its error on dK/dV at
    C = 2). No PyTorch kernel returns float32 gradients, but the same kernels run in fp16
    (11 significant bits, the same speed), and a bf16 value converts to fp16 exactly once it
    is in fp16's range. Powers of two are exact factors, so (from max |x|; a and b over the
    whole CP group, g per rank):

    - Q' = Q a, K' = K / a with a balancing their magnitudes (Q'K'^T = QK^T: the softmax,
      its scale and the LSE are unchanged);
    - V' = V b with |V'| < 1, hence |O'| < 1;
    - dO' = dO g, g the largest power of two with every kernel output below 2^15 by the
      bounds |dV'| <= n max|dO'|, |dK'| <= 2 scale d n max|Q'| max|dO'|,
      |dQ'| <= 2 scale d max|K'| max|dO'| and |dS'| <= 2 d max|dO'| (n query rows per call
      times the query heads per key head; d the head dimension);

    and O = O' / b, dQ = dQ' a / (g b), dK = dK' / (g b a), dV = dV' / g, applied as the
    partials are added into float32 (before gradients leave the rank), the sums rounded to
    bf16 once. The exponents are Python numbers when the device is idle and 0-d tensors
    otherwise (``_device_idle``): the same values either way. Values below 2^-24 of the
    fp16 scale are flushed (far below bf16's own rounding of the results). Limitation:
    max|Q| max|K| must stay below about 2^30, or Q' and K' overflow fp16. Other dtypes run
    as they are.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled

    @classmethod
    def for_inputs(cls, query, key, value, group) -> "_Rescale":
        """a and b from max |Q|, |K|, |V| over the group."""
        rescale = cls(query.dtype == torch.bfloat16 and HALF_PARTIALS)
        if not rescale.enabled:
            return rescale
        idle = _device_idle(query)  # asked before this queues its own work
        norms = [_amax(x) for x in (query, key, value)]
        amax = torch.stack(norms)
        _max_over_group(amax, group)
        if idle:
            e_q, e_k, e_v = (math.frexp(x)[1] for x in amax.tolist())  # max|x| < 2^e
            shift = (e_k - e_q) // 2
        else:
            e = torch.frexp(amax)[1]
            e_q, e_k, e_v = e[0], e[1], e[2]
            shift = torch.div(e_k - e_q, 2, rounding_mode="floor")
        # log2 of a, 1/a, b, 1/b, a/b, 1/(ab); then the exponents of max|Q'| and max|K'|
        exps = [shift, -shift, -e_v, e_v, e_v + shift, e_v - shift, e_q + shift, e_k - shift]
        if isinstance(shift, int):
            rescale.exps = [min(100, max(-100, x)) for x in exps]
            rescale.f = [2.0**x for x in rescale.exps[:6]]
        else:
            rescale.exps = torch.stack(exps).clamp(-100, 100)
            rescale.f = torch.exp2(rescale.exps[:6].float())
        return rescale

    def query(self, query: torch.Tensor) -> torch.Tensor:
        return _half(query, self.f[0]) if self.enabled else query

    def key_values(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """K' and V' side by side along the heads, [s, b, 2 n_kv, d]: the buffer the
        gather and the ring send, written in one pass per tensor."""
        if not self.enabled:
            return torch.cat([key, value], dim=2)
        s, b, n, d = key.shape
        kv = torch.empty((s, b, 2 * n, d), dtype=torch.float16, device=key.device)
        torch.mul(key, self.f[1], out=kv[:, :, :n])
        torch.mul(value, self.f[2], out=kv[:, :, n:])
        return kv

    def output(self, acc: torch.Tensor, dtype, valid) -> torch.Tensor:
        out = _scaled(acc, self.f[3], dtype) if self.enabled else acc.to(dtype)
        return out if valid is None else out * valid

    def grad_inputs(self, grad_out, out, rows: int, scale: float, head_dim: int):
        """(dO', O') for the kernels and the factors that undo the scaling of (dQ', dK',
        dV') (three None when disabled). g is this rank's own: gradients are unscaled as
        they are accumulated, before they leave the rank."""
        if not self.enabled:
            return grad_out, out, (None, None, None)
        idle = _device_idle(grad_out)
        amax = _amax(grad_out)
        unit = 2.0 * scale * head_dim  # exponents of the bounds, powers of two rounded up
        c_q, c_k = math.ceil(math.log2(unit * rows)), math.ceil(math.log2(unit))
        floor = math.ceil(math.log2(max(rows, 2 * head_dim)))
        if idle:
            e_do, e_q, e_k = math.frexp(amax.item())[1], self.exps[6], self.exps[7]
            bound = max(e_q + c_q, e_k + c_k, floor)
            if not isinstance(bound, int):
                bound = int(bound)  # exponents from a forward that kept them on the device
            g = 2.0 ** min(100, max(-100, 15 - e_do - bound))
            f = [float(x) for x in self.f]
        else:
            e_do = torch.frexp(amax)[1]
            if isinstance(self.exps, list):  # the forward's exponents are on the host
                bound = max(self.exps[6] + c_q, self.exps[7] + c_k, floor)
            else:
                bound = torch.maximum(self.exps[6] + c_q, self.exps[7] + c_k).clamp(min=floor)
            g = torch.exp2((15 - e_do - bound).clamp(-100, 100).float())
            f = self.f
        inv_g = 1 / g
        factors = (inv_g * f[4], inv_g * f[5], inv_g)
        return _half(grad_out, g), _half(out, f[2]), factors


HALF_PARTIALS = True  # bf16 through the fp16 kernels (``_Rescale``); False: bf16 kernels


def _device_idle(x: torch.Tensor) -> bool:
    """True when reading a value back from x's device costs nothing: a CPU tensor, or a GPU
    whose current stream has finished all its work (the CPU, not the GPU, is the
    bottleneck). Asked before the rescaling queues its own reductions, whose wait is then
    the only cost of reading them back. The factors are then computed on the host (a few
    Python operations) rather than as ~30 tiny device operations; both ways give the same
    powers of two."""
    return x.device.type != "cuda" or torch.cuda.current_stream(x.device).query()


def _amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 0-d tensor (one reduction)."""
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)


def _half(x: torch.Tensor, factor) -> torch.Tensor:
    """x * factor (a power of two: exact) in fp16."""
    return _scaled(x, factor, torch.float16)


def _scaled(x: torch.Tensor, factor, dtype: torch.dtype) -> torch.Tensor:
    """x * factor (a float or a 0-d float32 tensor) written as ``dtype``: one pass, one
    rounding."""
    return torch.mul(x, factor, out=torch.empty(x.shape, dtype=dtype, device=x.device))


def _max_over_group(x: torch.Tensor, group) -> None:
    if group is not None and dist.get_world_size(group=group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)


class _Pending:
    """An asynchronous collective and how to turn its buffers into the result."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish()


def _start_gather(kv: torch.Tensor, heads: Tuple[int, int], group) -> _Pending:
    """Start all-gathering K/V heads h0:h1 of ``kv`` ([s_local, b, 2 n_kv, d], keys then
    values) as one [C * s_local, b, 2 (h1 - h0), d] tensor (rank order: rows
    [j s_local, (j + 1) s_local) are rank j's)."""
    h0, h1 = heads
    n_kv = kv.shape[2] // 2
    if h1 - h0 == n_kv:
        local = kv
    else:
        local = torch.cat([kv[:, :, h0:h1], kv[:, :, n_kv + h0 : n_kv + h1]], dim=2)
    world = dist.get_world_size(group=group)
    if _is_nccl(group):
        out = local.new_empty((world * local.shape[0],) + tuple(local.shape[1:]))
        work = dist.all_gather_into_tensor(out, local, group=group, async_op=True)
        return _Pending(work, lambda: out)
    parts = [torch.empty_like(local) for _ in range(world)]
    work = dist.all_gather(parts, local, group=group, async_op=True)
    return _Pending(work, lambda: torch.cat(parts, dim=0))


def _start_reduce_scatter(full: torch.Tensor, group) -> _Pending:
    """Start summing the float32 K/V gradients (rank order) over ranks, keeping this rank's."""
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    if _is_nccl(group):
        out = full.new_empty((full.shape[0] // world,) + tuple(full.shape[1:]))
        work = dist.reduce_scatter_tensor(out, full, group=group, async_op=True)
        return _Pending(work, lambda: out)
    work = dist.all_reduce(full, group=group, async_op=True)  # gloo has no reduce-scatter
    return _Pending(work, lambda: full.chunk(world, dim=0)[rank])


def _is_nccl(group) -> bool:
    return "nccl" in str(dist.get_backend(group)).lower()


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


def _check_arguments(query, key, value, cp_comm_type, cp_group, packed) -> str:
    """Validate shapes and options before any collective; returns the comm type."""
    comm = "all_gather" if cp_comm_type is None else cp_comm_type
    if not isinstance(comm, str) or comm not in CP_COMM_TYPES:
        raise ValueError(
            f"context_parallel_attention: cp_comm_type must be one of {CP_COMM_TYPES} or None, "
            f"got {cp_comm_type!r}"
        )
    pair = isinstance(cp_group, (list, tuple))
    if comm == "a2a+p2p" and not (
        pair and len(cp_group) == 2 and all(isinstance(g, dist.ProcessGroup) for g in cp_group)
    ):
        raise ValueError(
            "context_parallel_attention: cp_comm_type='a2a+p2p' needs cp_group = [all-to-all "
            "group, ring group] (parallel_state.get_hierarchical_context_parallel_groups() of "
            f"hierarchical_context_parallel_sizes=[A, P]), got {cp_group!r}"
        )
    if comm != "a2a+p2p" and pair:
        raise ValueError(
            f"context_parallel_attention: cp_group is a list of groups, which only "
            f"cp_comm_type='a2a+p2p' takes; got cp_comm_type={comm!r}"
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
