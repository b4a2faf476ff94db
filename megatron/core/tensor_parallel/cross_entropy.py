"""Cross entropy over logits whose vocabulary dimension is split across TP ranks.

For logits z [..., V] split into T blocks of V/T (rank r holds [r V/T, (r+1) V/T)) and a
target t, with m = max_j z_j and S = sum_j exp(z_j - m) over the WHOLE vocabulary:

    loss = log S - (z_t - m)                                  (label_smoothing = 0)

With label smoothing eps (megatron's convention: the target keeps 1 - eps, the other V - 1
entries share eps, i.e. s = eps V / (V - 1)):

    loss = (1 - s) (log S - (z_t - m)) - s ((1/V) sum_j (z_j - m) - log S)
    dloss/dz_j = p_j - (1 - s) [j = t] - s / V,   p_j = exp(z_j - m) / S

V is the full vocabulary size (the partition size times T), never the partition's, and
the mean of the log-probabilities is over the full vocabulary. Per token, S and z_t - m (and
with smoothing sum_j (z_j - m)) are summed over the group in one all-reduce, after one MAX
all-reduce for m. The caller's logits are never modified; computation is in float32 (float64
for float64 logits). Groups: ``tp_group`` when given, else the MPU fallback
(``parallel_state``'s TP group when initialized, else one rank).
"""

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.communication import all_reduce
from megatron.core.process_groups_config import get_pg_rank, get_pg_size, resolve_group
from megatron.core.tensor_parallel.utils import VocabUtility


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Per-token cross entropy [s, b] of logits [s, b, V/T] split over the TP group.

    ``label_smoothing`` in [0, 1) over the full vocabulary (module docstring). ``tp_group``
    (an addition to megatron-core's signature; default: MPU fallback) is the group the
    vocabulary is split over.
    """
    check_cross_entropy_args(
        "vocab_parallel_cross_entropy", vocab_parallel_logits, target, label_smoothing
    )
    group = resolve_group("tp", tp_group)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, group)


def check_cross_entropy_args(
    caller: str, logits: torch.Tensor, target: torch.Tensor, label_smoothing: float
) -> None:
    """ValueError naming ``caller`` unless ``label_smoothing`` is in [0, 1) and ``target`` has
    the logits' shape without the vocabulary dimension (shared by the fused variant)."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"{caller}: label_smoothing must be in [0, 1), got {label_smoothing!r}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{caller}: target must have the logits' shape without the vocabulary dimension, "
            f"{tuple(logits.shape[:-1])}; got {tuple(target.shape)}"
        )


def reduce_max_over_vocab(
    local_max: torch.Tensor, partition_vocab_size: int, group
) -> Tuple[torch.Tensor, int, int, int]:
    """For this rank's block of the vocabulary: (m = the MAX over ``group`` of the local
    maxima, the block's [start, end), V = the whole vocabulary's size). One collective (none
    for one rank); shared by the fused variant."""
    world_size, rank = get_pg_size(group), get_pg_rank(group)
    if world_size > 1:
        local_max = all_reduce(local_max, group, dist.ReduceOp.MAX)
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
        partition_vocab_size, rank, world_size
    )
    return local_max, start, end, _smoothing_vocab_size(partition_vocab_size, world_size)


def smooth_loss(
    loss: torch.Tensor,
    sums: torch.Tensor,
    vocab_size: int,
    label_smoothing: float,
    caller: str,
) -> Tuple[torch.Tensor, float]:
    """(loss, s) with label smoothing eps = ``label_smoothing`` > 0 over V = ``vocab_size``
    (module docstring): s = eps V / (V - 1) and

        loss = (1 - s) loss - s (sums[2] / V - log sums[0]),

    ``sums`` being the group's [S, z_t - m, sum_j (z_j - m)]; (loss, 0.0) without smoothing.
    A ValueError naming ``caller`` when V < 2. Shared by the fused variant."""
    if label_smoothing <= 0:
        return loss, 0.0
    if vocab_size < 2:
        raise ValueError(
            f"{caller}: label smoothing needs a vocabulary of at least 2 entries, got "
            f"{vocab_size}"
        )
    smoothing = label_smoothing * vocab_size / (vocab_size - 1)
    mean_log_probs = sums[2] / vocab_size - sums[0].log()
    return (1.0 - smoothing) * loss - smoothing * mean_log_probs, smoothing


