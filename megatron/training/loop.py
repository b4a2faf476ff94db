"""The training loop: one ``step`` per iteration, then the after-step hooks.

``run_loop(run)`` trains iterations ``run.start_iteration + 1`` .. ``--train-iters`` of a
built ``Run`` (``training.train`` builds it: data, model, optimizer, the checkpoint it resumes
from). ``step`` is one iteration: zero the gradient buffers, run the layout's schedule over
this replica's M microbatches (this CP rank's shard of each), step Adam and the learning-rate
schedule; it returns the iteration's record, whose loss is

    loss = sum of masked token losses / number of valid tokens, over the global batch,

reduced over dp x cp on the last pipeline stage and broadcast over the pipeline group; it
does not depend on the layout. The gradient trains the SPEC section 4 objective: the mean
over the global batch's microbatches of S / max(N, 1), or sum S / sum N with
``--calculate-per-token-loss``.

Then each of ``AFTER_STEP_HOOKS``, in order, gets ``(run, record)``: validate
(``--eval-interval``: adds the validation fields to the record), log (the progress bar and the
metric sinks, ``loggers.SINKS``), save and export (``--save-interval``, ``--export-hf``), exit
(``--exit-*``: every rank agrees to save and stop; ``run.exits.stopped`` ends the loop).
Tests patch the step's parts where the loop looks them up (``loop.logged_loss``).
"""

import functools
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from tqdm import tqdm

from megatron.core.communication import broadcast_from_last_, broadcast_object, world_group
from megatron.core.context_parallel import (
    get_batch_on_this_cp_rank,
    get_thd_batch_on_this_cp_rank,
)
from megatron.core.device import comm_device
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.loss_reporting import reduce_reported_losses
from megatron.core.process_groups_config import ProcessGroupCollection, get_pg_rank, get_pg_size
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron.training.arguments import Layout, TrainingConfig
from megatron.training.checkpoint_layout import checkpoint_dir, layout_record, settings_record
from megatron.training.checkpoint_save import save_checkpoint
from megatron.training.data import microbatches_for_rank
from megatron.training.dpo import batch_positions, dpo_line, microbatch_rows, row_length
from megatron.training.dpo_reference import REFERENCE_SOURCE_KEY
from megatron.training.errors import TrainingStopped
from megatron.training.evaluation import Validation, ValidationSet, evaluate, evaluation_due
from megatron.training.exits import ExitConditions, exit_message
from megatron.training.hf.checkpoint import export_hf
from megatron.training.initialize import is_rank_zero, print_rank_0
from megatron.training.loggers import MetricSinks
from megatron.training.preference_data import packed_row

LOSS_KEY = "lm loss"


