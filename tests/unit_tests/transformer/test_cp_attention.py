"""Context-parallel core attention against a float64 full-sequence reference.

Every case builds whole-sequence Q, K, V and an output weight W in one process (same seed on
every rank), computes the explicit-matrix oracle and its gradients of <W, attention>, then
runs ``context_parallel_attention`` on this rank's load-balanced shard (dense or packed THD)
and compares the output and the Q, K, V gradients of the shard. Matrix: C in {1, 2, 4, 8}
(C = world size), cp_comm_type in {all_gather, p2p, a2a}, grouped-query attention, packed
documents shorter than a chunk, spanning both local chunks, ending on chunk edges, all
padding, and a padding tail after the last document.

Launch: ``torchrun --nproc-per-node N -m pytest tests/unit_tests/transformer`` (gloo on CPU,
float64 through the CPU flash kernel); ``TEST_BACKEND=nccl`` runs the same cases on one GPU
per rank (float32 through the efficient kernel) plus the bf16 error-ratio check.
"""

import functools
import math
import os
from typing import List

import pytest
import torch
import torch.distributed as dist

import megatron.core.transformer.cp_attention.kernels as fk
import megatron.core.transformer.cp_attention.varlen as fv
from megatron.core.context_parallel import cp_shard_positions, thd_partitioned_indices
from megatron.core.device import comm_device
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.cp_attention import context_parallel_attention, plans, rescale
from tests.unit_tests.transformer.attention_oracle import reference_attention

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
ON_GPU = os.environ.get("TEST_BACKEND", "gloo") == "nccl"
DTYPE = torch.float32 if ON_GPU else torch.float64
TOLERANCE = 2e-5 if ON_GPU else 1e-11


def world() -> tuple:
    """(C, rank, group) of this launch: the whole world is the CP group (None at C = 1)."""
    if WORLD_SIZE == 1 or not dist.is_initialized():
        return 1, 0, None
    return dist.get_world_size(), dist.get_rank(), dist.group.WORLD


def device() -> torch.device:
    return comm_device() if dist.is_initialized() else torch.device("cpu")


# ----------------------------------------------------------------------------- cases


# (id, real document lengths as multiples of the chunk unit or explicit, tail)
def packed_case(name: str, cp: int):
    """Real and padded cumulative lengths of a packed batch for C = cp (2C-multiple padding).

    short: documents shorter than one chunk (some ranks hold only padding of them);
    spanning: a document covering both local chunks of every rank, ending mid-chunk;
    edges: documents ending exactly on chunk edges; empty: a document of padding only;
    tail: tokens after the last document.
    """
    unit = 2 * cp
    docs = {
        "short": [1, 3, 2],
        "spanning": [5 * unit - 3, 2],
        "edges": [2 * unit, unit, 3 * unit],
        "empty": [unit + 1, 0, 3],
        "tail": [unit - 1, 2],
    }[name]
    real, padded = [0], [0]
    for length in docs:
        padded_length = max(unit, math.ceil(length / unit) * unit)
        real.append(real[-1] + length)
        padded.append(padded[-1] + padded_length)
    total = padded[-1] + (2 * unit if name == "tail" else 0)
    return real, padded, total


def make_inputs(total: int, batch: int, heads: int, groups: int, dim: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(total, batch, heads, dim), (total, batch, groups, dim), (total, batch, groups, dim)]
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)
    w = torch.randn(total, batch, heads, dim, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), w.to(dtype)


def reference(q, k, v, w, real=None, padded=None):
    """Float64 oracle output and gradients of <w, attention(q, k, v)>."""
    q, k, v = (x.detach().double().cpu().requires_grad_(True) for x in (q, k, v))
    out = reference_attention(q, k, v, real, padded)
    grads = torch.autograd.grad((out * w.double().cpu()).sum(), (q, k, v))
    return [out.detach()] + list(grads)


