"""Gradient norm, clipping and zero counting over model-parallel ranks (megatron-core names).

The norm for clipping is the norm of the whole model's gradient, each element counted once
(SPEC 12 rule 4). With the non-distributed optimizer every rank holds the full gradient of its
model-parallel shard after ``finalize_model_grads`` (identical across DP and CP), so

    ||g||^2 = sum over the model-parallel group (tp x pp) of sum over this rank's grads ||g_i||^2

where the caller keeps, on each rank, only the grads that are not a copy counted elsewhere:
TP-sharded parameters always, TP-replicated ones on TP rank 0 only
(``param_is_not_tensor_parallel_duplicate``), and not the tied output-layer copy of the word
embeddings (``param.shared``). DP/CP replicas are not summed because the group excludes them.
"""

import math
from typing import Any, Callable, List, Optional, Union

import torch
import torch.distributed as dist

from megatron.core.communication import all_reduce_
from megatron.core.device import comm_device
from megatron.core.transformer.module import param_is_not_shared

# reduce(tensor, op) -> tensor: sums (or maxes) a local statistic over the ranks that hold the
# other pieces of the gradient (an optimizer's ``_reduce_grad_stats``)
StatsReduce = Callable[[torch.Tensor, Any], torch.Tensor]


def get_grad_norm_fp32(
    grads_for_norm: Union[List[torch.Tensor], torch.Tensor],
    norm_type: Union[int, float] = 2,
    grad_stats_parallel_group: Optional[dist.ProcessGroup] = None,
) -> float:
    """The ``norm_type`` norm of ``grads_for_norm`` viewed as one vector spanning the group.

    p-norm: ``(sum_ranks sum_i ||g_i||_p^p)^(1/p)`` (powers summed in float64); ``inf``: the
    largest |g| over the group. The group is a resolved one (``resolve_group``): None means
    this rank alone (no collective), as everywhere in this package.
    """
    return grad_norm(
        grads_for_norm,
        norm_type,
        _group_reduce(grad_stats_parallel_group),
        comm_device(grad_stats_parallel_group),
    )


def grad_norm(
    grads_for_norm: Union[List[torch.Tensor], torch.Tensor],
    norm_type: Union[int, float],
    reduce: StatsReduce,
    device: torch.device,
) -> float:
    """``get_grad_norm_fp32`` with the reduction given as ``reduce`` (statistics on
    ``device``): the one norm the plain and the distributed optimizer share."""
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    norm_type = float(norm_type)
    grads = [g.detach() for g in grads_for_norm]
    if norm_type == math.inf:
        local = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
        total = torch.tensor([local], dtype=torch.float64, device=device)
        return float(reduce(total, dist.ReduceOp.MAX).item())
    total = torch.zeros(1, dtype=torch.float64, device=device)
    if grads:
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) for g in grads]
        total += torch.stack(norms).pow(norm_type).sum().to(device)
    return float(reduce(total, dist.ReduceOp.SUM).item()) ** (1.0 / norm_type)


def clip_grad_by_total_norm_fp32(
    parameters: Union[List[torch.Tensor], torch.Tensor],
    max_norm: Union[int, float],
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """Scale every ``param.grad`` by ``max_norm / (total_norm + 1e-6)`` when that is < 1."""
    if use_decoupled_grad:
        raise NotImplementedError("use_decoupled_grad=True: decoupled grads are not supported")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    for g in grads:
        if g.dtype != torch.float32:
            raise TypeError(
                f"clip_grad_by_total_norm_fp32: a grad has dtype {g.dtype}, expected fp32"
            )
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def count_zeros_fp32(
    parameters: Union[List[torch.Tensor], torch.Tensor],
    grad_stats_parallel_group: Optional[dist.ProcessGroup],
    use_decoupled_grad: bool = False,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> float:
    """Number of zero gradient elements, counting each element once (same filter as the
    norm: not shared, not a TP duplicate), summed over ``grad_stats_parallel_group``."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    if use_decoupled_grad:
        raise NotImplementedError("use_decoupled_grad=True: decoupled grads are not supported")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [
        p.grad
        for p in parameters
        if p.grad is not None
        and param_is_not_shared(p)
        and param_is_not_tensor_parallel_duplicate(p, tp_group)
    ]
    return count_zeros(
        grads, _group_reduce(grad_stats_parallel_group), comm_device(grad_stats_parallel_group)
    )


def count_zeros(grads: List[torch.Tensor], reduce: StatsReduce, device: torch.device) -> float:
    """Zero elements of ``grads`` (already filtered), summed by ``reduce``."""
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for grad in grads:
        total += float(grad.numel() - torch.count_nonzero(grad).item())
    return float(reduce(total, dist.ReduceOp.SUM).item())


def _group_reduce(group: Optional[dist.ProcessGroup]) -> StatsReduce:
    return lambda tensor, op: all_reduce_(tensor, group, op)