class VocabParallelCrossEntropy:
    """The steps of the vocab-parallel cross entropy (megatron-core's names), each local to
    one rank; the all-reduces between them are the caller's. No input is modified."""

    @staticmethod
    def calculate_logits_max(
        vocab_parallel_logits: torch.Tensor,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(logits in float32 (float64 kept), the local max over the vocabulary)."""
        logits = vocab_parallel_logits.to(_compute_dtype(vocab_parallel_logits.dtype))
        return logits, logits.max(dim=-1)[0]

    @staticmethod
    def calculate_predicted_logits(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        logits_max: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(target_mask: target outside this partition, masked_target_1d: local target index
        (0 when outside), predicted_logits: z_t - m (0 when outside), sum_exp_logits: local sum
        of exp(z - m), exp_logits: exp(z - m))."""
        shifted = vocab_parallel_logits - logits_max.unsqueeze(-1)
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = (target - vocab_start_index).masked_fill(target_mask, 0)
        masked_target_1d = masked_target.reshape(-1)
        predicted = shifted.gather(-1, masked_target.unsqueeze(-1)).squeeze(-1)
        predicted_logits = predicted.masked_fill(target_mask, 0.0)
        exp_logits = shifted.exp()
        return target_mask, masked_target_1d, predicted_logits, exp_logits.sum(-1), exp_logits

    @staticmethod
    def calculate_cross_entropy_loss(
        exp_logits: torch.Tensor, predicted_logits: torch.Tensor, sum_exp_logits: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(softmax = exp_logits / S, loss = log S - predicted) for the global S."""
        loss = sum_exp_logits.log() - predicted_logits
        return exp_logits / sum_exp_logits.unsqueeze(-1), loss

    @staticmethod
    def prepare_gradient_calculation_operands(
        softmax: torch.Tensor, target_mask: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(grad_2d [tokens, V/T] view of a copy of softmax, arange over tokens, 1 where the
        target is in this partition else 0, the copy itself)."""
        grad_input = softmax.clone()
        grad_2d = grad_input.view(-1, grad_input.shape[-1])
        arange_1d = torch.arange(grad_2d.shape[0], device=grad_2d.device)
        softmax_update = 1.0 - target_mask.reshape(-1).to(grad_2d.dtype)
        return grad_2d, arange_1d, softmax_update, grad_input

    @staticmethod
    def calculate_gradients(
        grad_2d: torch.Tensor,
        arange_1d: torch.Tensor,
        masked_target_1d: torch.Tensor,
        softmax_update: torch.Tensor,
        grad_input: torch.Tensor,
        grad_output: torch.Tensor,
    ) -> torch.Tensor:
        """(p - onehot(t)) * dL/dloss, written into ``grad_input`` (the copy made above)."""
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        grad_input.mul_(grad_output.unsqueeze(-1))
        return grad_input


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Autograd of the vocab-parallel cross entropy (module docstring for the math)."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0, group=None):
        """Per-token loss; saves the local softmax for the backward."""
        steps = VocabParallelCrossEntropy
        logits, logits_max = steps.calculate_logits_max(vocab_parallel_logits)
        logits_max, start, end, vocab_size = reduce_max_over_vocab(
            logits_max, logits.shape[-1], group
        )
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = (
            steps.calculate_predicted_logits(logits, target, logits_max, start, end)
        )
        # One SUM all-reduce for the per-token sums over the vocabulary (with smoothing also
        # the sum of the shifted logits).
        parts = [sum_exp, predicted]
        if label_smoothing > 0:
            parts.append((logits - logits_max.unsqueeze(-1)).sum(-1))
        sums = torch.stack(parts)
        if get_pg_size(group) > 1:
            sums = all_reduce(sums, group)
        sum_exp, predicted = sums[0], sums[1]
        softmax, loss = steps.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        loss, smoothing = smooth_loss(
            loss, sums, vocab_size, label_smoothing, "vocab_parallel_cross_entropy"
        )
        ctx.smoothing, ctx.vocab_size = smoothing, vocab_size
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        """dL/dz_j = (p_j - (1 - s) [j = t] - s / V) dL/dloss."""
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        steps = VocabParallelCrossEntropy
        grad_2d, arange_1d, softmax_update, grad_input = (
            steps.prepare_gradient_calculation_operands(softmax, target_mask)
        )
        if ctx.smoothing > 0:
            grad_2d[arange_1d, masked_target_1d] -= (1.0 - ctx.smoothing) * softmax_update
            grad_2d -= ctx.smoothing / ctx.vocab_size
            grad_input.mul_(grad_output.unsqueeze(-1))
        else:
            grad_input = steps.calculate_gradients(
                grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output
            )
        return grad_input, None, None, None


def _smoothing_vocab_size(partition_vocab_size: int, world_size: int) -> int:
    """The vocabulary size label smoothing spreads over: the WHOLE vocabulary."""
    return partition_vocab_size * world_size


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 logits."""
    return torch.float64 if dtype == torch.float64 else torch.float32