def run_shard(q, k, v, w, positions, comm, packed=None, a2a_size=2, **kwargs):
    """This rank's output and gradients of <w_shard, cp attention(shard)>; a2a+p2p runs
    with hierarchical sizes [a2a_size, C / a2a_size]."""
    dev = device()
    local = [x[positions].to(dev).detach().clone().requires_grad_(True) for x in (q, k, v)]
    _, _, group = world()
    if comm == "a2a+p2p":
        group = hierarchical_groups(a2a_size)
    out = context_parallel_attention(
        *local, cp_group=group, cp_comm_type=comm, packed_seq_params=packed, **kwargs
    )
    grads = torch.autograd.grad((out * w[positions].to(dev)).sum(), local)
    return [out.detach()] + [g for g in grads]


@functools.lru_cache(maxsize=None)
def hierarchical_groups(a2a_size: int) -> list:
    """[all-to-all group, ring group] of this rank for hierarchical sizes [A, C / A] over the
    world, built here by hand: all-to-all groups are runs of A consecutive ranks, rings
    take every A-th rank (CP rank = ring rank * A + all-to-all rank). Every rank creates
    every group in the same order (the cache makes it once per process)."""
    cp, rank, _ = world()
    runs = [list(range(j * a2a_size, (j + 1) * a2a_size)) for j in range(cp // a2a_size)]
    rings = [list(range(i, cp, a2a_size)) for i in range(a2a_size)]
    mine = []
    for ranks_of_level in (runs, rings):
        for ranks in ranks_of_level:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine.append(group)
    return mine


def max_relative_errors(actual: List[torch.Tensor], expected: List[torch.Tensor], positions):
    """||actual - expected[positions]|| / ||expected|| per tensor (the whole sequence's norm:
    a shard's own values can be ~0, e.g. dQ of one-token documents)."""
    names = ("out", "dq", "dk", "dv")
    errors = {}
    for name, a, e in zip(names, actual, expected):
        scale = e.double().norm().item()
        errors[name] = (a.double().cpu() - e[positions].double()).norm().item() / scale
        assert torch.isfinite(a).all(), f"{name} has NaN/inf"
    return errors


def packed_params(real, padded, dev) -> PackedSeqParams:
    real_t = torch.tensor(real, dtype=torch.int32, device=dev)
    padded_t = torch.tensor(padded, dtype=torch.int32, device=dev)
    longest = max(b - a for a, b in zip(padded[:-1], padded[1:]))
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=real_t,
        cu_seqlens_kv=real_t,
        cu_seqlens_q_padded=padded_t,
        cu_seqlens_kv_padded=padded_t,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


COMMS = [
    "all_gather",
    "p2p",
    "a2a",
    pytest.param("a2a+p2p", marks=pytest.mark.world(2, 4, 8)),  # sizes [2, C / 2]
]


def heads_for(comm: str, heads: int, groups: int, cp: int, a2a_size: int = 2) -> tuple:
    """a2a splits heads over C, a2a+p2p over its all-to-all group: scale (heads, kv heads)
    up, keeping their ratio, until that size divides the kv heads (8/4 -> 16/8 at C = 8)."""
    split = {"a2a": cp, "a2a+p2p": a2a_size}.get(comm, 1)
    if groups % split == 0:
        return heads, groups
    factor = split // math.gcd(groups, split)
    return heads * factor, groups * factor


HEADS = [pytest.param(4, 4, id="mha"), pytest.param(8, 4, id="gqa2")]


# ----------------------------------------------------------------------------- dense


@pytest.mark.world(1, 2, 4, 8)
@pytest.mark.parametrize("heads, groups", HEADS)
@pytest.mark.parametrize("comm", COMMS)
def test_dense_matches_full_sequence(comm, heads, groups):
    """Output and Q/K/V gradients equal the float64 full-sequence oracle on this shard."""
    cp, rank, _ = world()
    heads, groups = heads_for(comm, heads, groups, cp)
    total = 8 * cp
    q, k, v, w = make_inputs(total, 2, heads, groups, 8, DTYPE)
    expected = reference(q, k, v, w)
    positions = cp_shard_positions(total, cp, rank)
    errors = max_relative_errors(run_shard(q, k, v, w, positions, comm), expected, positions)
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.world(2)
@pytest.mark.parametrize("num_head_groups", [1, 3])
def test_all_gather_head_groups(num_head_groups):
    """Gathering K/V in 1 or 3 head groups (uneven) gives the same exact result."""
    cp, rank, _ = world()
    total = 8 * cp
    q, k, v, w = make_inputs(total, 1, 6, 3, 8, DTYPE, seed=3)
    expected = reference(q, k, v, w)
    positions = cp_shard_positions(total, cp, rank)
    actual = run_shard(q, k, v, w, positions, "all_gather", num_head_groups=num_head_groups)
    errors = max_relative_errors(actual, expected, positions)
    assert max(errors.values()) <= TOLERANCE, errors


# ----------------------------------------------------------------------------- packed


PACKED = ["short", "spanning", "edges", "empty", "tail"]


@pytest.mark.world(1, 2, 4, 8)
@pytest.mark.parametrize("case", PACKED)
@pytest.mark.parametrize("comm", COMMS)
def test_packed_matches_per_document_attention(comm, case):
    """THD: documents never see each other, padding rows are 0 (never NaN) and pass no
    gradient, real rows equal the oracle's."""
    cp, rank, _ = world()
    heads, groups = heads_for(comm, 8, 4, cp)
    real, padded, total = packed_case(case, cp)
    q, k, v, w = make_inputs(total, 1, heads, groups, 8, DTYPE, seed=1)
    expected = reference(q, k, v, w, real, padded)
    positions = thd_partitioned_indices(padded, total, cp, rank)
    packed = packed_params(real, padded, device())
    actual = run_shard(q, k, v, w, positions, comm, packed)
    errors = max_relative_errors(actual, expected, positions)
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.world(2)
@pytest.mark.parametrize("comm", COMMS)
def test_packed_rejects_bad_padding(comm):
    """Documents not padded to a multiple of 2C: a clear error before any collective."""
    _, _, group = world()
    group = hierarchical_groups(2) if comm == "a2a+p2p" else group
    q = torch.zeros(8, 1, 2, 4, device=device())
    real = torch.tensor([0, 3, 16], dtype=torch.int32)
    bad = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_q_padded=real)
    with pytest.raises(ValueError, match=r"document 0 .* padded length 3.*multiple of 2"):
        context_parallel_attention(
            q, q, q, cp_group=group, cp_comm_type=comm, packed_seq_params=bad
        )


@pytest.mark.world(1, 2, 4, 8)
@pytest.mark.parametrize("comm", COMMS)
def test_packed_plan_read_once_per_cu_seqlens(comm, monkeypatch):
    """Every layer attends with the same PackedSeqParams: its cu_seqlens are read on the host
    (on a GPU, a synchronization) for the first call only. Changing them in place is seen:
    the next call reads them again and matches the oracle of the new documents."""
    cp, rank, _ = world()
    heads, groups = heads_for(comm, 8, 4, cp)
    real, padded, total = packed_case("spanning", cp)
    q, k, v, w = make_inputs(total, 1, heads, groups, 8, DTYPE, seed=2)
    positions = thd_partitioned_indices(padded, total, cp, rank)
    packed = packed_params(real, padded, device())
    reads = []
    read = plans.documents
    monkeypatch.setattr(plans, "documents", lambda *a: reads.append(a) or read(*a))

    for call in range(3):
        actual = run_shard(q, k, v, w, positions, comm, packed)
        errors = max_relative_errors(actual, reference(q, k, v, w, real, padded), positions)
        assert max(errors.values()) <= TOLERANCE, (call, errors)
        if call == 0:
            first_reads = len(reads)
    assert first_reads > 0 and len(reads) == first_reads

    with torch.no_grad():
        packed.cu_seqlens_q[1:] -= 1  # the first document one token shorter
    real = [real[0]] + [x - 1 for x in real[1:]]
    actual = run_shard(q, k, v, w, positions, comm, packed)
    errors = max_relative_errors(actual, reference(q, k, v, w, real, padded), positions)
    assert max(errors.values()) <= TOLERANCE, errors
    assert len(reads) > first_reads


# ----------------------------------------------------------------------------- a2a+p2p


@pytest.mark.world(4, 8)
@pytest.mark.parametrize("case", ["dense", "spanning", "edges", "tail"])
@pytest.mark.parametrize("a2a_size", [1, 2, 4, pytest.param(8, marks=pytest.mark.world(8))])
def test_hierarchical_splits_match_full_sequence(a2a_size, case):
    """a2a+p2p with every split [A, C / A] of the CP group (A = 1: the ring alone; A = C:
    the all-to-all alone), dense and packed, equals the float64 oracle on this shard."""
    cp, rank, _ = world()
    heads, groups = heads_for("a2a+p2p", 8, 4, cp, a2a_size)
    if case == "dense":
        real = padded = None
        total = 8 * cp
        positions = cp_shard_positions(total, cp, rank)
    else:
        real, padded, total = packed_case(case, cp)
        positions = thd_partitioned_indices(padded, total, cp, rank)
    q, k, v, w = make_inputs(total, 1, heads, groups, 8, DTYPE, seed=4)
    expected = reference(q, k, v, w, real, padded)
    packed = None if real is None else packed_params(real, padded, device())
    actual = run_shard(q, k, v, w, positions, "a2a+p2p", packed, a2a_size=a2a_size)
    errors = max_relative_errors(actual, expected, positions)
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.world(4)
def test_hierarchical_needs_consecutive_all_to_all_groups():
    """Negative control: the same two levels handed over in the wrong roles (rings as the
    all-to-all groups) put rows at other positions than the exchange assumes, and the
    oracle sees it on some rank."""
    cp, rank, _ = world()
    total = 8 * cp
    q, k, v, w = make_inputs(total, 1, 8, 4, 8, DTYPE, seed=4)
    expected = reference(q, k, v, w)
    positions = cp_shard_positions(total, cp, rank)
    a2a, ring = hierarchical_groups(2)
    local = [x[positions].to(device()) for x in (q, k, v)]
    good = context_parallel_attention(*local, cp_group=[a2a, ring], cp_comm_type="a2a+p2p")
    swapped = context_parallel_attention(*local, cp_group=[ring, a2a], cp_comm_type="a2a+p2p")
    errors = [max_relative_errors([out], expected[:1], positions)["out"] for out in (good, swapped)]
    worst = torch.tensor(errors, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # rank 0's rows come out right either way
    assert worst[0] <= TOLERANCE and worst[1] > 1e-3, worst


@pytest.mark.world(2)
def test_hierarchical_groups_are_checked():
    """a2a+p2p without a pair of groups, or a pair with another mode: named errors."""
    _, _, group = world()
    q = torch.zeros(8, 1, 2, 4, device=device())
    with pytest.raises(ValueError, match=r"a2a\+p2p' needs cp_group = \[all-to-all group"):
        context_parallel_attention(q, q, q, cp_group=group, cp_comm_type="a2a+p2p")
    with pytest.raises(
        ValueError, match="only cp_comm_type='a2a\\+p2p' takes; got cp_comm_type='p2p'"
    ):
        context_parallel_attention(q, q, q, cp_group=[group, group], cp_comm_type="p2p")


# ----------------------------------------------------------------------------- one process


@pytest.mark.world(1)
def test_bad_arguments_are_named():
    """Unknown comm types, mismatched shapes and batched THD inputs raise naming the value."""
    q = torch.zeros(8, 2, 4, 8)
    kv = torch.zeros(8, 2, 3, 8)
    with pytest.raises(ValueError, match=r"cp_comm_type must be one of .*got 'ring'"):
        context_parallel_attention(q, q, q, cp_comm_type="ring")
    with pytest.raises(ValueError, match=r"key/value \(8, 2, 3, 8\) do not fit"):
        context_parallel_attention(q, kv, kv)
    packed = packed_params([0, 8], [0, 8], "cpu")
    with pytest.raises(ValueError, match="batch size 1, got 2"):
        context_parallel_attention(q, q, q, packed_seq_params=packed)


@pytest.mark.world(1)
@pytest.mark.parametrize("kernel", [None, "math"], ids=["cpu", "math"])
@pytest.mark.parametrize("s_q, s_k", [(4, 4), (4, 12), (1, 9)])
def test_kernel_causal_is_bottom_right(s_q, s_k, kernel):
    """A causal block with s_q < s_k means the queries are the last s_q positions; the CPU
    kernel's own is_causal is top-left for s_q != s_k, so the rectangle is split and merged
    (one query, a decoding step's, sees every key: one call without a mask); the explicit
    "math" kernel (the CUDA fallback for float64 and odd head dimensions) masks bottom-right
    itself. Negative control: the plain top-left call differs."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, s_q, 3, 8, generator=gen, dtype=torch.float64)
    k, v, dout = (
        torch.randn(2, n, 3, 8, generator=gen, dtype=torch.float64) for n in (s_k, s_k, s_q)
    )
    out, lse = fk.attention_forward(q, k, v, True, fk.Kernel(kernel, 0.3))
    allowed = torch.ones(s_q, s_k, dtype=torch.bool).tril(s_k - s_q)
    qr, kr, vr = (x.transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    scores = (qr @ kr.transpose(-1, -2) * 0.3).masked_fill(~allowed, -math.inf)
    expected = (torch.softmax(scores, -1) @ vr).transpose(1, 2)
    assert torch.allclose(out, expected, atol=1e-12)
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-12)
    grads = fk.attention_backward(dout, q, k, v, out, lse, True, fk.Kernel(kernel, 0.3))
    ref_grads = torch.autograd.grad((expected * dout).sum(), (qr, kr, vr))
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r.transpose(1, 2), atol=1e-12)
    if s_q != s_k:
        top_left, _ = fk.kernel_spec("cpu").forward(
            *(x.transpose(1, 2) for x in (q, k, v)), True, 0.3
        )
        assert not torch.allclose(top_left.transpose(1, 2), expected, atol=1e-3)


@pytest.mark.world(1)
@pytest.mark.parametrize("kernel", [None, "math"], ids=["cpu", "math"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bf16"])
def test_one_query_with_grouped_heads_attends_without_expanded_keys(kernel, dtype, monkeypatch):
    """A decoding step (one query, causal, bottom-right: it sees every key) with grouped-query
    heads (6 query heads over 2 key/value heads) runs each group's query heads as queries of
    their key head: the same output, LSE and gradients (dk, dv float32 sums, as with expanded
    keys) as the float64 oracle of expanded keys, without ``expand_kv``'s copy of the keys."""
    gen = torch.Generator().manual_seed(6)
    q, dout = (torch.randn(2, 1, 6, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 9, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    qr, kr, vr = (x.transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    scores = qr @ kr.repeat_interleave(3, 1).transpose(-1, -2) * 0.3
    expected = (torch.softmax(scores, -1) @ vr.repeat_interleave(3, 1)).transpose(1, 2)
    ref_grads = torch.autograd.grad((expected * dout).sum(), (qr, kr, vr))
    monkeypatch.setattr(fk, "expand_kv", lambda *a: pytest.fail("keys expanded"))
    q, k, v, dout = (x.to(dtype) for x in (q, k, v, dout))
    out, lse = fk.attention_forward(q, k, v, True, fk.Kernel(kernel, 0.3))
    grads = fk.attention_backward(dout, q, k, v, out, lse, True, fk.Kernel(kernel, 0.3))
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    assert out.dtype == dtype and torch.allclose(out.double(), expected, atol=tol)
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1), atol=tol)
    assert grads[0].dtype == dtype and grads[1].dtype == grads[2].dtype == fk.acc_dtype(dtype)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g.double(), r.transpose(1, 2), atol=tol)


@pytest.mark.world(1)
def test_merge_ignores_rows_without_keys():
    """A block whose rows have no keys reports LSE = +inf on flash kernels; merging it must
    leave the running result unchanged (and rows with no keys anywhere stay 0, not NaN).
    Negative control: a naive log-sum-exp merge of the +inf destroys the result."""
    acc = torch.tensor([[[[1.0, 2.0]], [[0.0, 0.0]]]])  # [b=1, s=2, n=1, d=2]
    acc_lse = torch.tensor([[[0.5, -math.inf]]])  # row 1: no keys yet
    block = torch.full_like(acc, 7.0)
    block_lse = torch.tensor([[[math.inf, math.inf]]])
    merged, merged_lse = acc.clone(), acc_lse.clone()
    fk.merge_into(merged, merged_lse, block, block_lse)
    assert torch.equal(merged, acc) and torch.equal(merged_lse, acc_lse)
    naive = torch.logaddexp(acc_lse, block_lse)
    assert not torch.isfinite(naive[0, 0, 0])


@pytest.mark.world(1)
def test_saved_memory_is_linear_in_sequence_length():
    """The tensors autograd keeps for backward grow linearly with s (no [s, s] or [s/C, s]
    term): doubling s doubles the saved bytes. Negative control: the oracle's grow 4x."""

    def saved_bytes(fn, s):
        q, k, v, _ = make_inputs(s, 1, 2, 2, 8, torch.float32)
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(q, k, v)
        return sum(sizes)

    ours = [saved_bytes(context_parallel_attention, s) for s in (256, 512, 1024)]
    oracle = [saved_bytes(reference_attention, s) for s in (256, 512, 1024)]
    assert ours[1] / ours[0] == pytest.approx(2.0, rel=0.05)
    assert ours[2] / ours[1] == pytest.approx(2.0, rel=0.05)
    assert oracle[2] / oracle[1] > 3.5


# ----------------------------------------------------------------------------- bf16


# SPEC 14: in bf16 the CP error is at most 1.05x the one-device kernel's own bf16 error. The
# one device here is the same entry point at C = 1: one kernel call over the whole sequence.
BF16_LIMIT = 1.05


def bf16_inputs(kind: str, total: int, heads: int, groups: int):
    """bf16 Q, K, V, W of three kinds.

    random: unit normals. scaled: Q x 2^10, K x 2^-14, V x 2^16, W x 2^-20 (valid bf16;
    converted to fp16 as they are, V and W would overflow or flush). sink: every query
    aligned with key 0, which takes most of the attention, and W constant, so key 0's
    value gradient adds up nearly all rows of dO.
    """
    q, k, v, w = make_inputs(total, 1, heads, groups, 64, torch.float64, seed=11)
    if kind == "scaled":
        q, k, v, w = q * 2.0**10, k * 2.0**-14, v * 2.0**16, w * 2.0**-20
    elif kind == "sink":
        direction = torch.randn(64, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
        q = q * 0.1 + direction
        k[0] = direction
        w = torch.full_like(w, 3.0)
    return [x.to(torch.bfloat16) for x in (q, k, v, w)]


def bf16_ratios(comm: str, kind: str, total: int = 512, heads: int = 4, groups: int = 2):
    """CP error / one-device error (output, dQ, dK, dV against the float64 oracle) on this
    rank's rows."""
    cp, rank, _ = world()
    heads, groups = heads_for(comm, heads, groups, cp)
    q, k, v, w = bf16_inputs(kind, total, heads, groups)
    expected = reference(q, k, v, w)
    full = [x.to(device()).detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = context_parallel_attention(*full)
    one_device = [out.detach()] + list(torch.autograd.grad((out * w.to(device())).sum(), full))
    positions = cp_shard_positions(total, cp, rank)
    cp_errors = max_relative_errors(run_shard(q, k, v, w, positions, comm), expected, positions)
    kernel_errors = max_relative_errors(
        [x[positions.to(x.device)] for x in one_device], expected, positions
    )
    ratios = {name: cp_errors[name] / kernel_errors[name] for name in cp_errors}
    print(f"bf16 {kind} C={cp} {comm} rank {rank}: kernel {kernel_errors} ratio {ratios}")
    return kernel_errors, ratios


@pytest.mark.world(2, 4, 8)
@pytest.mark.parametrize("comm", COMMS)
def test_bf16_error_within_kernel_error(comm):
    """bf16 (the CPU flash op on CPUs, flash-class kernels on GPUs): the CP error of the
    output and of the Q/K/V gradients is at most 1.05x the one-device kernel's."""
    kernel_errors, ratios = bf16_ratios(comm, "random")
    assert max(kernel_errors.values()) <= 1e-2, kernel_errors
    assert max(ratios.values()) <= BF16_LIMIT, ratios


@pytest.mark.world(2)
@pytest.mark.parametrize("kind", ["scaled", "sink"])
@pytest.mark.parametrize("comm", COMMS)
def test_bf16_extreme_values_within_kernel_error(comm, kind):
    """The same 1.05x for values far outside fp16's range and for a key that takes all the
    attention (its value gradient sums every row of dO)."""
    _, ratios = bf16_ratios(comm, kind)
    assert max(ratios.values()) <= BF16_LIMIT, ratios


@pytest.mark.world(2)
@pytest.mark.parametrize("comm", ["all_gather", "p2p"])
@pytest.mark.parametrize("forward, backward", [(False, False), (True, False), (False, True)])
def test_bf16_factors_on_host_or_device_agree_bitwise(comm, forward, backward, monkeypatch):
    """The rescaling factors computed on the host (an idle device) and as device
    operations (a busy one), in either pass, give bitwise the same output and gradients."""
    cp, rank, _ = world()
    total = 256
    q, k, v, w = make_inputs(total, 1, 4, 2, 32, torch.float64, seed=6)
    q, k, v, w = (x.to(torch.bfloat16) for x in (q * 3, k, v * 2.0**-10, w * 2.0**-30))
    positions = cp_shard_positions(total, cp, rank)
    host = run_shard(q, k, v, w, positions, comm)
    passes = iter([forward, backward])
    monkeypatch.setattr(rescale, "device_idle", lambda x: next(passes))
    mixed = run_shard(q, k, v, w, positions, comm)
    assert all(torch.equal(a, b) for a, b in zip(host, mixed))


@pytest.mark.world(2)
@pytest.mark.parametrize("comm", ["all_gather", "p2p"])
def test_bf16_kernels_alone_miss_the_target(comm, monkeypatch):
    """Negative control: with the bf16 kernels' own outputs summed (``HALF_PARTIALS`` off),
    the values summed over several kernel calls exceed the 1.05x limit on every rank."""
    monkeypatch.setattr(rescale, "HALF_PARTIALS", False)
    _, ratios = bf16_ratios(comm, "random", total=1024, heads=8, groups=8)
    assert max(ratios.values()) > 1.1, ratios


@pytest.mark.world(2, 4, 8)
@pytest.mark.parametrize("comm", COMMS)
def test_bf16_packed_within_kernel_error(comm):
    """bf16 packed documents (on GPUs the flash varlen op where torch has it, on CPUs the
    loop over documents): one device is within bf16 error of the float64 oracle, and CP
    stays within 1.05x of it."""
    cp, rank, _ = world()
    unit = 2 * cp
    lengths = [300, 5, 0, 190, 16 * unit]
    real, padded = [0], [0]
    for length in lengths:
        real.append(real[-1] + length)
        padded.append(padded[-1] + max(unit, math.ceil(length / unit) * unit))
    total = padded[-1] + 4 * unit
    heads, groups = heads_for(comm, 8, 4, cp)
    q, k, v, w = make_inputs(total, 1, heads, groups, 64, torch.bfloat16, seed=13)
    expected = reference(q, k, v, w, real, padded)
    packed = packed_params(real, padded, device())
    every = torch.arange(total)
    full = [x.to(device()).detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = context_parallel_attention(*full, packed_seq_params=packed)
    one_device = [out.detach()] + list(torch.autograd.grad((out * w.to(device())).sum(), full))
    device_errors = max_relative_errors(one_device, expected, every)
    positions = thd_partitioned_indices(padded, total, cp, rank)
    cp_errors = max_relative_errors(
        run_shard(q, k, v, w, positions, comm, packed), expected, positions
    )
    kernel_errors = max_relative_errors(
        [x[positions.to(x.device)] for x in one_device], expected, positions
    )
    ratios = {name: cp_errors[name] / kernel_errors[name] for name in cp_errors}
    print(f"bf16 packed C={cp} {comm} rank {rank}: one device {device_errors} ratio {ratios}")
    assert max(device_errors.values()) <= 1e-2, device_errors
    assert max(ratios.values()) <= BF16_LIMIT, ratios


@pytest.mark.world(1)
def test_varlen_falls_back_to_the_loop_when_the_op_fails(monkeypatch):
    """A varlen op that raises (an unsupported build or shape) is dropped with a warning and
    the loop over documents gives the result; out-of-memory is not swallowed."""

    def broken(*args):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(fv, "_VARLEN_FAILED", [])
    monkeypatch.setattr(fv, "_flash_varlen_forward", broken)
    monkeypatch.setattr(fv, "_use_varlen", lambda query, cu: not fv._VARLEN_FAILED)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(12, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.warns(UserWarning, match="flash varlen attention failed"):
        out, lse = fv.varlen_forward(q, k, v, fv.SeqLens(cu, cu, 7, 7), True, fk.Kernel(None, 0.5))
    assert fv._VARLEN_FAILED and not fv._use_varlen(q, cu)
    monkeypatch.setattr(fv, "_VARLEN_FAILED", ["off"])
    expected, _ = fv.varlen_forward(q, k, v, fv.SeqLens(cu, cu, 7, 7), True, fk.Kernel(None, 0.5))
    assert torch.equal(out, expected)

    def oom(*args):
        raise torch.cuda.OutOfMemoryError("out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        fv._guarded_varlen(oom)


needs_cuda_varlen = pytest.mark.skipif(
    not (torch.cuda.is_available() and fv.varlen_available()),
    reason="needs a CUDA device with the flash varlen op (H200 run: docs/performance.md)",
)


@needs_cuda_varlen
@pytest.mark.world(1)
def test_varlen_rows_past_the_last_sequence_are_empty():
    """The flash varlen op leaves rows past cu_q[-1] unwritten: they come back as out = 0 and
    lse = -inf, found on the device (no host read of cu_q), the rest as the per-sequence
    loop gives them."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (
        torch.randn(40, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)
    )
    cu = torch.tensor([0, 9, 30], dtype=torch.int32, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = fv.varlen_forward(
            q, k, v, fv.SeqLens(cu, cu, 21, 21), True, fk.Kernel(None, 0.125)
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not fv._VARLEN_FAILED
    assert torch.equal(out[30:], torch.zeros_like(out[30:]))
    assert torch.equal(lse[:, 30:], torch.full_like(lse[:, 30:], -math.inf))
    loop_out, loop_lse = fv.varlen_forward(
        q.double(), k.double(), v.double(), fv.SeqLens(cu, cu, 21, 21), True, fk.Kernel(None, 0.125)
    )
    torch.testing.assert_close(out[:30].double(), loop_out[:30], rtol=0, atol=2e-2)
    torch.testing.assert_close(lse[:, :30].double(), loop_lse[:, :30], rtol=0, atol=1e-2)


@needs_cuda_varlen
@pytest.mark.world(1)
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "negative-control-uncached"])
def test_packed_layers_after_the_first_never_synchronize(cached, monkeypatch):
    """On a GPU, the layers after the first read nothing on the host: a second attention call
    with the same PackedSeqParams passes sync debug mode "error", forward and backward.
    Without the plan cache (negative control) it synchronizes."""
    if not cached:
        monkeypatch.setattr(plans, "cached", lambda packed, key, build: build())
    real, padded, total = packed_case("spanning", 2)
    q = torch.randn(total, 1, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    packed = packed_params(real, padded, torch.device("cuda"))
    first = context_parallel_attention(q, q, q, packed_seq_params=packed)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        if cached:
            second = context_parallel_attention(first, first, first, packed_seq_params=packed)
            second.float().sum().backward()
        else:
            with pytest.raises(RuntimeError, match="synchroniz"):
                context_parallel_attention(first, first, first, packed_seq_params=packed)
    finally:
        torch.cuda.set_sync_debug_mode("default")