@dataclass
class Run:
    """One training run as the loop sees it (built by ``training.train``); the loop fills
    ``records``, ``skipped`` (iterations whose update the optimizer skipped: an fp16
    overflow), ``last_validation`` and ``upcoming`` (the next iteration's batch, made while the
    device finishes a step)."""

    config: TrainingConfig
    layout: Layout
    pg_collection: Optional[ProcessGroupCollection]
    model: List[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    dataset: Any  # None with --skip-train
    validation_set: Optional[ValidationSet]
    sinks: MetricSinks
    exits: Optional[ExitConditions] = None
    desc: str = "train"
    start_iteration: int = 0
    lora_base: Optional[Dict[str, str]] = None
    records: List[dict] = field(default_factory=list)
    skipped: int = 0
    last_validation: Optional[float] = None
    upcoming: Optional[Tuple[dict, List[dict]]] = None
    bar: Any = None
    dpo: Any = None  # --dpo: dpo.PreferenceTraining (the reference pass, objective, metrics)

    @property
    def microbatch_rows(self) -> int:
        """Rows of a micro-batch: --micro-batch-size, twice that for preference pairs
        (chosen, rejected), one row of packed pairs."""
        if self.dpo is not None:
            return microbatch_rows(self.config)
        return self.config.micro_batch_size

    @property
    def row_length(self) -> int:
        """Positions of a row: ``--seq-length``; a row of packed pairs, its longest."""
        return row_length(self.config) if self.dpo is not None else self.config.seq_length

    @property
    def scaled(self) -> bool:
        """Whether the loss is scaled (``--fp16`` or ``--loss-scale``)."""
        return bool(self.config.fp16 or self.config.loss_scale is not None)

    @functools.cached_property
    def forward_backward_func(self) -> Callable:
        """The layout's schedule."""
        layout = self.layout
        return get_forward_backward_func(
            layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size
        )

    @property
    def stopped(self) -> bool:
        """Whether an exit condition stopped the run (``exit_if_agreed``)."""
        return self.exits is not None and bool(self.exits.stopped)


def run_loop(run: Run) -> List[dict]:
    """Train ``run`` to ``--train-iters`` (or until an exit condition stops it); returns its
    records (see ``training.train``). ``--skip-train``: one record, the validation pass at
    the loaded iteration. ``--export-hf``: the last iteration's model is exported at the end."""
    config = run.config
    run.bar = tqdm(
        total=config.train_iters,
        desc=run.desc,
        unit="it",
        disable=not (config.progress and is_rank_zero()) or config.skip_train,
        dynamic_ncols=True,
    )
    if run.start_iteration:
        run.bar.update(run.start_iteration)
    if config.skip_train:
        run.bar.close()
        record = {"iteration": run.start_iteration, **(validate(run, run.start_iteration) or {})}
        run.sinks.log(record)
        return [record]
    if run.start_iteration < config.train_iters:
        run.upcoming = batch_of(run, run.start_iteration + 1)
    for iteration in range(run.start_iteration + 1, config.train_iters + 1):
        record = step(run, iteration)
        run.records.append(record)
        for hook in AFTER_STEP_HOOKS:
            hook(run, record)
        if run.stopped:
            break
    run.bar.close()
    if config.export_hf and run.records and not run.stopped:
        export_final_model(run, run.records[-1]["iteration"])
    return run.records


def step(run: Run, iteration: int) -> Dict[str, Any]:
    """One iteration: the schedule's forward and backward over this rank's microbatches of
    the global batch, Adam and the learning-rate schedule; returns the iteration's record.
    With ``--check-for-nan-in-loss-and-grad`` (the default) a NaN/inf loss or gradient norm
    stops the run (``check_step``)."""
    config, layout, model = run.config, run.layout, run.model
    start = time.perf_counter()
    global_batch, microbatches = run.upcoming
    for chunk in model:
        chunk.zero_grad_buffer()
    MTPLossLoggingHelper.clean_loss_in_tracker()  # the step's MTP losses only
    per_shard = layout.context_parallel_size if config.per_shard_loss_normalization else None
    vpp = layout.virtual_pipeline_model_parallel_size
    forward_step_func = functools.partial(forward_step, per_shard_cp_size=per_shard)
    if run.dpo is not None:  # after the reference pass over these microbatches
        forward_step_func = run.dpo.forward_step_func(global_batch, microbatches)
    reported = run.forward_backward_func(
        forward_step_func=forward_step_func,
        data_iterator=[iter(microbatches) for _ in model] if vpp else iter(microbatches),
        model=model if vpp else model[0],
        num_microbatches=layout.num_microbatches,
        seq_length=run.row_length,
        micro_batch_size=run.microbatch_rows,
        pg_collection=run.pg_collection,
        forward_only=False,
    )
    scheduler = run.scheduler
    if scheduler.num_steps != iteration - 1:  # e.g. resumed from a checkpoint
        scheduler.step(increment=iteration - 1 - scheduler.num_steps)
    lr = run.optimizer.param_groups[0]["lr"]
    updated, grad_norm, num_zeros = run.optimizer.step()
    scheduler.step(increment=1)
    # The next batch is made while the device finishes this step (the logged loss waits).
    run.upcoming = batch_of(run, iteration + 1) if iteration < config.train_iters else None
    if run.dpo is None:
        loss, preference = logged_loss(reported, run.pg_collection), {}
    else:
        loss, preference = run.dpo.logged(reported)
    run.skipped += 0 if updated else 1
    if config.check_for_nan_in_loss_and_grad:
        check_step(iteration, loss, grad_norm)
    seconds = time.perf_counter() - start
    data_tokens = _data_tokens(run, global_batch, iteration)
    return {
        "iteration": iteration,
        "loss": loss,
        **preference,
        "grad_norm": grad_norm,
        **({"num_zeros_in_grad": num_zeros} if config.log_num_zeros_in_grad else {}),
        "lr": lr,
        "tokens_per_s": data_tokens / seconds,
        "valid_tokens": int(global_batch["loss_mask"].sum().item()),
        "data_tokens": data_tokens,
        "padding_tokens": _positions(run, global_batch) - data_tokens,
        "iteration_time_s": seconds,
        "skipped_iterations": run.skipped,
        "loss_scale": run.optimizer.get_loss_scale().item() if run.scaled else None,
        **_memory_record(),
        **_moe_record(config, layout, run.pg_collection),
        **mtp_record(config, layout, run.pg_collection),
    }


# ----------------------------------------------------------------------------- after-step hooks


def validate_after_step(run: Run, record: Dict[str, Any]) -> None:
    """``--eval-interval``: the validation pass when due, its fields added to ``record``."""
    if run.validation_set is not None and evaluation_due(run.config, record["iteration"]):
        record.update(validate(run, record["iteration"]) or {})
    if "valid_loss" in record:
        run.last_validation = record["valid_loss"]


def log_step(run: Run, record: Dict[str, Any]) -> None:
    """The progress bar (loss, tokens/s, with loss scaling the skipped iterations, the last
    validation loss) and the run's metric sinks (metrics.jsonl, console, TensorBoard, W&B)."""
    postfix = dict(loss=f"{record['loss']:.4f}", tokens_per_s=f"{record['tokens_per_s']:.0f}")
    if run.scaled:
        postfix["skipped"] = run.skipped
    if run.last_validation is not None:
        postfix["valid_loss"] = f"{run.last_validation:.4f}"
    run.bar.set_postfix(**postfix)
    run.bar.update()
    run.sinks.log(record)


def save_after_step(run: Run, record: Dict[str, Any]) -> None:
    """``--save`` every ``--save-interval`` iterations and after the last one; with
    ``--export-hf`` an intermediate checkpoint is exported too (``DIR/iter_N``)."""
    config, iteration = run.config, record["iteration"]
    if config.save and save_due(config, iteration):
        save_at(run, iteration)
        if config.export_hf and iteration < config.train_iters:
            target = Path(config.export_hf) / f"iter_{iteration:07d}"
            export_hf(checkpoint_dir(config.save, iteration), target)
            print_rank_0(f"exported iteration {iteration} to {target} (HuggingFace format)")


def exit_if_agreed(run: Run, record: Dict[str, Any]) -> None:
    """Every rank agrees here whether to stop (a signal, the duration, the interval): then
    the iteration is saved (unless just saved) and ``run.exits.stopped`` says why."""
    iteration = record["iteration"]
    reason = run.exits.agreed(iteration) if run.exits is not None else None
    if reason is not None and iteration < run.config.train_iters:
        if not save_due(run.config, iteration):
            save_at(run, iteration)
        run.exits.stopped = reason
        run.bar.close()
        print_rank_0(exit_message(reason, iteration, run.config.save))


# What runs after each step, in order (each gets the run and the step's record).
AFTER_STEP_HOOKS: List[Callable[[Run, Dict[str, Any]], None]] = [
    validate_after_step,
    log_step,
    save_after_step,
    exit_if_agreed,
]


# ----------------------------------------------------------------------------- the step's parts


def microbatches_of(run: Run, global_batch: Dict[str, torch.Tensor]) -> List[Dict[str, Any]]:
    """This rank's microbatches of ``global_batch`` (this CP rank's shard, on the compute
    device); the padding mask only for a model with MoE layers."""
    config, groups = run.config, run.pg_collection
    if config.num_experts is None:
        global_batch = without_padding_mask(global_batch)
    dp_rank = 0 if groups is None else groups.dp.rank()
    microbatches = microbatches_for_rank(
        global_batch, run.microbatch_rows, run.layout.num_microbatches, dp_rank
    )
    if run.dpo is not None and config.pack_sequences:  # each row at its own length
        microbatches = [packed_row(microbatch) for microbatch in microbatches]
    return [_on_this_cp_rank(microbatch, groups) for microbatch in microbatches]


def _data_tokens(run: Run, global_batch: Dict[str, torch.Tensor], iteration: int) -> int:
    """The global batch's positions that hold data: counted from the batch in hand when it
    carries its padding mask (a preference set would otherwise build the batch again)."""
    if "padding_mask" in global_batch:
        return int((~global_batch["padding_mask"]).sum())
    return run.dataset.data_tokens(iteration - 1, run.config.global_batch_size)


def _positions(run: Run, global_batch: Dict[str, torch.Tensor]) -> int:
    """The positions of the global batch's rows (``padding_tokens`` = these - data)."""
    if run.dpo is not None:
        return batch_positions(run.config, global_batch)
    return run.config.global_batch_size * run.config.seq_length


def batch_of(run: Run, iteration: int) -> Tuple[Dict[str, torch.Tensor], List[Dict[str, Any]]]:
    """The global batch of ``iteration`` and this rank's microbatches of it."""
    global_batch = run.dataset.global_batch(iteration - 1, run.config.global_batch_size)
    return global_batch, microbatches_of(run, global_batch)


def validate(run: Run, iteration: int) -> Optional[dict]:
    """The validation pass after ``iteration`` (``evaluation.evaluate``): its record fields,
    printed on rank 0."""
    config, exits = run.config, run.exits
    stop_check = exits.stop_check if exits is not None and exits.active else None
    if run.dpo is not None:  # the preference objective and TRL's metrics (dpo.py)
        return _validate_preferences(run, iteration, stop_check)
    result = evaluate(
        run.model,
        run.validation_set,
        run.forward_backward_func,
        functools.partial(forward_step, per_shard_cp_size=None),
        functools.partial(microbatches_of, run),
        num_microbatches=run.layout.num_microbatches,
        seq_length=config.seq_length,
        micro_batch_size=config.micro_batch_size,
        pg_collection=run.pg_collection,
        interleaved=bool(run.layout.virtual_pipeline_model_parallel_size),
        loss_key=LOSS_KEY,
        stop_check=stop_check,
    )
    if result is None:
        return None
    if config.progress and is_rank_zero():
        run.bar.write(_validation_line(iteration, result))
    else:
        print_rank_0(_validation_line(iteration, result))
    return {"valid_loss": result.loss, "valid_ppl": result.ppl, "validation_tokens": result.tokens}


def _validate_preferences(run: Run, iteration: int, stop_check) -> Optional[dict]:
    """``--dpo``'s validation pass (``dpo.PreferenceTraining.validate``), printed on rank 0."""
    fields = run.dpo.validate(
        run.validation_set, functools.partial(microbatches_of, run), stop_check
    )
    if fields is not None:
        line = f"validation at iteration {iteration}: {dpo_line(fields)}"
        if run.config.progress and is_rank_zero():
            run.bar.write(line)
        else:
            print_rank_0(line)
    return fields


def forward_step(data_iterator, model, per_shard_cp_size: Optional[int] = None):
    """Run one microbatch through one chunk; the loss function gets the loss mask.

    A microbatch with a ``padding_mask`` (this CP rank's shard, True = padding; the trainer
    keeps it for MoE models only) hands it to the model on every pipeline stage: MoE
    layers leave padding out of their router losses and token counts. The chunk holding
    multi-token prediction depths also gets the ``loss_mask`` (their rolled masks).
    ``per_shard_cp_size``: see ``loss_func`` (None: the exact objective).
    """
    batch = next(data_iterator)
    extra = {}
    packed = batch.get("packed_seq_params")  # built once, by _on_this_cp_rank
    if packed is not None:
        extra["packed_seq_params"] = packed
    if batch.get("padding_mask") is not None:
        extra["padding_mask"] = batch["padding_mask"]
    if _has_mtp(model):  # multi-token prediction reads the loss mask
        extra["loss_mask"] = batch["loss_mask"]
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], **extra)
    return output, functools.partial(loss_func, batch["loss_mask"], per_shard_cp_size)


