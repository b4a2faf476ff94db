"""Preference optimization (DPO and its variants), exact at every layout.

A micro-batch holds whole pairs, rows interleaved: row 2i is pair i's chosen completion y_w,
row 2i + 1 its rejected one y_l (both after the same prompt). The model's per-token output is
the NLL -log p(label) (no label smoothing), ``loss_mask`` 1 on the completion's labels.

Definitions (TRL 1.16's; B = beta, E = label smoothing, A = SFT weight):

    logp(y | x) = sum over the completion's tokens of log p   (a SUM, never a mean)
    h = (logp_w - ref_w) - (logp_l - ref_l)
    sigmoid: -(1 - E) logsigmoid(B h) - E logsigmoid(-B h)
    hinge:   relu(1 - B h)
    ipo:     (h' - 1 / (2 B))^2, h' from per-token means (each sum over its token count)
    J = mean of the pair losses over the P pairs of the global batch
        + A * (NLL summed over every chosen-completion token of the global batch) / N_w

Layout-exactness: a CP rank sees a shard of each sequence, so it sums its shard's token
log-probs and ``sum_over_cp`` adds the shards (all-reduce forward, identity backward: every
CP rank then computes the same pair losses from the whole-sequence sums, and each one's
backward reaches its own tokens). The micro-batch loss is returned as the loss contract's
legacy two values (a full-sequence value): the schedule multiplies it by C / M and DDP
averages over the D * C ranks of dp_cp, so with G = D * M micro-batches the step trains
(1 / G) sum_g loss_g; ``preference_loss`` returns

    loss_g = (G / P) * sum of the pair losses of micro-batch g + A * G * S_g / N_w,

S_g its chosen-token NLL sum, P and N_w counted from the whole global batch before the step
(``PreferenceStep``). No count is taken per shard or per micro-batch.

Packed micro-batches (``--pack-sequences``, THD with ``PackedSeqParams``): one row holds the
micro-batch's sequences as documents, in the same interleaved order (document 2i pair i's
chosen side, 2i + 1 its rejected side), and a per-token ``sequence_index`` (the document
of each position, -1 on the row's tail) that the CP split shards like the tokens. The
per-sequence sums are then segment sums over ``sequence_index`` before the sum over CP; the
rest is unchanged.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.config_rules import DPO_LOSS_TYPES, DPO_METRIC_KEYS
from megatron.core.process_groups_config import get_pg_size
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

LOSS_TYPES = DPO_LOSS_TYPES
# the reported keys of the policy pass (each [sum, count]; see ``preference_metrics``)
METRIC_KEYS = DPO_METRIC_KEYS
PAIR_LOSS_KEY, SFT_KEY, REFERENCE_KEY = "dpo_pair_loss", "dpo_sft_nll", "reference_logps"


@dataclass(frozen=True)
class PreferenceObjective:
    """The objective's hyper-parameters (``--dpo-beta``, ``--dpo-loss-type``,
    ``--dpo-label-smoothing``, ``--dpo-sft-weight``)."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    sft_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type {self.loss_type!r}: expected one of {LOSS_TYPES}")
        if not self.beta > 0:
            raise ValueError(f"beta {self.beta}: expected > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing {self.label_smoothing}: expected in [0, 0.5)")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(
                f"label_smoothing {self.label_smoothing} with loss_type {self.loss_type!r}: "
                "label smoothing is defined for the sigmoid loss only"
            )
        if self.sft_weight < 0:
            raise ValueError(f"sft_weight {self.sft_weight}: expected >= 0")


@dataclass(frozen=True)
class PreferenceStep:
    """The global batch's counts, the same on every rank: ``pairs`` P, ``microbatches``
    G = D * M, ``chosen_tokens`` N_w (completion tokens of every chosen sequence)."""

    pairs: int
    microbatches: int
    chosen_tokens: int

    @classmethod
    def of_global_batch(
        cls,
        loss_mask: torch.Tensor,
        microbatches: int,
        sequence_index: Optional[torch.Tensor] = None,
    ) -> "PreferenceStep":
        """The counts of a global batch's interleaved [2P, s] loss mask (before any split);
        packed: its [R, t] rows and their ``sequence_index`` (module docstring)."""
        if sequence_index is not None:
            chosen = (sequence_index >= 0) & (sequence_index % 2 == 0)
            return cls(
                pairs=int((sequence_index.max(dim=-1).values + 1).sum().item()) // 2,
                microbatches=microbatches,
                chosen_tokens=int(loss_mask[chosen].sum().item()),
            )
        return cls(
            pairs=loss_mask.shape[0] // 2,
            microbatches=microbatches,
            chosen_tokens=int(loss_mask[0::2].sum().item()),
        )


