"""Plans: how a sequence (dense or packed) is cut into kernel calls, and their cache.

A ``Part`` is one kernel call: rows of the local queries against rows of some keys, dense
(one bottom-right causal or mask-free block) or packed (one varlen call over all documents).
A ``Plan`` lists the parts of a whole natural-order sequence (C = 1, or a2a after its
exchange); a ``BlockPlan`` the three kinds of call of the all-gather and ring strategies. Plans
of packed sequences read ``cu_seqlens`` on the host, so they are built once per
``PackedSeqParams`` tensors and kept (``cached``).
"""

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, TypeVar, Union

import torch

from megatron.core.context_parallel import (
    cp_shard_positions,
    thd_document_positions,
    thd_partitioned_indices,
)

Rows = Union[slice, torch.Tensor]


@dataclass
class Part:
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
class Plan:
    """How a whole (natural-order) sequence is cut into kernel calls. ``valid``: float mask of
    real rows [s, 1, 1, 1] (None: all real)."""

    parts: List[Part]
    valid: Optional[torch.Tensor] = None

    def whole(self) -> bool:
        """The plan is one kernel call over all rows."""
        rows = self.parts[0].q_rows
        return len(self.parts) == 1 and isinstance(rows, slice) and rows == slice(None)


@dataclass
class BlockPlan:
    """The three kinds of kernel call of the all-gather and ring modes, and the real-row mask.

    Every rank lays its shard out alike (chunks r and 2C-1-r; packed: each document's two
    chunks at the same local rows on every rank), so one plan serves the K/V of any source
    rank: ``local`` (source = this rank: both local chunks, causal), ``lower`` (source rank
    < r: every local query against the source's first chunk(s)) and ``upper`` (source > r:
    the second local chunk(s) against all of the source's rows). Dense parts are slices of
    one block; packed parts are varlen calls over all documents.
    """

    local: Part
    lower: Part
    upper: Part
    valid: Optional[torch.Tensor] = None

    def part(self, source: int, rank: int) -> Part:
        if source == rank:
            return self.local
        return self.lower if source < rank else self.upper


def local_plan(total: int, packed, device) -> Plan:
    """The whole natural-order sequence at once: C = 1, or a2a after the exchange."""
    if packed is None:
        return Plan([Part(slice(None), slice(None))])
    return cached(
        packed, ("local", total, device), lambda: _packed_local_plan(total, packed, device)
    )


def block_plan(s_local: int, cp_size: int, cp_rank: int, packed, device) -> BlockPlan:
    """The ``BlockPlan`` of this rank's load-balanced shard of ``s_local`` rows."""
    if packed is None:
        if s_local % 2 != 0:
            raise ValueError(
                f"context_parallel_attention: the local sequence length ({s_local}) must be "
                "even (two load-balanced chunks per CP rank)"
            )
        half = s_local // 2
        return BlockPlan(
            local=Part(slice(None), slice(None)),
            lower=Part(slice(None), slice(0, half), causal=False),
            upper=Part(slice(half, None), slice(None), causal=False),
        )
    key = ("block", s_local, cp_size, cp_rank, device)
    return cached(
        packed, key, lambda: _packed_block_plan(s_local, cp_size, cp_rank, packed, device)
    )


def exchange_order(s_local: int, a2a_size: int, ring_size: int, ring_rank: int, packed, device):
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
    return cached(
        packed,
        key,
        lambda: _packed_exchange_order(total, a2a_size, ring_size, ring_rank, packed, device),
    )


# ----------------------------------------------------------------------------- the cache


_T = TypeVar("_T")
_PLANS: "OrderedDict[tuple, tuple]" = OrderedDict()  # see cached
_PLANS_KEPT = 16


def cached(packed, key: tuple, build: Callable[[], _T]) -> _T:
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


# ----------------------------------------------------------------------------- documents


@dataclass
class Documents:
    """The documents of a packed (THD) batch, as host lists."""

    padded_offsets: List[int]  # cumulative padded lengths, from 0 to the packed length
    padded_lengths: List[int]
    lengths: List[int]  # real lengths


def documents(packed, total: int, cp_size: int) -> Documents:
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
    return Documents(padded, padded_lengths, lengths)


def valid_mask(docs: Documents, positions: torch.Tensor, device) -> Optional[torch.Tensor]:
    """1 where the natural position ``positions[i]`` is a real token, as [n, 1, 1, 1]."""
    if all(a == b for a, b in zip(docs.lengths, docs.padded_lengths)):
        return None
    doc, offset = thd_document_positions(positions, docs.padded_offsets, docs.padded_offsets[-1])
    valid = offset < torch.tensor(docs.lengths, device=device)[doc]
    return valid.view(-1, 1, 1, 1)


# ----------------------------------------------------------------------------- builders


def _packed_local_plan(total: int, packed, device) -> Plan:
    docs = documents(packed, total, 1)
    cu = torch.tensor(docs.padded_offsets, dtype=torch.int32, device=device)
    part = Part(slice(None), slice(None), cu, cu, max(docs.lengths), max(docs.lengths))
    return Plan([part], valid_mask(docs, torch.arange(total, device=device), device))


def _packed_block_plan(s_local: int, cp_size: int, cp_rank: int, packed, device) -> BlockPlan:
    docs = documents(packed, s_local * cp_size, cp_size)
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
    return BlockPlan(
        local=Part(slice(None), slice(None), cu_whole, cu_whole, longest, longest, True),
        lower=Part(slice(None), first_rows, cu_whole, cu_half, longest, longest_half, False),
        upper=Part(second_rows, slice(None), cu_half, cu_whole, longest_half, longest, False),
        valid=valid_mask(docs, local_positions.to(device), device),
    )


def _packed_exchange_order(total, a2a_size, ring_size, ring_rank, packed, device):
    cp_size = a2a_size * ring_size
    members = range(ring_rank * a2a_size, (ring_rank + 1) * a2a_size)
    offsets = documents(packed, total, cp_size).padded_offsets
    held = torch.cat([thd_partitioned_indices(offsets, total, cp_size, r) for r in members])
    target = thd_partitioned_indices(offsets, total, ring_size, ring_rank)
    return _inverse_lookup(held, target, total, device)


@functools.lru_cache(maxsize=16)
def _dense_exchange_order(total, cp_size, a2a_size, ring_size, ring_rank, device):
    """``exchange_order`` of a dense sequence, built once per shape."""
    members = range(ring_rank * a2a_size, (ring_rank + 1) * a2a_size)
    held = torch.cat([cp_shard_positions(total, cp_size, r) for r in members])
    target = cp_shard_positions(total, ring_size, ring_rank)
    return _inverse_lookup(held, target, total, device)


def _inverse_lookup(
    held: torch.Tensor, target: torch.Tensor, total: int, device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(order, back): held[order] == target and order[back] == arange."""
    row_of = torch.full((total,), -1, dtype=torch.long)
    row_of[held] = torch.arange(held.numel())
    order = row_of[target]
    return order.to(device), torch.argsort(order).to(device)


def _cumulative(lengths: List[int], device) -> torch.Tensor:
    return torch.tensor([0] + lengths, device=device, dtype=torch.int32).cumsum(0).int()
