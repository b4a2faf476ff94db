"""``--dpo``: preference training in the trainer (docs/dpo.md; the objective is
``megatron.core.preference``).

Each iteration, on the global batch of P pairs (2P interleaved rows, ``preference_data``):

1. the reference pass: the layout's schedule, forward only, in eval mode with the RNG states
   kept, over this rank's micro-batches, through the reference model: a frozen copy of the
   policy's starting weights (built once, after ``--load`` / ``--pretrained-checkpoint``;
   a resume rebuilds it from the source its checkpoints record, ``dpo_reference``), the
   policy itself with its LoRA adapters off (no second copy), ``--dpo-reference-hf-model``'s
   weights, or nothing with ``--dpo-reference-free`` (log-probs 0). The last pipeline stage
   keeps each micro-batch's whole-sequence reference log-probs (summed over CP);
2. the policy's forward-backward with ``preference_loss`` (the pair mean and the pooled SFT
   term over the global batch's counts, taken from the whole batch before the step);
3. the record: ``loss`` (the objective) and TRL's metrics, one ratio over the global batch,
   broadcast over the pipeline group.
"""

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.core.communication import broadcast_from_last_
from megatron.core.device import comm_device
from megatron.core.pipeline_parallel.loss_reporting import reduce_reported_totals
from megatron.core.preference import (
    METRIC_KEYS,
    REFERENCE_KEY,
    PreferenceObjective,
    PreferenceStep,
    objective_value,
    packed_sequence_count,
    preference_loss,
    reference_log_probs_loss,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe import moe_utils
from megatron.training.arguments import Layout, TrainingConfig
from megatron.training.dpo_reference import FINETUNE, HF_MODEL, describe_source
from megatron.training.evaluation import (
    WHOLE_SET,
    _eval_mode,
    _preserved_rng_states,
    validation_enabled,
)
from megatron.training.model import build_model
from megatron.training.preference_data import (
    build_preference_dataset,
    packed_preference_dataset,
    packing_multiples,
    stack_rows,
)
from megatron.training.preflight import check_reference_architecture

ROWS_PER_PAIR = 2


def microbatch_rows(config: TrainingConfig) -> int:
    """Rows of a micro-batch: its pairs' two rows each, or one row of its packed pairs
    (``--pack-sequences``: ``preference_data.PackedPreferenceDataset``)."""
    return 1 if config.pack_sequences else ROWS_PER_PAIR * config.micro_batch_size


def row_length(config: TrainingConfig) -> int:
    """Positions of a row: ``--seq-length``; packed, the longest a row can be (a pipeline
    message's nominal length: packed rows travel with ``variable_seq_lengths``)."""
    if not config.pack_sequences:
        return config.seq_length
    document, row = packing_multiples(config)
    longest = ROWS_PER_PAIR * config.micro_batch_size * -(-config.seq_length // document) * document
    return longest + -longest % row


def batch_positions(config: TrainingConfig, global_batch: Dict[str, torch.Tensor]) -> int:
    """The positions of a global batch's rows (packed: each row's own length)."""
    if config.pack_sequences:
        return int(global_batch["cu_seqlens_padded"][:, -1].sum())
    return int(global_batch["tokens"].numel())


class PreferenceTraining:
    """The DPO parts of the training loop for one run (module docstring)."""

    def __init__(
        self,
        config: TrainingConfig,
        layout: Layout,
        pg_collection: Optional[ProcessGroupCollection],
        model: List[torch.nn.Module],
        forward_backward_func,
        source: Optional[dict] = None,
        resumed: bool = False,
    ) -> None:
        """``source``: where the starting weights came from (``dpo_reference``; recorded in
        the run's checkpoints); ``resumed``: the policy holds a resumed checkpoint's weights,
        so the reference is rebuilt from ``source`` instead of copied from the policy."""
        self.config, self.layout, self.pg = config, layout, pg_collection
        self.source = source
        self.model, self.schedule = model, forward_backward_func
        self.objective = PreferenceObjective(
            beta=config.dpo_beta,
            loss_type=config.dpo_loss_type,
            label_smoothing=config.dpo_label_smoothing,
            sft_weight=config.dpo_sft_weight,
        )
        self.cp = None if pg_collection is None else pg_collection.cp
        rebuild = source if resumed else None
        with _preserved_rng_states():  # a resumed run's restored RNG states stay as loaded
            self.reference = build_reference(config, layout, pg_collection, model, rebuild)

    def describe(self) -> str:
        """``DPO: sigmoid loss, beta 0.1, ...; reference: ...; micro-batches of 2 pairs``."""
        o = self.objective
        reference = (
            "none (--dpo-reference-free)"
            if self.reference is None
            else (
                "the base with its LoRA adapters off"
                if self.reference == "adapters off"
                else self.config.dpo_reference_hf_model or "a frozen copy of the starting weights"
            )
        )
        if self.source is not None:
            reference += f" ({describe_source(self.source)})"
        extras = f", label smoothing {o.label_smoothing}" if o.label_smoothing else ""
        extras += f", SFT weight {o.sft_weight}" if o.sft_weight else ""
        m = self.config.micro_batch_size
        batches = (
            f"micro-batches of {m} pairs ({microbatch_rows(self.config)} row(s)"
            f"{', packed' if self.config.pack_sequences else ''}), global batch "
            f"{self.config.global_batch_size} pairs"
        )
        return f"DPO: {o.loss_type} loss, beta {o.beta}{extras}; reference: {reference}; {batches}"

    def forward_step_func(self, global_batch: Dict[str, torch.Tensor], microbatches: List[dict]):
        """The policy's forward step for this global batch, after the reference pass has
        given every micro-batch of this rank its ``reference_logps`` (last stage)."""
        for microbatch, logps in zip(microbatches, self._reference_log_probs(microbatches)):
            microbatch["reference_logps"] = logps
        step = PreferenceStep.of_global_batch(
            global_batch["loss_mask"],
            self.layout.num_microbatches * self.layout.data_parallel_size,
            sequence_index=global_batch.get("sequence_index"),
        )
        return functools.partial(policy_forward_step, self.objective, step, self.cp)

    def _reference_log_probs(self, microbatches: List[dict]) -> Iterator[torch.Tensor]:
        if self.reference is None:  # --dpo-reference-free
            return (torch.zeros(_sequences(m), device=comm_device()) for m in microbatches)
        chunks = self.model if self.reference == "adapters off" else self.reference
        vpp = self.layout.virtual_pipeline_model_parallel_size
        with _preserved_rng_states(), _eval_mode(chunks), _adapters_off(chunks), torch.no_grad():
            store = self.schedule(
                forward_step_func=functools.partial(reference_forward_step, self.cp),
                data_iterator=[iter(microbatches) for _ in chunks] if vpp else iter(microbatches),
                model=chunks if vpp else chunks[0],
                num_microbatches=self.layout.num_microbatches,
                seq_length=row_length(self.config),
                micro_batch_size=microbatch_rows(self.config),
                pg_collection=self.pg,
                forward_only=True,
            )
        if self.config.num_experts is not None:  # the policy's router statistics only
            moe_utils.clear_aux_losses_tracker()
        return (reported[REFERENCE_KEY][0] for reported in store)

    def logged(self, reported: List[dict]) -> Tuple[float, Dict[str, float]]:
        """(the step's objective, TRL's metrics) over the global batch, on every rank:
        reduced over dp x cp on the last pipeline stage, broadcast over the pipeline group."""
        dp_cp = None if self.pg is None else self.pg.dp_cp
        totals = reduce_reported_totals(reported, dp_cp)
        values = [objective_value(totals, self.objective)]
        for key in METRIC_KEYS:
            total, count = totals.get(key, (0.0, 0.0))
            values.append(total / count if count else 0.0)
        value = torch.tensor(values, dtype=torch.float64, device=comm_device())
        broadcast_from_last_(value, None if self.pg is None else self.pg.pp)
        loss, *metrics = value.tolist()
        return loss, dict(zip(METRIC_KEYS, metrics))

    def validate(
        self,
        validation: "PreferenceValidation",
        microbatches_of: Callable[[dict], List[dict]],
        stop_check: Optional[Callable[[], bool]] = None,
    ) -> Optional[Dict[str, float]]:
        """One pass over the validation pairs, forward only (eval mode, RNG states kept):
        ``valid_loss`` (the objective over every pair of the pass: the pair mean, plus the
        SFT term pooled over every chosen token of the pass) and ``valid_<metric>`` for
        TRL's metrics; None when ``stop_check()`` stops it (called before each batch)."""
        reported: List[dict] = []
        vpp = self.layout.virtual_pipeline_model_parallel_size
        with _preserved_rng_states(), _eval_mode(self.model), torch.no_grad():
            for global_batch in validation.batches:
                if stop_check is not None and stop_check():
                    return None
                microbatches = microbatches_of(global_batch)
                reported += self.schedule(
                    forward_step_func=self.forward_step_func(global_batch, microbatches),
                    data_iterator=(
                        [iter(microbatches) for _ in self.model] if vpp else iter(microbatches)
                    ),
                    model=self.model if vpp else self.model[0],
                    num_microbatches=self.layout.num_microbatches,
                    seq_length=row_length(self.config),
                    micro_batch_size=microbatch_rows(self.config),
                    pg_collection=self.pg,
                    forward_only=True,
                )
        loss, metrics = self.logged(reported)
        return {"valid_loss": loss, **{f"valid_{k}": v for k, v in metrics.items()}}


@dataclass
class PreferenceValidation:
    """The fixed validation pass of ``--dpo``: whole global batches of pairs, in order."""

    batches: List[Dict[str, torch.Tensor]]
    num_pairs: int
    left_out: int
    source: str
    notes: List[str]

    def describe(self) -> str:
        """``validation: 8 pairs in 2 global batches of held-out generated pairs``."""
        text = (
            f"validation: {self.num_pairs} pairs in {len(self.batches)} global batch(es) of "
            f"{self.source}"
        )
        if self.left_out:
            text += f" ({self.left_out} pairs of a partial last batch left out)"
        return text


def build_preference_validation(config: TrainingConfig) -> Optional[PreferenceValidation]:
    """The validation pairs (None when validation is off): the records of
    ``--valid-data-path`` or of ``--split``'s validation part in file order, else held-out
    generated pairs; at most ``--eval-iters`` global batches, whole batches only (pairs
    that would only fill part of a last batch are left out, said in ``describe``)."""
    if not validation_enabled(config):
        return None
    gbs = config.global_batch_size
    dataset = build_preference_dataset(config, valid=True)
    available = len(dataset) if hasattr(dataset, "__len__") else math.inf
    wanted = math.inf if config.eval_iters == WHOLE_SET else config.eval_iters * gbs
    count = min(available, wanted)
    if count == math.inf:
        raise ValueError(
            "--eval-iters -1 needs a validation file (--valid-data-path or --split): the "
            "generated pairs are endless"
        )
    whole = int(count) // gbs * gbs
    if whole == 0:
        raise ValueError(
            f"validation: {int(count)} pairs, fewer than one global batch (--global-batch-size "
            f"{gbs} pairs); give more validation pairs"
        )
    if config.pack_sequences:  # --micro-batch-size pairs a row, as in training
        packer = packed_preference_dataset(dataset, config, whole)
        rows = [packer[i] for i in range(whole // config.micro_batch_size)]
        per_batch = gbs // config.micro_batch_size
        batches = [stack_rows(rows[i : i + per_batch]) for i in range(0, len(rows), per_batch)]
    else:
        rows = [side for i in range(whole) for side in dataset.pair_in_file_order(i)]
        batches = [
            {key: torch.stack([r[key] for r in rows[i : i + 2 * gbs]]) for key in rows[0]}
            for i in range(0, len(rows), 2 * gbs)
        ]
    source = getattr(dataset, "name", "held-out generated pairs")
    return PreferenceValidation(batches, whole, int(count) - whole, source, list(dataset.notes))


def build_reference(config, layout, pg_collection, model, rebuild: Optional[dict] = None):
    """None (``--dpo-reference-free``), ``"adapters off"`` (LoRA: the policy itself), or the
    reference chunks: ``--dpo-reference-hf-model``'s weights, the starting weights rebuilt
    from their recorded source ``rebuild`` (a resume: ``dpo_reference``), else a frozen copy
    of the policy's present (starting) weights; no DDP, no gradients."""
    if config.dpo_reference_free:
        return None
    if config.lora_dim is not None and not config.dpo_reference_hf_model:
        return "adapters off"
    source = config.dpo_reference_hf_model
    if source:
        check_reference_architecture(config)
    if rebuild is not None:
        return _rebuilt_reference(config, layout, pg_collection, rebuild)
    reference_config = dataclasses.replace(
        config,
        lora_dim=None,
        hf_adapter=None,
        hf_model=source or config.hf_model,
    )
    chunks = build_model(reference_config, layout, pg_collection, ddp=False)
    for chunk, policy in zip(chunks, model):
        if not source:
            chunk.load_state_dict(policy.module.state_dict())
    return _frozen(chunks)


def _rebuilt_reference(config, layout, pg_collection, source: dict) -> List[torch.nn.Module]:
    """The starting weights from their recorded ``source``: the seeded initialization,
    ``--hf-model``'s folder, or the ``--load --finetune`` checkpoint (weights only)."""
    from megatron.training.checkpoint_layout import layout_record
    from megatron.training.checkpointing import load_checkpoint

    hf_model = source["path"] if source["flag"] == HF_MODEL else None
    reference_config = dataclasses.replace(
        config, lora_dim=None, hf_adapter=None, hf_model=hf_model, seed=source["seed"]
    )
    chunks = build_model(reference_config, layout, pg_collection, ddp=False)
    if source["flag"] == FINETUNE:
        load_checkpoint(source["path"], chunks, None, layout_record(layout), finetune=True)
    return _frozen(chunks)


def _frozen(chunks: List[torch.nn.Module]) -> List[torch.nn.Module]:
    for chunk in chunks:
        for parameter in chunk.parameters():
            parameter.requires_grad_(False)
    return chunks


def _model_call(batch: dict, model) -> torch.Tensor:
    """The per-token NLLs of one micro-batch (the padding mask for MoE models, the
    ``packed_seq_params`` of a packed row)."""
    extra = {}
    for key in ("padding_mask", "packed_seq_params"):
        if batch.get(key) is not None:
            extra[key] = batch[key]
    return model(batch["tokens"], batch["position_ids"], labels=batch["labels"], **extra)


def _sequences(batch: dict) -> int:
    """The sequences of a micro-batch: its rows, or a packed row's documents."""
    if "cu_seqlens_padded" in batch:
        return packed_sequence_count(batch["cu_seqlens_padded"])
    return batch["tokens"].shape[0]


def _packing(batch: dict) -> dict:
    """A packed row's ``sequence_index`` for the loss functions (none unpacked)."""
    return {"sequence_index": batch["sequence_index"]} if "sequence_index" in batch else {}


def reference_forward_step(cp_group, data_iterator, model):
    """The reference pass's forward step: per-sequence log-probs, reported."""
    batch = next(data_iterator)
    output = _model_call(batch, model)
    packing = _packing(batch)
    if packing:
        packing["num_sequences"] = _sequences(batch)
    loss_func = functools.partial(reference_log_probs_loss, batch["loss_mask"], cp_group, **packing)
    return output, loss_func


def policy_forward_step(objective, step, cp_group, data_iterator, model):
    """The policy pass's forward step (``preference_loss``; the reference log-probs exist on
    the last pipeline stage, the only one that calls the loss function)."""
    batch = next(data_iterator)
    output = _model_call(batch, model)
    loss_func = functools.partial(
        preference_loss,
        objective,
        step,
        batch.get("reference_logps"),
        batch["loss_mask"],
        cp_group,
        **_packing(batch),
    )
    return output, loss_func


@contextlib.contextmanager
def _adapters_off(chunks: List[torch.nn.Module]):
    """Every LoRA adapter of ``chunks`` skipped for the block (its base layer's own forward
    restored, then the adapted one put back)."""
    swapped = []
    for chunk in chunks:
        for module in chunk.modules():
            adapted = module.__dict__.get("forward")  # lora.apply_lora's adapted forward
            if adapted is not None and hasattr(adapted, "base_forward"):
                module.forward = adapted.base_forward
                swapped.append((module, adapted))
    try:
        yield
    finally:
        for module, adapted in swapped:
            module.forward = adapted


def dpo_line(fields: Dict[str, float]) -> str:
    """``loss 0.6931, rewards_accuracies 0.5000, rewards_margins 0.0123`` of a validation
    record's fields."""
    shown = ("valid_loss", "valid_rewards_accuracies", "valid_rewards_margins")
    return ", ".join(f"{key[len('valid_'):]} {fields[key]:.4f}" for key in shown)
