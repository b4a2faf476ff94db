"""An independent mixture-of-experts GPT for the MoE parity tests: float64, one process, the
whole micro-batch, each token routed by a plain Python loop (no dispatcher, no permutation,
no grouped GEMM), written from the math of SPEC section 18 / issue 30, not from the model's
modules. The attention, norms and embeddings are ``dense_gpt``'s; MoE layers replace the MLP.

One MoE layer on a token with normalized hidden state x (router weight W [E, h]):

    logits l = W x
    routing (the dispatch map; every token, padded or not, is routed and computed):
      softmax, after top-k (default):  idx = topk(l),          w = softmax(l[idx])
      softmax, before top-k:           s = softmax(l), idx = topk(s), w = s[idx]
      sigmoid (+ expert bias b):       s = sigmoid(l), idx = topk(s + b), w = s[idx],
                                       w /= sum(w) + 1e-20 when k > 1
      group-limited: E experts in G groups; a group scores the sum of its top k/g_k scores;
      the top g_k groups' experts compete; finally w *= scaling factor (when set)
    y = sum_{j = 1..k, top-k order} w_j FFN_{idx_j}(x) (+ sigmoid(x . g) FFN_shared(x))

Router losses of layer l on micro-batch m (valid = not padding, T_m valid tokens, B sequences,
T_b valid tokens of sequence b); the aux-loss scores p are softmax(l) over all E (sigmoid:
s / sum s) and the aux map is plain topk(p), valid tokens only:

    aux_m     = E c / (k T_m^2)  sum_e n_e sum_{x valid} p_e(x)
    seq_aux_m = (1/B) sum_b E c / (k T_b^2) sum_e n_{b,e} sum_{x in b valid} p_e(x)
    z_m       = c_z sum_{x valid} lse(l(x))^2 / T_m                (each 0 when its T is 0)

Objectives over the G = D*M micro-batches (S_m, N_m: masked LM-loss sum and count):
    averaged, legacy:  J = (1/G) sum_m (S_m / max(N_m, 1) + sum_l (aux + seq_aux + z)_{m,l})
    per-token:         J = (sum_m S_m + sum_m T_m sum_l (aux + seq_aux + z)_{m,l}) / max(N, 1)

The routing guard: every token's selection margin (the k-th selected score minus the best
unselected one, and the same for the group choice) is recorded; ``check_margins`` fails the
test setup when one is below a threshold, since a layout's rounding could flip the choice.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from tests.unit_tests.models.dense_gpt import Arch, dense_gpt_losses, dense_mlp

PER_TOKEN, AVERAGED, LEGACY = "per-token", "averaged", "legacy"


@dataclass(frozen=True)
class MoEArch:
    """The MoE knobs the reference follows (megatron-core's field in the comment)."""

    experts: int  # num_moe_experts
    topk: int  # moe_router_topk
    ffn: int  # moe_ffn_hidden_size
    layer_freq: Tuple[int, ...] = ()  # moe_layer_freq as a per-layer 0/1 list (() = all MoE)
    score: str = "softmax"  # moe_router_score_function
    pre_softmax: bool = False  # moe_router_pre_softmax
    scaling: Optional[float] = None  # moe_router_topk_scaling_factor
    num_groups: Optional[int] = None  # moe_router_num_groups
    group_topk: Optional[int] = None  # moe_router_group_topk
    expert_bias: bool = False  # moe_router_enable_expert_bias
    bias_rate: float = 1e-3  # moe_router_bias_update_rate
    aux: float = 0.0  # moe_aux_loss_coeff with load balancing type "aux_loss"
    seq_aux: float = 0.0  # ... with "seq_aux_loss"
    z: Optional[float] = None  # moe_z_loss_coeff
    shared_ffn: Optional[int] = None  # moe_shared_expert_intermediate_size
    shared_gate: bool = False  # moe_shared_expert_gate

    def is_moe(self, layer: int) -> bool:
        return not self.layer_freq or bool(self.layer_freq[layer])


@dataclass
class Routing:
    """One token's routing decision."""

    experts: Tuple[int, ...]  # top-k order
    margin: float  # the smallest selection margin (expert and group choice)


@dataclass
class LayerStats:
    """One MoE layer on one micro-batch: router losses (without coefficient, as logged, and
    with), the dispatch map's per-expert counts (valid tokens only, and all tokens), and
    every token's routing, indexed [b][s]."""

    aux: torch.Tensor
    seq_aux: torch.Tensor
    z: torch.Tensor
    aux_raw: float = 0.0
    seq_aux_raw: float = 0.0
    z_raw: float = 0.0
    aux_margin: float = math.inf  # smallest top-k margin of the aux map (valid tokens)
    uses_aux_map: bool = False  # an aux or seq-aux loss is on (the aux map then matters)
    valid_counts: List[int] = field(default_factory=list)
    all_counts: List[int] = field(default_factory=list)
    routing: List[List[Routing]] = field(default_factory=list)

    @property
    def total(self) -> torch.Tensor:
        return self.aux + self.seq_aux + self.z


def moe_gpt_forward(
    params: Dict[str, torch.Tensor],
    arch: Arch,
    moe: MoEArch,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    padding: Optional[torch.Tensor] = None,
    token_loop: bool = False,
) -> Tuple[torch.Tensor, Dict[int, LayerStats]]:
    """Per-token LM losses [b, s] and, per MoE layer, its ``LayerStats`` on one micro-batch.

    ``padding`` [b, s] bool, True = padding (excluded from the router losses and counts);
    None = every token valid. ``token_loop``: ``moe_layer_token_loop`` for the MoE layers."""
    layer_fn = moe_layer_token_loop if token_loop else moe_layer
    b, s = tokens.shape
    valid = torch.ones(b, s, dtype=torch.bool) if padding is None else ~padding.bool()
    stats: Dict[int, LayerStats] = {}

    def mlp(layer: int, h: torch.Tensor, p: Dict[str, torch.Tensor]) -> torch.Tensor:
        if not moe.is_moe(layer):
            return dense_mlp(h, p, "mlp", arch.swiglu)
        out, stats[layer] = layer_fn(p, arch, moe, h, valid)
        return out

    losses = dense_gpt_losses(params, arch, tokens, labels, mlp=mlp)
    return losses, stats


def moe_layer(
    p: Dict[str, torch.Tensor], arch: Arch, moe: MoEArch, h: torch.Tensor, valid: torch.Tensor
) -> Tuple[torch.Tensor, LayerStats]:
    """One MoE layer on h [b, s, hidden] (p: the layer's parameters, names as in the
    one-chunk SequentialMLP model with global expert indices).

    Each token is routed by ``route`` in a Python loop; the experts then run densely (every
    expert on every token, no dispatch) and a token keeps sum_j w_j FFN_{e_j}(x) through a
    gate matrix G [b, s, E] built from one-hot rows (no scatter). ``moe_layer_token_loop``
    is the same layer with the FFNs in the loop too (slower; the self-tests compare them)."""
    b, s, _ = h.shape
    router = p["mlp.router.weight"]
    bias = p.get("mlp.router.expert_bias") if moe.expert_bias else None
    logits = h @ router.t()  # [b, s, E]
    eye = torch.eye(moe.experts, dtype=h.dtype)
    all_counts = [0] * moe.experts
    valid_counts = [0] * moe.experts
    routing, gate_rows = [], []
    for i in range(b):
        row_routing, row_gates = [], []
        for t in range(s):
            decision, weights = route(logits[i, t], moe, bias)
            gate = sum(w * eye[e] for w, e in zip(weights, decision.experts))
            for e in decision.experts:
                all_counts[e] += 1
                valid_counts[e] += int(valid[i, t])
            row_routing.append(decision)
            row_gates.append(gate)
        routing.append(row_routing)
        gate_rows.append(torch.stack(row_gates))
    gates = torch.stack(gate_rows)  # [b, s, E]
    out = torch.zeros_like(h)
    for e in range(moe.experts):
        ffn = expert_ffn(p, f"mlp.experts.local_experts.{e}", h, arch.swiglu)
        out = out + gates[..., e : e + 1] * ffn
    if moe.shared_ffn:
        shared = dense_mlp(h, p, "mlp.shared_experts", arch.swiglu)
        if moe.shared_gate:
            shared = shared * torch.sigmoid(h @ p["mlp.shared_experts.gate_weight"].t())
        out = out + shared
    stats = router_losses(logits, valid, moe)
    stats.valid_counts, stats.all_counts, stats.routing = valid_counts, all_counts, routing
    return out, stats


def moe_layer_token_loop(
    p: Dict[str, torch.Tensor], arch: Arch, moe: MoEArch, h: torch.Tensor, valid: torch.Tensor
) -> Tuple[torch.Tensor, LayerStats]:
    """``moe_layer`` with everything per token: the router's dot products, the k selected
    experts' FFNs summed in top-k order, the shared expert and its gate."""
    b, s, _ = h.shape
    router = p["mlp.router.weight"]
    bias = p.get("mlp.router.expert_bias") if moe.expert_bias else None
    rows, routing = [], []
    all_counts = [0] * moe.experts
    valid_counts = [0] * moe.experts
    for i in range(b):
        row, row_routing = [], []
        for t in range(s):
            x = h[i, t]
            logits = torch.stack([torch.dot(router[e], x) for e in range(moe.experts)])
            decision, weights = route(logits, moe, bias)
            out = torch.zeros_like(x)
            for w, e in zip(weights, decision.experts):  # summed in top-k order
                out = out + w * expert_ffn(p, f"mlp.experts.local_experts.{e}", x, arch.swiglu)
                all_counts[e] += 1
                valid_counts[e] += int(valid[i, t])
            if moe.shared_ffn:
                shared = dense_mlp(x, p, "mlp.shared_experts", arch.swiglu)
                if moe.shared_gate:
                    shared = shared * torch.sigmoid(
                        torch.dot(p["mlp.shared_experts.gate_weight"].view(-1), x)
                    )
                out = out + shared
            row.append(out)
            row_routing.append(decision)
        rows.append(torch.stack(row))
        routing.append(row_routing)
    logits = h @ router.t()  # [b, s, E]: the router losses, vectorized over tokens
    stats = router_losses(logits, valid, moe)
    stats.valid_counts, stats.all_counts, stats.routing = valid_counts, all_counts, routing
    return torch.stack(rows), stats


def route(
    logits: torch.Tensor, moe: MoEArch, bias: Optional[torch.Tensor]
) -> Tuple[Routing, List[torch.Tensor]]:
    """One token's experts (top-k order), margin and combine weights (differentiable)."""
    k, E = moe.topk, moe.experts
    if moe.score == "sigmoid":
        scores = torch.sigmoid(logits)
        select = scores + bias if bias is not None else scores
    elif moe.pre_softmax:
        scores = select = torch.softmax(logits, dim=-1)
    else:
        scores = select = logits
    values = [float(v) for v in select.detach()]
    allowed, margins = list(range(E)), []
    if moe.group_topk:
        size, per_group = E // moe.num_groups, k // moe.group_topk
        group_score = []
        for g in range(moe.num_groups):
            members = sorted((values[e] for e in range(g * size, (g + 1) * size)), reverse=True)
            group_score.append(sum(members[:per_group]))
        order = sorted(range(moe.num_groups), key=lambda g: -group_score[g])
        chosen = order[: moe.group_topk]
        if len(order) > moe.group_topk:
            margins.append(
                group_score[order[moe.group_topk - 1]] - group_score[order[moe.group_topk]]
            )
        allowed = [e for g in sorted(chosen) for e in range(g * size, (g + 1) * size)]
    ranked = sorted(allowed, key=lambda e: -values[e])
    experts = tuple(ranked[:k])
    if len(ranked) > k:
        margins.append(values[ranked[k - 1]] - values[ranked[k]])
    if moe.score == "sigmoid":
        picked = torch.stack([scores[e] for e in experts])
        if k > 1:
            picked = picked / (picked.sum() + 1e-20)
    elif moe.pre_softmax:
        picked = torch.stack([scores[e] for e in experts])
    else:
        picked = torch.softmax(torch.stack([logits[e] for e in experts]), dim=-1)
    if moe.scaling:
        picked = picked * moe.scaling
    return Routing(experts, min(margins) if margins else math.inf), list(picked)


def expert_ffn(p: Dict[str, torch.Tensor], prefix: str, x: torch.Tensor, swiglu: bool):
    """One expert's FFN on one token (the dense MLP's math, no biases)."""
    return dense_mlp(x, p, prefix, swiglu)


def router_losses(logits: torch.Tensor, valid: torch.Tensor, moe: MoEArch) -> LayerStats:
    """aux, seq_aux and z of one layer on one micro-batch (module docstring), with their
    coefficients, plus the values without coefficients."""
    E, k = moe.experts, moe.topk
    v = valid.to(logits.dtype)  # [b, s]
    if moe.score == "sigmoid":
        sig = torch.sigmoid(logits)
        probs = sig / (sig.sum(-1, keepdim=True) + 1e-20)
    else:
        probs = torch.softmax(logits, dim=-1)
    ranked = probs.detach().sort(dim=-1, descending=True).values
    gaps = (ranked[..., k - 1] - ranked[..., k]) if k < E else torch.full_like(v, math.inf)
    aux_margin = float(gaps[valid].min()) if bool(valid.any()) else math.inf
    top = probs.detach().topk(k, dim=-1).indices
    chosen = torch.zeros_like(probs).scatter(-1, top, 1.0) * v[..., None]  # [b, s, E]
    zero = logits.sum() * 0.0

    def balance(n: torch.Tensor, p_sum: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.item() == 0:
            return zero
        return E / (k * tokens**2) * (n * p_sum).sum()

    masked = probs * v[..., None]
    T = v.sum()
    aux_raw = balance(chosen.sum((0, 1)), masked.sum((0, 1)), T)
    seq_raw = zero
    for i in range(logits.shape[0]):
        seq_raw = seq_raw + balance(chosen[i].sum(0), masked[i].sum(0), v[i].sum())
    seq_raw = seq_raw / logits.shape[0]
    lse = torch.logsumexp(logits, dim=-1)
    z_raw = (lse.square() * v).sum() / T if T.item() > 0 else zero
    z_coeff = moe.z or 0.0
    return LayerStats(
        aux=moe.aux * aux_raw,
        seq_aux=moe.seq_aux * seq_raw,
        z=z_coeff * z_raw,
        aux_raw=float(aux_raw.detach()),
        seq_aux_raw=float(seq_raw.detach()),
        z_raw=float(z_raw.detach()),
        aux_margin=aux_margin,
        uses_aux_map=bool(moe.aux or moe.seq_aux),
    )


def objective(
    mode: str,
    lm_sums: Sequence[torch.Tensor],
    lm_counts: Sequence[torch.Tensor],
    router_totals: Sequence[torch.Tensor],
    routed_tokens: Sequence[int],
) -> torch.Tensor:
    """J over the global batch's micro-batches (module docstring): ``router_totals[m]`` is
    sum over MoE layers of aux + seq_aux + z on micro-batch m, ``routed_tokens[m]`` its T_m."""
    G = len(lm_sums)
    if mode == PER_TOKEN:
        total = sum(lm_counts).clamp(min=1)
        return sum(s + t * r for s, t, r in zip(lm_sums, routed_tokens, router_totals)) / total
    return sum(s / c.clamp(min=1) + r for s, c, r in zip(lm_sums, lm_counts, router_totals)) / G


def updated_expert_bias(bias: torch.Tensor, counts: Sequence[int], rate: float) -> torch.Tensor:
    """b_e + rate * sign(mean(n) - n_e), n the global batch's valid-token counts."""
    n = torch.tensor(counts, dtype=torch.float64)
    return bias + rate * torch.sign(n.mean() - n)


def check_margins(stats: Sequence[Dict[int, LayerStats]], threshold: float) -> List[str]:
    """Tokens whose selection margin is below ``threshold`` (the routing guard)."""
    near = []
    for m, per_layer in enumerate(stats):
        for layer, st in per_layer.items():
            for i, row in enumerate(st.routing):
                for t, r in enumerate(row):
                    if r.margin < threshold:
                        near.append(
                            f"micro-batch {m} layer {layer} token (b={i}, s={t}): "
                            f"experts {r.experts} margin {r.margin:.2e} < {threshold:.0e}"
                        )
            if st.uses_aux_map and st.aux_margin < threshold:
                near.append(f"micro-batch {m} layer {layer}: aux-map margin {st.aux_margin:.2e}")
    return near