def _has_mtp(model) -> bool:
    """Whether the chunk (through its wrappers) holds multi-token prediction depths."""
    while model is not None:
        if getattr(model, "mtp_process", False):
            return True
        model = getattr(model, "module", None)
    return False


def loss_func(
    loss_mask: torch.Tensor, per_shard_cp_size: Optional[int], output_tensor: torch.Tensor
):
    """Three values (SPEC section 4) for this CP shard: S_c = sum(mask * loss_t),
    N_c = sum(mask), and ``{"lm loss": [S_c, N_c]}`` for the logged loss.

    With ``per_shard_cp_size`` = C it returns instead the legacy two values
    ``(S_c / max(N_c, 1) / C, reported)``: the schedule scales them by C / M and DDP
    averages over dp x cp, so the step trains megatron-core 0.16.1's per-shard objective
    mean_c S_c / N_c, which differs from S / N when masks are uneven across shards.
    """
    loss_sum = (output_tensor * loss_mask.to(output_tensor.dtype)).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    reported = {LOSS_KEY: [loss_sum.detach(), num_tokens]}
    if per_shard_cp_size is not None:
        return loss_sum / num_tokens.clamp(min=1) / per_shard_cp_size, reported
    return loss_sum, num_tokens, reported


def logged_loss(reported: List[dict], pg_collection: Optional[ProcessGroupCollection]) -> float:
    """Global sum(S) / sum(N) of the step: reduced over dp x cp on the last pipeline stage,
    then broadcast from it over the pipeline group (every rank returns the value)."""
    dp_cp = None if pg_collection is None else pg_collection.dp_cp
    losses = reduce_reported_losses(reported, dp_cp)
    value = torch.tensor(losses.get(LOSS_KEY, 0.0), dtype=torch.float64, device=comm_device())
    broadcast_from_last_(value, None if pg_collection is None else pg_collection.pp)
    return value.item()


