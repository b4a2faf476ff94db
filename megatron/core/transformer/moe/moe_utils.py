"""Routing, router losses, token permutation and the router-loss tracker of the MoE layer
(megatron-core 0.16.1's ``moe_utils`` names).

Definitions (micro-batch m of one data-parallel replica, all of its TP / CP shards
together; T_m its valid tokens, E experts, k = ``moe_router_topk``, c a coefficient,
p_e(x) the aux-loss score of expert e for token x, n_e the number of valid tokens whose
aux-loss top-k holds e):

    aux_m = E c / (k T_m^2) * sum_e n_e * sum_{x valid} p_e(x)
    seq_aux_m = (1/B) sum_b E c / (k T_b^2) * sum_e n_{b,e} * sum_{x in b, valid} p_e(x)
    z_m = c * sum_{x valid} logsumexp(logits(x))^2 / T_m

n and T always count the whole micro-batch (``micro_batch_token_counts``: an out-of-place
all-reduce over the model's tp x cp group); each shard adds the part of the sums over x it
holds, so the sum over shards is the micro-batch's loss whatever the layout.
"""

from typing import Dict, List, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core import communication
from megatron.core.process_groups_config import (
    ProcessGroupCollection,
    get_pg_size,
    resolve_pg_collection,
)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Attach a router loss to an activation: the forward returns the activation, the
    backward gives the loss the gradient ``main_loss_backward_scale`` (set by the schedules
    for each step: the gradient scale times C / M in the averaged and legacy loss modes,
    the gradient scale alone in per-token mode, see ``set_loss_scale``)."""

    main_loss_backward_scale: Optional[torch.Tensor] = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        """The activation, unchanged; remembers the loss."""
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """dJ/d(activation) passes through; d(scale * loss)/d(loss) = scale."""
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is None:
            grad = torch.ones_like(aux_loss)
        else:
            grad = (
                scale.detach().to(device=aux_loss.device, dtype=aux_loss.dtype).expand_as(aux_loss)
            )
        return grad_output, grad.clone()

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """The gradient the attached losses receive in the backward (a one-element tensor)."""
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale.detach().clone().reshape(())


class TokenCounts(NamedTuple):
    """Token counts of one MoE layer and micro-batch (int64): this shard's
    (``local_per_expert`` [E], ``local_tokens``) and the whole micro-batch's (``per_expert``,
    ``tokens``)."""

    local_per_expert: torch.Tensor
    local_tokens: torch.Tensor
    per_expert: torch.Tensor
    tokens: torch.Tensor


def micro_batch_token_counts(
    routing_map: torch.Tensor,
    valid: Optional[torch.Tensor],
    group: Optional[dist.ProcessGroup],
) -> TokenCounts:
    """Counts of ``routing_map`` [T, E] (bool) over the valid tokens (``valid`` [T] bool,
    None = all): this shard's and, summed over ``group`` (the model's tp x cp group: the
    shards of one micro-batch), the micro-batch's. A pure function: the all-reduce runs on a
    new tensor; ``routing_map`` and ``valid`` are never modified."""
    device = routing_map.device
    chosen = routing_map if valid is None else routing_map & valid.unsqueeze(-1)
    local_per_expert = chosen.sum(dim=0, dtype=torch.int64)
    if valid is None:  # made on the device: a host tensor copied over would sync on CUDA
        local_tokens = torch.full((), routing_map.shape[0], dtype=torch.int64, device=device)
    else:
        local_tokens = valid.sum(dtype=torch.int64)
    local = torch.cat([local_per_expert, local_tokens.reshape(1)])
    total = communication.all_reduce(local, group)
    if total is local:
        total = local.clone()
    return TokenCounts(local_per_expert, local_tokens, total[:-1], total[-1])


def count_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of ``experts`` (flat expert indices) name each of ``num_experts`` (int64,
    on their device). ``torch.bincount`` would read the largest index back to the host (a
    sync on CUDA); an integer ``index_add_`` is exact in any order."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.index_add_(0, experts, torch.ones_like(experts, dtype=torch.int64))


def router_loss_token_weight(config, counts: TokenCounts) -> Union[int, torch.Tensor]:
    """What a micro-batch's router losses are multiplied by before their backward: T_m (its
    valid tokens) in per-token mode, where the objective is sum_m T_m (aux_m + z_m) / N
    (``finalize_model_grads`` divides by N); 1 in the averaged and legacy modes."""
    if config.calculate_per_token_loss:
        return counts.tokens
    return 1


def switch_load_balancing_loss_func(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: Union[int, torch.Tensor],
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
    fused: bool = False,
    padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """This shard's part of the switch load-balancing loss:

        E c / (k T^2) * sum_e n_e * sum_{x in this shard, not padding} p_e(x)

    with ``probs`` [T_local, E] the aux-loss scores, ``tokens_per_expert`` n [E] and
    ``total_num_tokens`` T counted over the whole micro-batch (0 when T = 0).
    ``padding_mask`` [T_local] is True for padding tokens."""
    if fused:
        raise NotImplementedError("switch_load_balancing_loss_func: fused=True is not supported")
    if padding_mask is not None:
        probs = probs.masked_fill(padding_mask.reshape(-1, 1), 0.0)
    score_sums = probs.sum(dim=0)
    total = _as_float(total_num_tokens, probs)
    scale = num_experts * moe_aux_loss_coeff / (topk * torch.clamp(total, min=1.0) ** 2)
    return (tokens_per_expert.to(probs.dtype) * score_sums).sum() * scale


def z_loss_func(
    logits: torch.Tensor,
    z_loss_coeff: float,
    padding_mask: Optional[torch.Tensor] = None,
    num_tokens: Optional[Union[int, torch.Tensor]] = None,
) -> torch.Tensor:
    """This shard's part of the router z-loss, c * sum_{x not padding} logsumexp(x)^2 / T,
    with T = ``num_tokens`` (the micro-batch's valid tokens; an extra argument of this core)
    or, when None, this shard's own count (megatron-core's per-shard mean)."""
    squares = torch.logsumexp(logits, dim=-1) ** 2
    if padding_mask is not None:
        squares = squares.masked_fill(padding_mask.reshape(-1), 0.0)
    if num_tokens is None:
        num_tokens = squares.numel() if padding_mask is None else (~padding_mask).sum()
    total = _as_float(num_tokens, squares)
    return squares.sum() * z_loss_coeff / torch.clamp(total, min=1.0)


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


def permute(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    num_out_tokens: Optional[int] = None,
    fused: bool = False,
    drop_and_pad: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Rows of ``tokens`` [T, H] grouped by expert: for e = 0 .. E-1, the tokens routed to
    e in token order. Returns (permuted tokens, their probs (or None), source token index
    of every row)."""
    if fused or drop_and_pad:
        raise NotImplementedError("permute: fused / drop_and_pad are not supported")
    expert_major = routing_map.t()
    sorted_indices = expert_major.nonzero(as_tuple=True)[1]
    if num_out_tokens is not None and num_out_tokens != sorted_indices.numel():
        raise ValueError(
            f"permute: num_out_tokens={num_out_tokens} but the routing map routes "
            f"{sorted_indices.numel()} (token, expert) pairs"
        )
    slot_of, width = _slots_of(routing_map)
    permuted = gather_routes(tokens, sorted_indices * width + slot_of, width)
    permuted_probs = None
    if probs is not None:
        permuted_probs = probs.t()[expert_major]
    return permuted, permuted_probs, sorted_indices


def unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: torch.Size,
    probs: Optional[torch.Tensor] = None,
    routing_map: Optional[torch.Tensor] = None,
    fused: bool = False,
    drop_and_pad: bool = False,
) -> torch.Tensor:
    """The inverse of ``permute``: each token's rows (times their probs, when given)
    summed in expert order, deterministically (no atomic scatter-add). ``routing_map`` is
    required (it gives each row its place among its token's experts)."""
    if fused or drop_and_pad:
        raise NotImplementedError("unpermute: fused / drop_and_pad are not supported")
    if routing_map is None:
        raise ValueError("unpermute: routing_map is required")
    rows = permuted_tokens
    if probs is not None:
        rows = rows * probs.t()[routing_map.t()].unsqueeze(-1).to(rows.dtype)
    num_tokens, _ = restore_shape
    slot_of, width = _slots_of(routing_map)
    routes = sorted_indices * width + slot_of
    return sum_slots_in_order(routes_into_slots(rows, routes, num_tokens, width))


def gather_routes(tokens: torch.Tensor, routes: torch.Tensor, topk: int) -> torch.Tensor:
    """The token row of every route, ``tokens[routes // topk]`` [R, H], for routes
    r = t k + j (token t's j-th slot; each route at most once). Its gradient adds each
    token's route gradients in slot order (``sum_slots_in_order``): deterministic, where
    ``index_select``'s backward is an atomic ``index_add_`` on CUDA (and ~3x slower)."""
    return _GatherRoutes.apply(tokens, routes, topk)


