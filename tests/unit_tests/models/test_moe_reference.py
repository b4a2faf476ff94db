"""The float64 MoE reference checked on its own (one process, no model code): routing and the
router losses on hand-computed tiny cases, the per-token loop against a vectorized
formulation written separately here, and the MoE reference collapsing to the dense one when
every expert is the dense MLP and the gates sum to one."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.unit_tests.models.dense_gpt import Arch, dense_gpt_losses
from tests.unit_tests.models.moe_reference import (
    AVERAGED,
    PER_TOKEN,
    LayerStats,
    MoEArch,
    check_margins,
    moe_gpt_forward,
    moe_layer,
    moe_layer_token_loop,
    objective,
    route,
    router_losses,
    updated_expert_bias,
)

ARCH = Arch(
    "moe-llama", layers=2, hidden=8, heads=2, groups=2, ffn=12, vocab=16, norm="RMSNorm",
    swiglu=True, rope=True, bias=False, tied=False,
)  # fmt: skip
L = torch.tensor([1.0, 3.0, 2.0, 0.0], dtype=torch.float64)


def test_route_softmax_after_topk():
    decision, w = route(L, MoEArch(experts=4, topk=2, ffn=1), None)
    assert decision.experts == (1, 2) and decision.margin == pytest.approx(1.0)
    e = math.e
    assert [float(x) for x in w] == pytest.approx([e / (1 + e), 1 / (1 + e)], rel=1e-14)


def test_route_softmax_before_topk_with_scaling():
    decision, w = route(L, MoEArch(experts=4, topk=2, ffn=1, pre_softmax=True, scaling=2.0), None)
    p = torch.softmax(L, 0)
    assert decision.experts == (1, 2)
    assert decision.margin == pytest.approx(float(p[2] - p[0]), rel=1e-14)
    assert [float(x) for x in w] == pytest.approx([2 * float(p[1]), 2 * float(p[2])], rel=1e-14)


def test_route_sigmoid_with_expert_bias_selects_by_bias_weights_by_score():
    bias = torch.tensor([0.0, 0.0, 0.0, 0.9], dtype=torch.float64)  # lifts expert 3 over 2
    moe = MoEArch(experts=4, topk=2, ffn=1, score="sigmoid", expert_bias=True)
    decision, w = route(L, moe, bias)
    s = torch.sigmoid(L)
    assert decision.experts == (3, 1) or decision.experts == (1, 3)
    assert set(decision.experts) == {1, 3}
    total = float(s[1] + s[3])
    got = dict(zip(decision.experts, [float(x) for x in w]))
    assert got[1] == pytest.approx(float(s[1]) / total, rel=1e-14)
    assert got[3] == pytest.approx(float(s[3]) / total, rel=1e-14)
    top1, w1 = route(L, MoEArch(experts=4, topk=1, ffn=1, score="sigmoid"), None)
    assert top1.experts == (1,) and float(w1[0]) == pytest.approx(float(s[1]))  # no renorm


def test_route_group_limited():
    # groups {0, 1} and {2, 3}; with top-2 over one group the group scores are the sums of
    # the group's top 2 = 4 and 2: group 0 wins, so experts 1 and 0 (not 2)
    moe = MoEArch(experts=4, topk=2, ffn=1, num_groups=2, group_topk=1)
    decision, w = route(L, moe, None)
    assert decision.experts == (1, 0)
    assert decision.margin == pytest.approx(2.0)  # the group choice; k = 2 takes the group
    assert [float(x) for x in w] == pytest.approx(torch.softmax(L[[1, 0]], 0).tolist())


def test_router_losses_hand_computed():
    """Two sequences of two tokens, E = 2, k = 1, one padded token."""
    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0]], [[1.0, 1.5], [3.0, 0.0]]], dtype=torch.float64)
    valid = torch.tensor([[True, True], [True, False]])
    moe = MoEArch(experts=2, topk=1, ffn=1, aux=0.5, seq_aux=0.25, z=0.1)
    st = router_losses(logits, valid, moe)
    p = torch.softmax(logits, -1)
    # valid tokens: (0,0) -> expert 0, (0,1) -> 1, (1,0) -> 1
    n = torch.tensor([1.0, 2.0], dtype=torch.float64)
    P = p[0, 0] + p[0, 1] + p[1, 0]
    aux = 2 / (1 * 3**2) * float((n * P).sum())
    assert st.aux_raw == pytest.approx(aux, rel=1e-13)
    assert float(st.aux) == pytest.approx(0.5 * aux, rel=1e-13)
    seq0 = 2 / 4 * float(torch.tensor([1.0, 1.0], dtype=torch.float64) @ (p[0, 0] + p[0, 1]))
    seq1 = 2 / 1 * float(torch.tensor([0.0, 1.0], dtype=torch.float64) @ p[1, 0])
    assert st.seq_aux_raw == pytest.approx((seq0 + seq1) / 2, rel=1e-13)
    lse = torch.logsumexp(logits, -1)
    z = float(lse[0, 0] ** 2 + lse[0, 1] ** 2 + lse[1, 0] ** 2) / 3
    assert st.z_raw == pytest.approx(z, rel=1e-13) and float(st.z) == pytest.approx(0.1 * z)
    empty = router_losses(logits, torch.zeros(2, 2, dtype=torch.bool), moe)
    assert float(empty.total) == 0.0  # an all-padding micro-batch adds nothing


def test_objective_modes():
    s, c = [torch.tensor(6.0), torch.tensor(2.0)], [torch.tensor(3.0), torch.tensor(0.0)]
    r, t = [torch.tensor(0.5), torch.tensor(0.25)], [4, 2]
    assert float(objective(AVERAGED, s, c, r, t)) == pytest.approx((6 / 3 + 0.5 + 2 + 0.25) / 2)
    assert float(objective(PER_TOKEN, s, c, r, t)) == pytest.approx((8 + 4 * 0.5 + 2 * 0.25) / 3)


def test_expert_bias_update():
    new = updated_expert_bias(torch.zeros(4, dtype=torch.float64), [1, 5, 3, 3], 0.01)
    assert new.tolist() == pytest.approx([0.01, -0.01, 0.0, 0.0])


def _params(moe: MoEArch, seed: int = 0, std: float = 0.4):
    """Random float64 weights in the reference's naming (SequentialMLP, global indices)."""
    gen = torch.Generator().manual_seed(seed)
    h, f, v = ARCH.hidden, ARCH.ffn, ARCH.vocab

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * std

    p = {"embedding.word_embeddings.weight": rnd(v, h), "output_layer.weight": rnd(v, h)}
    p["decoder.final_layernorm.weight"] = 1 + rnd(h)
    for layer in range(ARCH.layers):
        q = f"decoder.layers.{layer}."
        p[q + "input_layernorm.weight"] = 1 + rnd(h)
        p[q + "pre_mlp_layernorm.weight"] = 1 + rnd(h)
        p[q + "self_attention.linear_qkv.weight"] = rnd(h + 2 * h // ARCH.heads * ARCH.groups, h)
        p[q + "self_attention.linear_proj.weight"] = rnd(h, h)
        if not moe.is_moe(layer):
            p[q + "mlp.linear_fc1.weight"] = rnd(2 * f, h)
            p[q + "mlp.linear_fc2.weight"] = rnd(h, f)
            continue
        p[q + "mlp.router.weight"] = rnd(moe.experts, h) * 3
        for e in range(moe.experts):
            p[q + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = rnd(2 * moe.ffn, h)
            p[q + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = rnd(h, moe.ffn)
        if moe.shared_ffn:
            p[q + "mlp.shared_experts.linear_fc1.weight"] = rnd(2 * moe.shared_ffn, h)
            p[q + "mlp.shared_experts.linear_fc2.weight"] = rnd(h, moe.shared_ffn)
            p[q + "mlp.shared_experts.gate_weight"] = rnd(1, h)
    return p


def test_all_experts_equal_to_the_dense_mlp_give_the_dense_model():
    """k = E with softmax after top-k: the gates sum to 1, so identical experts (the dense
    MLP's weights) give exactly the dense model."""
    moe = MoEArch(experts=3, topk=3, ffn=ARCH.ffn)
    p = _params(moe)
    dense = {k: v for k, v in p.items() if ".mlp." not in k}
    for layer in range(ARCH.layers):
        q = f"decoder.layers.{layer}."
        for name in ("linear_fc1", "linear_fc2"):
            dense[q + f"mlp.{name}.weight"] = p[q + f"mlp.experts.local_experts.0.{name}.weight"]
            for e in range(moe.experts):
                p[q + f"mlp.experts.local_experts.{e}.{name}.weight"] = dense[
                    q + f"mlp.{name}.weight"
                ]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ARCH.vocab, (2, 6), generator=gen)
    labels = torch.randint(0, ARCH.vocab, (2, 6), generator=gen)
    moe_losses, _ = moe_gpt_forward(p, ARCH, moe, tokens, labels, token_loop=True)
    dense_losses = dense_gpt_losses(dense, ARCH, tokens, labels)
    assert float((moe_losses - dense_losses).abs().max()) < 1e-13


@pytest.mark.parametrize(
    "moe",
    [
        MoEArch(experts=4, topk=2, ffn=6),
        MoEArch(experts=4, topk=1, ffn=6, pre_softmax=True, scaling=1.5),
        MoEArch(experts=4, topk=2, ffn=6, score="sigmoid", expert_bias=True),
        MoEArch(experts=4, topk=2, ffn=6, num_groups=2, group_topk=1, pre_softmax=True),
        MoEArch(experts=4, topk=2, ffn=6, shared_ffn=5, shared_gate=True, layer_freq=(1, 0)),
    ],
    ids=["softmax-top2", "presoftmax-top1-scaled", "sigmoid-bias", "grouped", "shared-gate-mixed"],
)
def test_token_loop_equals_a_vectorized_moe(moe: MoEArch):
    """The per-token loop (and the reference's gate-matrix layer) against a dense-gate
    formulation: G [T, E] from torch.topk (and a
    group mask), y = sum_e G[:, e] * FFN_e(X) (+ gated shared expert), layer by layer."""
    p = _params(moe, seed=3)
    bias = torch.linspace(-0.2, 0.2, moe.experts, dtype=torch.float64)
    layer = 0
    prefix = f"decoder.layers.{layer}."
    q = {k[len(prefix) :]: v for k, v in p.items() if k.startswith(prefix)}
    if moe.expert_bias:
        q["mlp.router.expert_bias"] = bias
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(2, 7, ARCH.hidden, generator=gen, dtype=torch.float64)
    valid = torch.ones(2, 7, dtype=torch.bool)
    looped, stats = moe_layer_token_loop(q, ARCH, moe, h, valid)
    gated, gated_stats = moe_layer(q, ARCH, moe, h, valid)
    assert float((gated - looped).abs().max()) < 1e-12
    assert gated_stats.all_counts == stats.all_counts
    X = h.reshape(-1, ARCH.hidden)
    logits = X @ q["mlp.router.weight"].t()
    if moe.score == "sigmoid":
        scores = torch.sigmoid(logits)
        idx = (scores + bias).topk(moe.topk, -1).indices
        w = scores.gather(-1, idx)
        w = w / w.sum(-1, keepdim=True) if moe.topk > 1 else w
    else:
        scores = torch.softmax(logits, -1) if moe.pre_softmax else logits
        masked = scores
        if moe.group_topk:
            grouped = scores.view(len(X), moe.num_groups, -1)
            gscore = grouped.topk(moe.topk // moe.group_topk, -1).values.sum(-1)
            keep = torch.zeros_like(gscore).scatter(-1, gscore.topk(moe.group_topk, -1).indices, 1)
            keep = keep.repeat_interleave(moe.experts // moe.num_groups, -1).bool()
            masked = scores.masked_fill(~keep, -math.inf)
        idx = masked.topk(moe.topk, -1).indices
        w = scores.gather(-1, idx)
        w = w if moe.pre_softmax else torch.softmax(w, -1)
    w = w * (moe.scaling or 1.0)
    gates = torch.zeros_like(logits).scatter(-1, idx, w)
    out = torch.zeros_like(X)
    for e in range(moe.experts):
        pre = f"mlp.experts.local_experts.{e}."
        gate, up = (X @ q[pre + "linear_fc1.weight"].t()).chunk(2, -1)
        out += gates[:, e : e + 1] * ((F.silu(gate) * up) @ q[pre + "linear_fc2.weight"].t())
    if moe.shared_ffn:
        gate, up = (X @ q["mlp.shared_experts.linear_fc1.weight"].t()).chunk(2, -1)
        shared = (F.silu(gate) * up) @ q["mlp.shared_experts.linear_fc2.weight"].t()
        out += torch.sigmoid(X @ q["mlp.shared_experts.gate_weight"].t()) * shared
    assert float((looped.reshape(-1, ARCH.hidden) - out).abs().max()) < 1e-12
    counts = torch.zeros(moe.experts).scatter_add(0, idx.reshape(-1), torch.ones(idx.numel()))
    assert stats.all_counts == counts.long().tolist()
    assert not check_margins([{0: stats}], 1e-4), "pick another seed: a near tie"


def test_margin_guard_reports_a_near_tie():
    moe = MoEArch(experts=4, topk=2, ffn=1)
    tie = torch.tensor([1.0, 2.0, 1.0 + 1e-9, 0.0], dtype=torch.float64)
    decision, _ = route(tie, moe, None)
    stats = LayerStats(aux=torch.zeros(()), seq_aux=torch.zeros(()), z=torch.zeros(()))
    stats.routing = [[decision]]
    assert check_margins([{0: stats}], 1e-6)
    far, _ = route(L, moe, None)
    stats.routing = [[far]]
    assert not check_margins([{0: stats}], 1e-6)


def test_gate_matrix_and_token_loop_models_agree_with_padding():
    """The whole MoE GPT (shared expert, sigmoid + bias, dense + MoE layers, padding):
    losses, router losses, counts and gradients equal between the two MoE layer forms."""
    moe = MoEArch(
        experts=4, topk=2, ffn=6, score="sigmoid", expert_bias=True, shared_ffn=5,
        shared_gate=True, layer_freq=(1, 0), aux=0.1, seq_aux=0.2, z=0.01,
    )  # fmt: skip
    p = _params(moe, seed=7)
    p["decoder.layers.0.mlp.router.expert_bias"] = torch.tensor(
        [0.05, -0.05, 0.0, 0.02], dtype=torch.float64
    )
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, ARCH.vocab, (2, 6), generator=gen)
    labels = torch.randint(0, ARCH.vocab, (2, 6), generator=gen)
    padding = torch.arange(6) >= torch.tensor([[4], [6]])
    results = []
    for loop in (False, True):
        q = {k: v.clone().requires_grad_(not k.endswith("expert_bias")) for k, v in p.items()}
        losses, stats = moe_gpt_forward(q, ARCH, moe, tokens, labels, padding, token_loop=loop)
        J = losses.sum() + stats[0].total
        names = [k for k in q if q[k].requires_grad]
        grads = torch.autograd.grad(J, [q[k] for k in names])
        results.append((losses, stats[0], dict(zip(names, grads))))
    (l0, s0, g0), (l1, s1, g1) = results
    assert float((l0 - l1).detach().abs().max()) < 1e-12
    assert s0.valid_counts == s1.valid_counts and s0.all_counts == s1.all_counts
    assert sum(s0.valid_counts) == 2 * 10  # 10 valid tokens, k = 2
    assert abs(float(s0.total) - float(s1.total)) < 1e-12
    for name in g0:
        assert float((g0[name] - g1[name]).abs().max()) < 1e-11, name
