"""The vocab-parallel cross-entropy with its elementwise passes fused
(``cross_entropy_loss_fusion``): the same math as
``tensor_parallel.vocab_parallel_cross_entropy`` (see there), computed in float32 from
half-precision logits without materializing float32 copies of them.

Forward: one compiled pass for the local max m over the vocabulary, MAX over TP, one
compiled pass for S = sum_j exp(z_j - m), z_t - m (and sum_j (z_j - m) with label
smoothing), SUM over TP. Only the logits (in their own dtype), m and S are saved. Backward:
one compiled pass writes dL/dz_j = (exp(z_j - m) / S - (1 - s)[j = t] - s / V) * dL/dloss
in the logits' dtype.
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.communication import all_reduce
from megatron.core.jit import jit_fuser
from megatron.core.process_groups_config import get_pg_size, resolve_group
from megatron.core.tensor_parallel.cross_entropy import (
    check_cross_entropy_args,
    reduce_max_over_vocab,
    smooth_loss,
)


def fused_vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token cross entropy [s, b] (float32) of logits [s, b, V/T] split over ``tp_group``
    (megatron-core's signature; default: MPU fallback); ``label_smoothing`` (an extra) as in
    ``vocab_parallel_cross_entropy``."""
    check_cross_entropy_args(
        "fused_vocab_parallel_cross_entropy", vocab_parallel_logits, target, label_smoothing
    )
    group = resolve_group("tp", tp_group)
    return _FusedCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, group)


@jit_fuser
def _local_max(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().amax(dim=-1)


@jit_fuser
def _local_sums(logits, target, logits_max, start: int, end: int, smoothing: bool):
    shifted = logits.float() - logits_max.unsqueeze(-1)
    outside = (target < start) | (target >= end)
    local = (target - start).masked_fill(outside, 0)
    predicted = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    parts = [shifted.exp().sum(-1), predicted]
    if smoothing:
        parts.append(shifted.sum(-1))
    return torch.stack(parts)


@jit_fuser
def _gradient(logits, target, logits_max, sum_exp, grad_output, start: int, end: int,
              smoothing: float, vocab: int):  # fmt: skip
    shifted = logits.float() - logits_max.unsqueeze(-1)
    probs = shifted.exp() / sum_exp.unsqueeze(-1)
    outside = (target < start) | (target >= end)
    local = (target - start).masked_fill(outside, -1)
    columns = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (columns == local.unsqueeze(-1)).to(probs.dtype)
    grad = (probs - (1.0 - smoothing) * onehot - smoothing / vocab) * grad_output.unsqueeze(-1)
    return grad.to(logits.dtype)


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        logits_max, start, end, vocab = reduce_max_over_vocab(
            _local_max(logits), logits.shape[-1], group
        )
        sums = _local_sums(logits, target, logits_max, start, end, label_smoothing > 0)
        if get_pg_size(group) > 1:
            sums = all_reduce(sums, group, dist.ReduceOp.SUM)
        sum_exp, predicted = sums[0], sums[1]
        loss, smoothing = smooth_loss(
            sum_exp.log() - predicted,
            sums,
            vocab,
            label_smoothing,
            "fused_vocab_parallel_cross_entropy",
        )
        ctx.smoothing, ctx.vocab, ctx.start, ctx.end = smoothing, vocab, start, end
        ctx.save_for_backward(logits, target, logits_max, sum_exp)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        logits, target, logits_max, sum_exp = ctx.saved_tensors
        grad = _gradient(logits, target, logits_max, sum_exp, grad_output.float(), ctx.start,
                         ctx.end, ctx.smoothing, ctx.vocab)  # fmt: skip
        return grad, None, None, None
