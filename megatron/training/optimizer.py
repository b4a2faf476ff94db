"""Adam on ``main_grad`` with gradient clipping by the global norm, in float32.

The parameters are their own fp32 master weights (float32 on CPU). After
``finalize_model_grads`` a parameter's ``main_grad`` is identical on every rank of its
dp x cp group, so the global norm sums squares over the pipeline and tensor-parallel groups
only, and counts the tied output-layer copy (marked ``shared``) once and a parameter
replicated over TP once (on TP rank 0), each TP shard once:

    ||g|| = sqrt( sum over pipeline and TP ranks of the squares of their counted params )
"""

import math
from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.device import comm_device


class FP32AdamOptimizer:
    """Adam with decoupled weight decay (AdamW) over every parameter of ``model_chunks``,
    stepping on ``main_grad``; state and math in the parameters' dtype (float32).

    ``step()``: global grad norm over ``pp_group``; if ``clip_grad > 0`` and the norm exceeds
    it, every main_grad is scaled by ``clip_grad / (norm + 1e-6)``; then, at step t, for
    each parameter p with gradient g:

        m <- b1 m + (1 - b1) g          v <- b2 v + (1 - b2) g^2
        p <- p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

    Returns the norm before clipping. (torch.optim is not used: importing it loads
    torch._dynamo, seconds of start-up on a small CPU.)
    """

    def __init__(
        self,
        model_chunks: Iterable[torch.nn.Module],
        lr: float,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        clip_grad: float = 1.0,
        pp_group: Optional[dist.ProcessGroup] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.params = [p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad]
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.clip_grad, self.pp_group, self.tp_group = clip_grad, pp_group, tp_group
        tp_rank = 0 if tp_group is None else tp_group.rank()
        self.norm_params = [
            p
            for p in self.params
            if param_is_not_shared(p)
            and (tp_rank == 0 or getattr(p, "tensor_model_parallel", False))
        ]
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.step_count = 0

    @torch.no_grad()
    def step(self) -> float:
        """Clip and apply this iteration's ``main_grad``; returns the unclipped norm."""
        grads = [p.main_grad for p in self.params]
        norm = get_grad_norm_fp32([p.main_grad for p in self.norm_params], self.pp_group)
        if self.tp_group is not None and self.tp_group.size() > 1:
            norm = _sum_of_squares_over(norm, self.tp_group)
        if self.clip_grad > 0:
            clip_grad_by_total_norm_fp32(grads, self.clip_grad, norm)
        self.step_count += 1
        beta1, beta2 = self.betas
        bias_correction1 = 1.0 - beta1**self.step_count
        bias_correction2 = 1.0 - beta2**self.step_count
        for param, grad, exp_avg, exp_avg_sq in zip(
            self.params, grads, self.exp_avg, self.exp_avg_sq
        ):
            grad = grad.to(param.dtype)
            exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            denominator = (exp_avg_sq / bias_correction2).sqrt_().add_(self.eps)
            if self.weight_decay:
                param.mul_(1.0 - self.lr * self.weight_decay)
            param.addcdiv_(exp_avg, denominator, value=-self.lr / bias_correction1)
        return norm


def get_grad_norm_fp32(grads: List[torch.Tensor], pp_group: Optional[dist.ProcessGroup]) -> float:
    """sqrt(sum ||g||^2) over ``grads`` and the ranks of ``pp_group`` (squares summed in
    float64; no collective without a group or with one rank)."""
    total = torch.zeros((), dtype=torch.float64, device=comm_device(pp_group))
    for grad in grads:
        total += grad.detach().double().square().sum().to(total.device)
    if pp_group is not None and pp_group.size() > 1:
        dist.all_reduce(total, group=pp_group)
    return math.sqrt(total.item())


def _sum_of_squares_over(norm: float, group: dist.ProcessGroup) -> float:
    """sqrt(sum over ``group`` of norm^2)."""
    total = torch.tensor(norm * norm, dtype=torch.float64, device=comm_device(group))
    dist.all_reduce(total, group=group)
    return math.sqrt(total.item())


def clip_grad_by_total_norm_fp32(grads: List[torch.Tensor], max_norm: float, total_norm: float):
    """g <- g * max_norm / (total_norm + 1e-6) for every g, when that factor is below 1."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.mul_(clip_coeff)


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """False for a duplicate copy of a tied weight (``param.shared``), counted elsewhere."""
    return not getattr(param, "shared", False)
