"""Attention sinks (``softmax_offset``, GPT-OSS) in every attention path against a float64
explicit oracle: the sink is one more score column per head, dropped after the softmax.

Output, Q/K/V gradients and the sinks' gradient (summed over the CP ranks, as the
data-parallel reduction does) equal the oracle's for dense and packed sequences and a sliding
window, at C = 1 and in the launches (C = 2, 4) for every cp_comm_type; the negative control
(the sink left out) must differ.
"""

import math

import pytest
import torch
import torch.distributed as dist

from megatron.core.context_parallel import cp_shard_positions, thd_partitioned_indices
from megatron.core.transformer.cp_attention import context_parallel_attention
from tests.unit_tests.transformer.test_cp_attention import (
    COMMS,
    DTYPE,
    TOLERANCE,
    device,
    heads_for,
    hierarchical_groups,
    make_inputs,
    packed_case,
    packed_params,
    world,
)


def oracle(q, k, v, sink, real=None, padded=None, window=None):
    """[s, b, n, d] float64 sink attention of the whole sequence: scores [b, n, s, s] with
    the sink as an extra column; padding rows (past a document's real length) are 0."""
    s, rep = q.shape[0], q.shape[2] // k.shape[2]
    qh, kh, vh = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    pos = torch.arange(s)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] <= window
    valid = torch.ones(s, dtype=torch.bool)
    if real is not None:
        doc, valid = torch.full((s,), -1), torch.zeros(s, dtype=torch.bool)
        for i in range(len(padded) - 1):
            doc[padded[i] : padded[i + 1]] = i
            valid[padded[i] : padded[i] + real[i + 1] - real[i]] = True
        allowed &= doc[None, :] == doc[:, None]
    scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, -math.inf)
    column = sink.view(1, -1, 1, 1).expand(scores.shape[0], -1, s, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    out = (probs @ vh).permute(2, 0, 1, 3)
    return out * valid.view(s, 1, 1, 1)


def expected_and_actual(comm, q, k, v, w, sink, positions, packed=None, **oracle_kw):
    """(oracle's [out, dq, dk, dv, dsink], this shard's) for <w, attention>."""
    ref = [x.detach().double().requires_grad_(True) for x in (q, k, v, sink)]
    out = oracle(*ref, **oracle_kw)
    expected = [out.detach()] + list(torch.autograd.grad((out * w).sum(), ref))
    dev = device()
    local = [x[positions].to(dev).clone().requires_grad_(True) for x in (q, k, v)]
    mine = sink.to(dev).clone().requires_grad_(True)
    cp, _, group = world()
    if comm == "a2a+p2p":
        group = hierarchical_groups(2)
    window = oracle_kw.get("window")
    got = context_parallel_attention(
        *local,
        cp_group=group,
        cp_comm_type=comm,
        packed_seq_params=packed,
        softmax_offset=mine,
        window_size=None if window is None else (window, 0),
    )
    grads = list(torch.autograd.grad((got * w[positions].to(dev)).sum(), local + [mine]))
    if cp > 1:
        dist.all_reduce(grads[-1])
    return expected, [got.detach()] + grads


def errors_of(expected, actual, positions):
    names = ("out", "dq", "dk", "dv", "dsink")
    out = {}
    for name, e, a in zip(names, expected, actual):
        e = e if name == "dsink" else e[positions]
        out[name] = (a.double().cpu() - e).norm().item() / max(e.norm().item(), 1e-30)
    return out


def sinks(heads: int) -> torch.Tensor:
    return torch.linspace(-1.5, 2.5, heads, dtype=torch.float64).to(DTYPE)


@pytest.mark.world(1, 2, 4)
@pytest.mark.parametrize("comm", COMMS)
def test_dense_sinks_match_oracle(comm):
    cp, rank, _ = world()
    heads, groups = heads_for(comm, 4, 2, cp)
    total = 8 * cp
    q, k, v, w = make_inputs(total, 2, heads, groups, 8, DTYPE, seed=5)
    positions = cp_shard_positions(total, cp, rank)
    expected, actual = expected_and_actual(comm, q, k, v, w, sinks(heads), positions)
    errors = errors_of(expected, actual, positions)
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.world(1, 2, 4)
@pytest.mark.parametrize("comm", COMMS)
def test_packed_sinks_match_oracle(comm):
    cp, rank, _ = world()
    heads, groups = heads_for(comm, 4, 2, cp)
    real, padded, total = packed_case("spanning", cp)
    q, k, v, w = make_inputs(total, 1, heads, groups, 8, DTYPE, seed=6)
    positions = thd_partitioned_indices(padded, total, cp, rank)
    packed = packed_params(real, padded, device())
    expected, actual = expected_and_actual(
        comm, q, k, v, w, sinks(heads), positions, packed, real=real, padded=padded
    )
    errors = errors_of(expected, actual, positions)
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.world(1)
def test_windowed_sinks_and_the_negative_control():
    """A sliding window with sinks matches; the same oracle without sinks does not match
    the sink attention (the control: the check can fail)."""
    q, k, v, w = make_inputs(12, 1, 4, 2, 8, DTYPE, seed=7)
    positions = torch.arange(12)
    sink = sinks(4)
    expected, actual = expected_and_actual("all_gather", q, k, v, w, sink, positions, window=3)
    assert max(errors_of(expected, actual, positions).values()) <= TOLERANCE
    without, _ = expected_and_actual(
        "all_gather", q, k, v, w, torch.full_like(sink, -math.inf), positions, window=3
    )
    assert (without[0] - actual[0].double()).norm() > 1e-3


@pytest.mark.world(1)
def test_bad_softmax_offset_is_named():
    q, k, v, _ = make_inputs(4, 1, 4, 2, 8, DTYPE)
    with pytest.raises(ValueError, match=r"softmax_offset must be \[4\]"):
        context_parallel_attention(q, k, v, softmax_offset=torch.zeros(3, dtype=DTYPE))


@pytest.mark.world(1)
@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_dot_product_attention_softmax_types(softmax_type):
    """``softmax_type``: off-by-one is a fixed sink 0; learnable a parameter [heads] (zero at
    first) whose gradient is the oracle's."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        softmax_type=softmax_type, params_dtype=DTYPE, attention_dropout=0.0,
    )  # fmt: skip
    attention = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v, w = make_inputs(10, 2, 4, 2, 8, DTYPE, seed=9)
    sink = attention.softmax_offset
    learnable = isinstance(sink, torch.nn.Parameter)
    assert learnable == (softmax_type == "learnable") and torch.equal(sink, torch.zeros(4))
    if learnable:
        with torch.no_grad():
            sink.copy_(sinks(4))
    local = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = attention(*local, None).view(10, 2, 4, 8)
    ref = [x.clone().requires_grad_(True) for x in (q, k, v, sink.detach())]
    expected = oracle(*ref)
    assert (out - expected).norm() / expected.norm() <= TOLERANCE
    if learnable:
        (out * w).sum().backward()
        (want,) = torch.autograd.grad((expected * w).sum(), ref[3])
        assert (sink.grad - want).norm() / want.norm() <= TOLERANCE