def sum_over_cp(value: torch.Tensor, cp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The sum of ``value`` over the CP group (all-reduce forward, identity backward: the
    consumer is replicated on every CP rank); no collective for one rank."""
    if cp_group is None or get_pg_size(cp_group) == 1:
        return value
    return reduce_from_tensor_model_parallel_region(value, group=cp_group)


def sequence_log_probs(
    token_losses: torch.Tensor,
    loss_mask: torch.Tensor,
    cp_group: Optional[dist.ProcessGroup],
    sequence_index: Optional[torch.Tensor] = None,
    num_sequences: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(logp [n], token counts [n]) of each whole sequence of [n, s_c] per-token NLLs of this
    CP shard: the masked sums of -NLL, summed over the CP group (one collective; the
    counts carry no gradient). Packed: the ``num_sequences`` documents of this shard's
    [1, t_c] positions, by ``sequence_index`` (-1: no sequence)."""
    mask = loss_mask.to(token_losses.dtype)
    values = torch.stack([-(token_losses * mask), mask.detach()])
    if sequence_index is None:
        partial = values.sum(-1)
    else:
        index = sequence_index.reshape(-1)
        kept = index >= 0
        partial = values.new_zeros(2, num_sequences).index_add(
            1, index[kept], values.flatten(1)[:, kept]
        )
    total = sum_over_cp(partial, cp_group)
    return total[0], total[1].detach()


def packed_sequence_count(cu_seqlens_padded: torch.Tensor) -> int:
    """The documents of a packed row: the non-empty spans of its ``cu_seqlens_padded`` (the
    last offset repeated past the last document adds none)."""
    offsets = cu_seqlens_padded.reshape(-1)
    return int((offsets[1:] > offsets[:-1]).sum().item())


def pair_losses(
    objective: PreferenceObjective,
    logps: torch.Tensor,
    reference: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """Each pair's loss from interleaved per-sequence ``logps``, ``reference`` log-probs and
    token ``counts`` (the module docstring's definitions)."""
    ratios = logps - reference.to(logps.dtype)
    if objective.loss_type == "ipo":  # per-token means
        ratios = ratios / counts.clamp(min=1)
    h = ratios[0::2] - ratios[1::2]
    beta, eps = objective.beta, objective.label_smoothing
    if objective.loss_type == "sigmoid":
        return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    if objective.loss_type == "hinge":
        return torch.relu(1 - beta * h)
    return (h - 1 / (2 * beta)) ** 2


def preference_metrics(
    objective: PreferenceObjective, logps: torch.Tensor, reference: torch.Tensor
) -> Dict[str, List[torch.Tensor]]:
    """TRL's metrics as ``[sum, count]`` over this micro-batch's pairs (rewards from the
    summed log-probs for every loss type; accuracy strict)."""
    logps, reference = logps.detach(), reference.to(logps.dtype)
    rewards = objective.beta * (logps - reference)
    chosen, rejected = rewards[0::2], rewards[1::2]
    values = {
        "rewards_chosen": chosen,
        "rewards_rejected": rejected,
        "rewards_accuracies": (chosen > rejected).to(logps.dtype),
        "rewards_margins": chosen - rejected,
        "logps_chosen": logps[0::2],
        "logps_rejected": logps[1::2],
    }
    count = torch.tensor(float(chosen.numel()), dtype=logps.dtype, device=logps.device)
    return {key: [value.sum(), count] for key, value in values.items()}


def preference_loss(
    objective: PreferenceObjective,
    step: PreferenceStep,
    reference: torch.Tensor,
    loss_mask: torch.Tensor,
    cp_group: Optional[dist.ProcessGroup],
    output_tensor: torch.Tensor,
    sequence_index: Optional[torch.Tensor] = None,
):
    """The loss function of one micro-batch (bind the first five arguments, and for a
    packed row ``sequence_index``): the legacy
    two values ``(loss_g, reported)`` of the module docstring. ``reference``: the
    micro-batch's per-sequence reference log-probs [2b] (zeros: reference-free).
    ``reported`` holds ``[sum, count]`` pairs: the pair losses over pairs, the chosen NLL
    over N_w, and ``METRIC_KEYS``; every CP rank reports the same whole-sequence values, so
    a ratio over dp x cp is the global batch's (``reduce_reported_losses``)."""
    logps, counts = sequence_log_probs(
        output_tensor, loss_mask, cp_group, sequence_index, reference.numel()
    )
    losses = pair_losses(objective, logps, reference, counts)
    chosen_nll = -logps[0::2].sum()
    g, p = step.microbatches, max(step.pairs, 1)
    loss = losses.sum() * (g / p)
    if objective.sft_weight:
        loss = loss + chosen_nll * (objective.sft_weight * g / max(step.chosen_tokens, 1))
    dtype = logps.dtype
    reported = {
        PAIR_LOSS_KEY: [losses.detach().sum(), torch.tensor(float(losses.numel()), dtype=dtype)],
        SFT_KEY: [chosen_nll.detach(), counts[0::2].sum().to(dtype)],
        **preference_metrics(objective, logps, reference),
    }
    return loss, reported


def reference_log_probs_loss(
    loss_mask: torch.Tensor,
    cp_group: Optional[dist.ProcessGroup],
    output_tensor: torch.Tensor,
    sequence_index: Optional[torch.Tensor] = None,
    num_sequences: Optional[int] = None,
):
    """The loss function of the forward-only reference pass (bind the first two arguments;
    packed, ``sequence_index`` and ``num_sequences`` too): a zero loss and
    ``{"reference_logps": [logps]}``, the whole sequences' log-probs (a one-element list,
    so that loss reporting does not read it as a [sum, count] pair)."""
    logps, _ = sequence_log_probs(
        output_tensor.detach(), loss_mask, cp_group, sequence_index, num_sequences
    )
    return output_tensor.sum() * 0.0, {REFERENCE_KEY: [logps]}


def objective_value(
    totals: Dict[str, Tuple[float, float]], objective: PreferenceObjective
) -> float:
    """The step's J from ``reduce_reported_totals`` of the policy pass: the pair-loss mean
    plus A times the pooled chosen-token NLL (0 for an empty total)."""
    pair_sum, pairs = totals.get(PAIR_LOSS_KEY, (0.0, 0.0))
    nll, tokens = totals.get(SFT_KEY, (0.0, 0.0))
    value = pair_sum / pairs if pairs else 0.0
    if objective.sft_weight:
        value += objective.sft_weight * (nll / tokens if tokens else 0.0)
    return value