def without_padding_mask(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``batch`` less its ``padding_mask``: a dense model reads no padding mask, so it is
    neither sharded nor copied to the device (a new dict; the input is not modified)."""
    return {key: value for key, value in batch.items() if key != "padding_mask"}


def _on_this_cp_rank(
    microbatch: Dict[str, torch.Tensor], pg_collection: Optional[ProcessGroupCollection]
) -> Dict[str, Any]:
    """This CP rank's shard (2C chunks, rank r keeps r and 2C-1-r; of every document for
    packed rows) of every per-token tensor (``padding_mask`` too, like the tokens) on the
    compute device; a packed row also gets its ``PackedSeqParams`` under
    ``"packed_seq_params"`` (built here, once per microbatch)."""
    device = comm_device()
    microbatch = {key: value.to(device) for key, value in microbatch.items()}
    cp = None if pg_collection is None else pg_collection.cp
    if "cu_seqlens" in microbatch:
        microbatch, params = get_thd_batch_on_this_cp_rank(
            microbatch,
            microbatch["cu_seqlens"][0],
            microbatch["cu_seqlens_padded"][0],
            microbatch["max_seqlen"][0],
            cp_size=get_pg_size(cp),
            cp_rank=get_pg_rank(cp),
        )
        microbatch["packed_seq_params"] = params
    elif pg_collection is not None:
        microbatch = get_batch_on_this_cp_rank(microbatch, cp)
    return microbatch


# A run whose last RECENT_STEPS iterations (or all of them, when fewer) were all skipped, or
# all had a NaN/inf loss, ends with an error: its weights stopped changing, or are garbage.
RECENT_STEPS = 10


def check_step(iteration: int, loss: float, grad_norm: Optional[float]) -> None:
    """``--check-for-nan-in-loss-and-grad`` (megatron's, on by default): stop at an iteration
    whose loss, or whose gradient norm after unscaling, is NaN or inf. A step the loss scaler
    skipped (``grad_norm`` None) is not an error. Every rank holds the same values, so every
    rank stops together."""
    if not math.isfinite(loss):
        raise TrainingStopped(
            f"iteration {iteration}: the loss is {loss}; stopped by "
            "--check-for-nan-in-loss-and-grad (on by default; "
            "--no-check-for-nan-in-loss-and-grad trains on)"
        )
    if grad_norm is not None and not math.isfinite(grad_norm):
        raise TrainingStopped(
            f"iteration {iteration}: the gradient norm is {grad_norm}; stopped by "
            "--check-for-nan-in-loss-and-grad (on by default; "
            "--no-check-for-nan-in-loss-and-grad trains on)"
        )


def check_recent_steps(records: List[dict]) -> None:
    """Raise ``TrainingStopped`` when the last ``RECENT_STEPS`` iterations of this run (all
    of them when fewer) all had a NaN/inf loss, or were all skipped by the optimizer (every
    fp16 gradient overflowed: no update was applied)."""
    recent = records[-RECENT_STEPS:]
    if not recent:
        return
    first, last = recent[0]["iteration"], recent[-1]["iteration"]
    what = f"iterations {first}-{last}" if len(recent) > 1 else f"iteration {last}"
    what += f" (the last {len(recent)} of this run)" if len(recent) > 1 else " (the last)"
    if all(not math.isfinite(r["loss"]) for r in recent):
        raise TrainingStopped(
            f"{what}: every loss was NaN or inf ({recent[-1]['loss']} at the end); the model "
            "is not training (--check-for-nan-in-loss-and-grad stops at the first one)"
        )
    before = records[-len(recent) - 1]["skipped_iterations"] if len(records) > len(recent) else 0
    if recent[-1]["skipped_iterations"] - before == len(recent):
        scale = recent[-1].get("loss_scale")
        raise TrainingStopped(
            f"{what}: every step was skipped, no update applied: the scaled fp16 gradients "
            f"overflowed (loss scale {scale}); lower --loss-scale, or --initial-loss-scale "
            "for dynamic scaling (--bf16 needs no loss scaling)"
        )


def _memory_record() -> Dict[str, int]:
    """The accelerator's memory counters (megatron's mem-* scalars); none on the CPU."""
    device = comm_device()
    if device.type != "cuda":
        return {}
    return {
        "mem_allocated_bytes": torch.cuda.memory_allocated(device),
        "mem_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "mem_reserved_bytes": torch.cuda.memory_reserved(device),
    }


def _moe_record(
    config: TrainingConfig, layout: Layout, pg_collection: Optional[ProcessGroupCollection]
) -> Dict[str, Any]:
    """The step's router losses (mean over the MoE layers of (1/(D M)) sum_m loss_m / c:
    megatron-core logs them without their coefficient c) and per-layer token loads (valid
    tokens per expert over the global batch): the same for every layout (collective: every
    rank calls it). The losses of ``logged_router_losses`` are always there (0 when not
    computed: a zero coefficient), as megatron's ``track_moe_metrics(force_initialize=True)``."""
    if config.num_experts is None:
        return {}
    metrics = moe_utils.reduced_moe_metrics(
        1.0 / layout.num_microbatches,
        config.num_layers,
        config.moe_layer_freq,
        pg_collection,
        mtp_num_layers=config.mtp_num_layers,
    )
    moe_utils.clear_aux_losses_tracker()
    record = {f"moe_{name}": 0.0 for name in logged_router_losses(config)}
    for name, values in metrics.items():
        if name == "tokens_per_expert":
            record["moe_tokens_per_expert"] = values.tolist()
        elif values.numel():
            record[f"moe_{name}"] = float(values.double().mean())
    return record


