"""Top-k routing of the MoE router: the routing probabilities and map of the logits
(softmax or sigmoid scores, group-limited selection, expert bias), the scores of the
load-balancing losses, and the expert-bias update."""

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import communication


def group_limited_topk(
    scores: torch.Tensor,
    topk: int,
    num_tokens: int,
    num_experts: int,
    num_groups: int,
    group_topk: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to the ``group_topk`` best of ``num_groups`` expert groups (a group's
    score: the sum of its best ``topk / group_topk`` scores). Returns (scores, indices)
    [num_tokens, topk], best first."""
    per_group = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = per_group.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, best_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(per_group).reshape(num_tokens, -1)
    masked = scores.masked_fill(~expert_mask, float("-inf"))
    values, indices = masked.topk(topk, dim=-1)
    return values, indices


def topk_routing_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    score_function: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
    fused: bool = False,
    router_replay=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(routing probabilities [T, E], routing map [T, E] bool) of logits [T, E]; see
    ``topk_routing`` (which also returns the experts in top-k order)."""
    if fused:
        raise NotImplementedError("topk_routing_with_score_function: fused=True is not supported")
    if router_replay is not None:
        raise NotImplementedError(
            "topk_routing_with_score_function: router_replay is not supported"
        )
    probs, routing_map, _ = topk_routing(
        logits,
        topk,
        use_pre_softmax=use_pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=scaling_factor,
        score_function=score_function,
        expert_bias=expert_bias,
    )
    return probs, routing_map


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    use_pre_softmax: bool,
    num_groups: Optional[int],
    group_topk: Optional[int],
    scaling_factor: Optional[float],
    score_function: str,
    expert_bias: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing in the logits' dtype. Returns (probs [T, E] (zero off the map),
    routing map [T, E] bool, top-k expert indices [T, k], best first). The options are
    ``topk_routing_with_score_function``'s (megatron-core's defaults and refusals are there;
    the router passes every one from its config).

    softmax, after selection (default): idx = topk(logits), probs = softmax(logits[idx]);
    softmax, ``use_pre_softmax``: s = softmax(logits), idx = topk(s), probs = s[idx];
    sigmoid: s = sigmoid(logits), idx = topk(s + expert_bias), probs = s[idx], divided by
    their sum (+1e-20) when k > 1. Group-limited (``num_groups``, ``group_topk``): the
    selection is restricted to the best groups. Then probs *= ``scaling_factor``.
    """
    num_tokens, num_experts = logits.shape

    def select(scores: torch.Tensor) -> torch.Tensor:
        if group_topk:
            return group_limited_topk(
                scores, topk, num_tokens, num_experts, num_groups, group_topk
            )[1]
        return scores.topk(topk, dim=-1).indices

    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            indices = select(scores)
            top = scores.gather(1, indices)
        else:
            indices = select(logits)
            top = torch.softmax(logits.gather(1, indices), dim=-1)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        biased = scores if expert_bias is None else scores + expert_bias
        indices = select(biased)
        top = scores.gather(1, indices)
        if topk > 1:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}")
    if scaling_factor:
        top = top * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, indices, top)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return probs, routing_map, indices


def compute_routing_scores_for_aux_loss(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    fused: bool = False,
    padding_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(routing map [T, E] of the plain top-k of the scores, scores [T, E]) for the
    load-balancing losses: softmax over all experts, or sigmoid scores divided by their sum
    (+1e-20); in the logits' dtype. Padding rows of the scores (``padding_mask`` True) are
    zero and their map rows empty."""
    if fused:
        raise NotImplementedError("compute_routing_scores_for_aux_loss: fused=True")
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}")
    indices = scores.topk(topk, dim=-1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    if padding_mask is not None:
        pad = padding_mask.reshape(-1, 1)
        scores = scores.masked_fill(pad, 0.0)
        routing_map = routing_map & ~pad
    return routing_map, scores


def get_updated_expert_bias(
    tokens_per_expert: torch.Tensor,
    expert_bias: torch.Tensor,
    expert_bias_update_rate: float,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """b_e + rate * sign(mean(n) - n_e), n the counts [..., E] summed over ``group`` (an
    extra of this core: the model's tp x dp x cp group; the caller passes it) in int64."""
    counts = communication.all_reduce(tokens_per_expert.to(torch.int64), group)
    counts = counts.to(torch.float64)
    offset = counts.mean(dim=-1, keepdim=True) - counts
    return expert_bias + torch.sign(offset).to(expert_bias.dtype) * expert_bias_update_rate