def routes_into_slots(
    rows: torch.Tensor, routes: torch.Tensor, num_tokens: int, topk: int
) -> torch.Tensor:
    """[num_tokens, topk, H] zeros with row i at slot ``routes[i]`` = [t, j]
    (differentiable: the gradient of row i is the gradient of its slot)."""
    return _IntoSlots.apply(rows, routes, num_tokens, topk)


def sum_slots_in_order(slots: torch.Tensor) -> torch.Tensor:
    """[T, k, H] -> [T, H], adding slot 0, then 1, ... (a fixed order on every layout).
    The gradient is the output's gradient broadcast to every slot (no per-slot buffers)."""
    return _SumSlots.apply(slots)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse`` with ``inverse[order[i]] = i`` (``order`` a permutation of 0..n-1)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def _slots_of(routing_map: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """(the slot of every (token, expert) route in expert-major order: its place among its
    token's experts; the most experts of one token, at least 1)."""
    slot_of = (routing_map.cumsum(dim=1) - 1).t()[routing_map.t()]
    width = max(int(routing_map.sum(dim=1).max()) if routing_map.numel() else 0, 1)
    return slot_of, width


class _GatherRoutes(torch.autograd.Function):
    """See ``gather_routes``."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, routes: torch.Tensor, topk: int) -> torch.Tensor:
        ctx.save_for_backward(routes)
        ctx.num_tokens, ctx.topk = tokens.shape[0], topk
        return tokens.index_select(0, routes // topk)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (routes,) = ctx.saved_tensors
        with torch.no_grad():
            slots = routes_into_slots(grad, routes, ctx.num_tokens, ctx.topk)
            return _add_slots(slots), None, None


class _IntoSlots(torch.autograd.Function):
    """See ``routes_into_slots``. When every slot is filled (dropless top-k: routes is a
    permutation) the slots are one gather of the rows by the inverse permutation."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, routes: torch.Tensor, num_tokens: int, topk: int):
        ctx.save_for_backward(routes)
        ctx.topk = topk
        hidden = rows.shape[-1]
        if rows.shape[0] == num_tokens * topk:
            slots = rows.index_select(0, inverse_permutation(routes))
        else:
            slots = rows.new_zeros((num_tokens * topk, hidden)).index_copy_(0, routes, rows)
        return slots.view(num_tokens, topk, hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (routes,) = ctx.saved_tensors
        if grad.stride(1) == 0:  # every slot of a token has its gradient (sum_slots_in_order)
            return grad.select(1, 0).index_select(0, routes // ctx.topk), None, None, None
        return grad.reshape(-1, grad.shape[-1]).index_select(0, routes), None, None, None


class _SumSlots(torch.autograd.Function):
    """See ``sum_slots_in_order``."""

    @staticmethod
    def forward(ctx, slots: torch.Tensor) -> torch.Tensor:
        ctx.shape = slots.shape
        return _add_slots(slots)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.unsqueeze(1).expand(ctx.shape)


def _add_slots(slots: torch.Tensor) -> torch.Tensor:
    if slots.shape[1] == 1:
        return slots[:, 0].clone()
    total = slots[:, 0] + slots[:, 1]
    for j in range(2, slots.shape[1]):
        total += slots[:, j]
    return total


# --------------------------------------------------------------------------- the tracker

_TRACKER: Dict[str, dict] = {}


def get_moe_layer_wise_logging_tracker() -> dict:
    """The tracker: name -> {"values": [num_layers] (or [num_layers, E] for the load),
    "reduce_group": the group whose ranks hold parts of the same micro-batch (summed),
    "avg_group": the data-parallel group (averaged; summed for counts)}."""
    return _TRACKER


def save_to_aux_losses_tracker(
    name: str,
    loss: torch.Tensor,
    layer_number: int,
    num_layers: int,
    reduce_group: Optional[dist.ProcessGroup] = None,
    avg_group: Optional[dist.ProcessGroup] = None,
    reduce_group_has_dp: bool = False,
) -> None:
    """Add this shard's part of a layer's loss (``layer_number`` 1-based, global) to the
    tracker; the parts are summed over ``reduce_group`` and averaged over ``avg_group``
    when the metrics are reduced."""
    if layer_number is None:
        return
    entry = _TRACKER.setdefault(name, {})
    values = entry.get("values")
    if (
        values is None
        or values.shape[0] != num_layers
        or values.dtype != loss.dtype
        or values.device != loss.device
    ):  # another model's entry (a float32 one would round a float64 model's losses)
        values = torch.zeros(num_layers, dtype=loss.dtype, device=loss.device)
    entry["values"] = values
    values[layer_number - 1] += loss.detach().to(values.dtype)
    entry["reduce_group"] = reduce_group
    entry["avg_group"] = avg_group
    entry["reduce_group_has_dp"] = reduce_group_has_dp


def save_tokens_per_expert(
    tokens_per_expert: torch.Tensor,
    layer_number: int,
    num_layers: int,
    reduce_group: Optional[dist.ProcessGroup],
    dp_group: Optional[dist.ProcessGroup],
) -> None:
    """Add this shard's per-expert count of valid tokens (the dispatch map, int64) to the
    tracker entry "tokens_per_expert" [num_layers, E] (an extra of this core); summed over
    ``reduce_group`` and ``dp_group`` when reduced."""
    if layer_number is None:
        return
    entry = _TRACKER.setdefault("tokens_per_expert", {})
    values = entry.get("values")
    shape = (num_layers, tokens_per_expert.numel())
    if values is None or tuple(values.shape) != shape or values.device != tokens_per_expert.device:
        values = torch.zeros(shape, dtype=torch.int64, device=tokens_per_expert.device)
    entry["values"] = values
    values[layer_number - 1] += tokens_per_expert.detach().to(torch.int64)
    entry.update(reduce_group=reduce_group, sum_group=dp_group, avg_group=None)


def reset_aux_losses_tracker() -> None:
    """Drop every tracker entry (a new model): the tracker is process-wide, and an entry of
    another model would be reduced over that model's groups (a collective the new model's
    ranks never join). ``clear_aux_losses_tracker`` only zeroes the values (a new step)."""
    _TRACKER.clear()


def clear_aux_losses_tracker() -> None:
    """Zero every tracked value (start of an iteration)."""
    for entry in _TRACKER.values():
        if entry.get("values") is not None:
            entry["values"].zero_()


def reduce_aux_losses_tracker_across_ranks(
    track_names: Optional[List[str]] = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
) -> None:
    """In place: sum every entry over the pipeline group (each layer lives on one stage) and
    its ``reduce_group``; average it over ``avg_group`` (sum counts over ``sum_group``).
    Groups: ``pg_collection.pp``, else ``parallel_state``'s (MPU fallback), else none."""
    groups = resolve_pg_collection(pg_collection)
    pp = None if groups is None else groups.pp
    for name in track_names if track_names is not None else list(_TRACKER):
        entry = _TRACKER.get(name)
        if entry is None or entry.get("values") is None:
            continue
        values = entry["values"]
        for group in (pp, entry.get("reduce_group"), entry.get("sum_group")):
            values = communication.all_reduce(values, group)
        avg_group = entry.get("avg_group")
        if avg_group is not None and get_pg_size(avg_group) > 1:
            values = communication.all_reduce(values, avg_group) / get_pg_size(avg_group)
        entry["values"] = values.to(entry["values"].dtype)


def reduced_moe_metrics(
    loss_scale: float,
    num_layers: Optional[int] = None,
    moe_layer_freq=None,
    pg_collection: Optional[ProcessGroupCollection] = None,
    track_names: Optional[List[str]] = None,
) -> Dict[str, torch.Tensor]:
    """The step's tracked values reduced over ranks (``reduce_aux_losses_tracker_across_
    ranks``), losses times ``loss_scale`` (1/M): name -> per-layer values of the MoE layers
    ([L_moe], [L_moe, E] for "tokens_per_expert"). The same on every rank and layout."""
    reduce_aux_losses_tracker_across_ranks(track_names, pg_collection)
    from megatron.core.config_rules import moe_layer_pattern

    out = {}
    for name in track_names if track_names is not None else list(_TRACKER):
        entry = _TRACKER.get(name)
        if entry is None or entry.get("values") is None:
            continue
        values = entry["values"]
        layers = values.shape[0] if num_layers is None else num_layers
        pattern = moe_layer_pattern(moe_layer_freq if moe_layer_freq is not None else 1, layers)
        keep = [i for i, flag in enumerate(pattern or [1] * layers) if flag and i < len(values)]
        values = values[keep]
        out[name] = values if name == "tokens_per_expert" else values * loss_scale
    return out


def track_moe_metrics(
    loss_scale: float,
    iteration: int,
    writer=None,
    wandb_writer=None,
    total_loss_dict: Optional[dict] = None,
    per_layer_logging: bool = False,
    force_initialize: bool = False,
    track_names: Optional[List[str]] = None,
    num_layers: Optional[int] = None,
    moe_layer_freq=None,
    mtp_num_layers: Optional[int] = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
) -> None:
    """Reduce the tracked router losses over ranks, add each loss's mean over the MoE
    layers (times ``loss_scale``) to ``total_loss_dict``, write them (and, with
    ``per_layer_logging``, each layer's) to ``writer`` / ``wandb_writer``, and clear the
    tracker. The values are the same on every layout (see the module docstring)."""
    if mtp_num_layers:
        raise NotImplementedError("track_moe_metrics: mtp_num_layers is not supported")
    if force_initialize and track_names:
        for name in track_names:
            _TRACKER.setdefault(name, {}).setdefault("values", None)
    metrics = reduced_moe_metrics(
        loss_scale, num_layers, moe_layer_freq, pg_collection, track_names
    )
    for name, values in metrics.items():
        if name == "tokens_per_expert" or values.numel() == 0:
            continue
        mean = values.double().mean()
        if total_loss_dict is not None:
            total_loss_dict[name] = total_loss_dict.get(name, 0.0) + mean
        if writer is not None:
            writer.add_scalar(name, float(mean), iteration)
            if per_layer_logging:
                for i, value in enumerate(values.tolist()):
                    writer.add_scalar(f"moe/{name}_layer_{i}", value, iteration)
        if wandb_writer is not None:
            logs = {name: float(mean)}
            if per_layer_logging:
                logs.update({f"moe/{name}_layer_{i}": v for i, v in enumerate(values.tolist())})
            wandb_writer.log(logs, iteration)
    clear_aux_losses_tracker()


def get_default_pg_collection() -> ProcessGroupCollection:
    """The MoE layer's groups from ``parallel_state`` (MPU fallback): ep, expt_tp, tp_ep,
    expt_dp, tp, cp, tp_cp, dp, tp_dp_cp, pp."""
    return ProcessGroupCollection.use_mpu_process_groups(
        ["ep", "expt_tp", "tp_ep", "expt_dp", "tp", "cp", "tp_cp", "dp", "tp_dp_cp", "pp"]
    )


def _as_float(value: Union[int, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``value`` as a scalar tensor of ``like``'s dtype and device."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=like.device, dtype=like.dtype)
    return torch.tensor(float(value), dtype=like.dtype, device=like.device)