def mtp_record(
    config: TrainingConfig, layout: Layout, pg_collection: Optional[ProcessGroupCollection]
) -> Dict[str, float]:
    """The step's multi-token prediction losses, ``mtp_<k>_loss`` (megatron's "mtp_k loss":
    the mean over the microbatches and DP replicas of S_k / max(N_k, 1), N_k the whole
    sequence's count), the same on every rank (collective: broadcast from the last pipeline
    stage, which holds the MTP depths)."""
    if not config.mtp_num_layers:
        return {}
    losses: Dict[str, float] = {}
    MTPLossLoggingHelper.track_mtp_metrics(1.0 / layout.num_microbatches, 0, total_loss_dict=losses)
    names = [f"mtp_{k} loss" for k in range(1, config.mtp_num_layers + 1)]
    values = torch.tensor([losses.get(name, 0.0) for name in names], dtype=torch.float64)
    values = values.to(comm_device())
    broadcast_from_last_(values, None if pg_collection is None else pg_collection.pp)
    return {name.replace(" ", "_"): value for name, value in zip(names, values.tolist())}


def logged_router_losses(config: TrainingConfig) -> List[str]:
    """The router losses megatron's ``training_log`` tracks: load_balancing_loss when
    ``--moe-router-load-balancing-type`` contains "aux_loss" (seq_aux_loss does: megatron's
    test is on the name), seq_load_balancing_loss with seq_aux_loss, z_loss when
    ``--moe-z-loss-coeff`` is given."""
    balancing = config.moe_router_load_balancing_type
    names = [
        name
        for kind, name in (
            ("aux_loss", "load_balancing_loss"),
            ("seq_aux_loss", "seq_load_balancing_loss"),
        )
        if kind in balancing
    ]
    return names + (["z_loss"] if config.moe_z_loss_coeff is not None else [])


