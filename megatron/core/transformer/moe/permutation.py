"""Token permutation of the MoE dispatchers: rows grouped by expert and back, each route
summed in a fixed slot order (deterministic on every layout, no atomic scatter-add), and the
per-expert counts."""

from typing import Optional, Tuple

import torch


def count_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of ``experts`` (flat expert indices) name each of ``num_experts`` (int64,
    on their device). ``torch.bincount`` would read the largest index back to the host (a
    sync on CUDA); an integer ``index_add_`` is exact in any order."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.index_add_(0, experts, torch.ones_like(experts, dtype=torch.int64))


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
