"""The router losses of the MoE layer: the token counts they are defined over, the
load-balancing and z losses, and the autograd function that attaches them to an activation.

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

from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from megatron.core import communication
from megatron.core.transformer.loss_auto_scaler import loss_auto_scaler

MoEAuxLossAutoScaler = loss_auto_scaler(
    "MoEAuxLossAutoScaler",
    """Attach a router loss to an activation (``loss_auto_scaler``): the schedules set its
    scale each step, the gradient scale times C / M in the averaged and legacy loss modes,
    the gradient scale alone in per-token mode.""",
    __name__,
)


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


def _as_float(value: Union[int, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``value`` as a scalar tensor of ``like``'s dtype and device."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=like.device, dtype=like.dtype)
    return torch.tensor(float(value), dtype=like.dtype, device=like.device)