def _validation_line(iteration: int, result: Validation) -> str:
    """``validation at iteration 20: loss 1.2345, perplexity 3.437 (1234 tokens)``."""
    return (
        f"validation at iteration {iteration}: loss {result.loss:.4f}, perplexity "
        f"{result.ppl:.3f} ({result.tokens} tokens)"
    )


def save_due(config: TrainingConfig, iteration: int) -> bool:
    """Every ``--save-interval`` iterations, and after the last one."""
    interval = config.save_interval
    return iteration == config.train_iters or (interval is not None and iteration % interval == 0)


def run_settings(run: Run) -> Dict[str, Any]:
    """The settings its checkpoints record: the config's, and with ``--dpo`` the source of a
    reference that copies the starting weights (``dpo_reference``: a resume rebuilds it)."""
    record = settings_record(run.config)
    if run.dpo is not None and run.dpo.source is not None:
        record[REFERENCE_SOURCE_KEY] = dict(run.dpo.source)
    return record


def save_at(run: Run, iteration: int) -> None:
    """The checkpoint of ``iteration`` in ``--save`` (collective)."""
    config = run.config
    save_checkpoint(
        config.save,
        iteration,
        run.model,
        run.optimizer,
        run.scheduler,
        layout=layout_record(run.layout),
        consumed_samples=iteration * config.global_batch_size,
        run_settings=run_settings(run),
        trainable_only=config.save_trainable_params_only,
        lora_base=run.lora_base,
    )


def export_final_model(run: Run, iteration: int) -> None:
    """``--export-hf DIR``: the model after ``iteration`` in HuggingFace format, from the
    ``--save`` checkpoint of that iteration, else from a temporary one beside DIR."""
    config = run.config
    target = Path(config.export_hf)
    temporary = None
    merge = config.merge_lora
    if (
        config.save
        and save_due(config, iteration)
        and not (merge and config.save_trainable_params_only)  # merging needs the base too
    ):
        source = checkpoint_dir(config.save, iteration)
    else:
        shared = str(target.parent / f".{target.name}.checkpoint") if is_rank_zero() else None
        temporary = broadcast_object(shared, world_group())
        source = save_checkpoint(
            temporary,
            iteration,
            run.model,
            run.optimizer,
            run.scheduler,
            layout=layout_record(run.layout),
            run_settings=run_settings(run),
            lora_base=run.lora_base,
        )
    export_hf(source, target, merge_lora=merge)
    if temporary is not None and is_rank_zero():
        shutil.rmtree(temporary, ignore_errors=True)
    what = (
        "the LoRA adapter (PEFT format)"
        if config.lora_dim and not merge
        else "the merged model" if merge else "the model"
    )
    print_rank_0(f"exported {what} of iteration {iteration} to {target} (HuggingFace format)")
