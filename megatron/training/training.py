"""The main job: supervised fine-tuning of the small GPT under any CP/PP/VPP/DP layout.

``pretrain`` runs a whole job (groups, training, optional one-process comparison, metrics);
``train`` is the loop. Each iteration: zero the gradient buffers, run the layout's schedule
over this replica's M microbatches (this CP rank's shard of each), step Adam, and log

    loss = sum of masked token losses / number of valid tokens, over the global batch,

reduced over dp x cp on the last pipeline stage and broadcast over the pipeline group; it
does not depend on the layout. The gradient trains the SPEC section 4 objective: the mean
over the global batch's microbatches of S / max(N, 1), or sum S / sum N with
``--calculate-per-token-loss``.

Why one module of ~900 lines: it is one concern, the run of the job. ``pretrain`` and the
loop, and what only the loop uses: the optimizer it steps, the per-step checks, the records
and log lines it writes, the final export and the one-process comparison that ends a run.
Each is a short function the loop calls in order, and tests patch them where the loop looks
them up (``training.logged_loss``); the model, data, checkpoints, validation and settings
have their own modules.
"""

import dataclasses
import functools
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron.core import communication
from megatron.core.communication import (
    barrier,
    broadcast_,
    broadcast_from_last_,
    broadcast_object,
    world_group,
)
from megatron.core.context_parallel import (
    get_batch_on_this_cp_rank,
    get_thd_batch_on_this_cp_rank,
)
from megatron.core.device import comm_device, describe_device
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.loss_reporting import reduce_reported_losses
from megatron.core.process_groups_config import ProcessGroupCollection, get_pg_rank, get_pg_size
from megatron.core.transformer.moe import moe_utils
from megatron.training.arguments import (
    Layout,
    TrainingConfig,
    single_process_config,
    validate_config,
)
from megatron.training.checkpointing import (
    base_weights,
    checkpoint_dir,
    load_checkpoint,
    save_checkpoint,
)
from megatron.training.compare import (
    Comparison,
    compare_losses,
    format_comparison,
    sensitivity_tolerances,
)
from megatron.training.data import microbatches_for_rank
from megatron.training.datasets import build_sft_dataset, build_training_tokenizer
from megatron.training.dpo import (
    ROWS_PER_PAIR,
    PreferenceTraining,
    build_preference_validation,
    dpo_line,
)
from megatron.training.errors import TrainingStopped
from megatron.training.evaluation import (
    Validation,
    build_validation_set,
    evaluate,
    evaluation_due,
)
from megatron.training.exits import ExitConditions, exit_message
from megatron.training.hf.checkpoint import export_hf
from megatron.training.hf_settings import resolve_hf_model
from megatron.training.initialize import (
    initialize_distributed,
    initialize_model_parallel_groups,
    initialize_single_gpu,
    is_rank_zero,
    launched_world_size,
    single_process_groups,
    tear_down_distributed,
)
from megatron.training.loggers import MetricSinks, Ranks
from megatron.training.lora_base import lora_base_record
from megatron.training.metrics import save_metrics
from megatron.training.model import build_model, precision_dtype
from megatron.training.preference_data import build_preference_dataset

LOSS_KEY = "lm loss"


@dataclass
class TrainingResult:
    """What a job produced. ``records`` (one dict per iteration) exist on every rank;
    ``reference`` and ``comparison`` on rank 0 when compared; ``passed`` everywhere (not
    FAILed: an INCONCLUSIVE comparison, ``comparison.verdict``, has passed)."""

    layout: Layout
    records: List[dict]
    reference: Optional[List[dict]] = None
    comparison: Optional[Comparison] = None
    passed: bool = True
    metrics_files: List[Path] = field(default_factory=list)
    stopped: Optional[str] = None  # why the run stopped early (exits.ExitConditions)


def pretrain(config: TrainingConfig) -> TrainingResult:
    """Run the job on this process: one process without torchrun, else this rank's part.

    Validates the layout before any collective, starts torch.distributed when launched by
    torchrun (reusing an existing default group) or, without torchrun, a one-process nccl
    group when the backend means the GPU (``initialize_single_gpu``), trains, compares
    with the one-process run when asked (``--compare-single-process``), writes metrics on
    rank 0, and tears down the model-parallel state (and the default group if it created
    it).
    """
    world_size = launched_world_size()
    config = resolve_hf_model(config)
    layout = validate_config(config, world_size or 1)
    _check_processes_per_node(config.nproc_per_node, world_size)
    if world_size is None:
        created_group = initialize_single_gpu(config)
    else:
        created_group = initialize_distributed(config, layout)
    try:
        groups = initialize_model_parallel_groups(layout) if dist.is_initialized() else None
        label = f"{layout.name} ({_processes(layout.world_size)})"
        _print_header(config, layout)
        started = time.perf_counter()
        with ExitConditions(config) as exits:
            records = _as_the_last_rank_measured(
                train(config, layout, groups, desc=label, exits=exits)
            )
        result = TrainingResult(layout, records, stopped=exits.stopped)
        _print(_summary(records, layout, time.perf_counter() - started))
        if config.compare_single_process and exits.stopped:
            _print("--compare-single-process: not compared (the run stopped early)")
        elif config.compare_single_process:
            result.reference = train_single_process(config)
            tolerances, rule = comparison_tolerances(config, result.reference)
            if is_rank_zero():
                result.comparison = compare_losses(records, result.reference, tolerances, rule)
                _print(format_comparison(result.comparison, label, "1 process"))
            result.passed = _agree_on_rank_zero(  # INCONCLUSIVE is not a failure
                result.comparison is None or not result.comparison.failed
            )
        if config.save_metrics and is_rank_zero() and records:
            result.metrics_files = save_metrics(
                config.save_metrics, records, label, result.reference
            )
            _print(f"metrics written to {', '.join(str(p) for p in result.metrics_files)}")
        if not config.skip_train:  # an evaluation-only run has no training steps
            check_recent_steps(records)
        return result
    finally:
        tear_down_distributed(created_group)


def _check_processes_per_node(nproc_per_node: Optional[int], world_size: Optional[int]) -> None:
    """``--nproc-per-node`` must be the processes per node this run has: ``pretrain``
    runs in the processes that exist (it launches none; the command line does)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size or 1))
    if nproc_per_node is not None and nproc_per_node != local:
        raise ValueError(
            f"--nproc-per-node {nproc_per_node}, but this run has {_processes(local)} per "
            "node: pretrain() launches no processes; run python -m megatron.training "
            f"--nproc-per-node {nproc_per_node} (or torchrun), or leave it out"
        )


def train(
    config: TrainingConfig,
    layout: Layout,
    pg_collection: Optional[ProcessGroupCollection],
    desc: str = "train",
    perturbation: float = 0.0,
    exits: Optional[ExitConditions] = None,
) -> List[dict]:
    """``config.train_iters`` iterations on this rank's chunks; returns one record per
    iteration: ``iteration, loss, grad_norm, lr, tokens_per_s`` (tokens of the data, not
    padding), ``valid_tokens, data_tokens, padding_tokens, iteration_time_s,
    skipped_iterations`` (how many of this run's iterations so far the optimizer skipped:
    an fp16 overflow), ``loss_scale`` (None without loss scaling), and ``valid_loss,
    valid_ppl, validation_tokens`` after a validation pass.
    ``pg_collection=None``: one process without torch.distributed.

    Rank 0 shows a progress bar with the loss, tokens/s and, with loss scaling, the skipped
    iterations (``config.progress``); each record goes to the run's metric sinks as its
    iteration ends (``loggers.SINKS``: metrics.jsonl, the console, TensorBoard, W&B). With
    ``--check-for-nan-in-loss-and-grad`` (the default) a NaN/inf loss or gradient norm
    stops the run (``check_step``).
    ``perturbation`` > 0 scales every initial weight by ``1 + perturbation * u``, u uniform
    in [-1, 1] from a fixed generator (the comparison's sensitivity run).
    """
    sinks = MetricSinks(config, Ranks(first=is_rank_zero(), last=_is_last_rank()))
    try:
        return _train(config, layout, pg_collection, desc, perturbation, sinks, exits)
    finally:
        sinks.close()


def _train(
    config: TrainingConfig,
    layout: Layout,
    pg_collection: Optional[ProcessGroupCollection],
    desc: str,
    perturbation: float,
    sinks: MetricSinks,
    exits: Optional[ExitConditions] = None,
) -> List[dict]:
    """``train`` with its metric sinks (and the run's exit conditions, ``exits.py``)."""
    dataset, config = _training_data(config)
    rows = ROWS_PER_PAIR if config.dpo else 1  # rows of the data per sample (a pair: 2)
    build_validation = build_preference_validation if config.dpo else build_validation_set
    validation_set = build_validation(config)
    if validation_set is not None:
        _print(validation_set.describe())
        for note in validation_set.notes:  # truncation counts of the validation records
            _print(f"validation data: {note}")
    model = build_model(config, layout, pg_collection)
    _print(_parameters_line(*parameter_counts(model, pg_collection)))
    if perturbation:
        _perturb_weights(model, perturbation)
    # an entry left by another model of this process (the multi-rank run before
    # --compare-single-process's reference, an earlier run of the launch) is dropped
    moe_utils.reset_aux_losses_tracker()
    optimizer, scheduler = build_optimizer(config, model, pg_collection)
    scaled = config.fp16 or config.loss_scale is not None
    if scaled:  # the schedule scales the loss
        model[0].config.grad_scale_func = optimizer.scale_loss
    vpp = layout.virtual_pipeline_model_parallel_size
    forward_backward_func = get_forward_backward_func(layout.pipeline_model_parallel_size, vpp)
    dp_rank = 0 if pg_collection is None else pg_collection.dp.rank()
    tokens_per_iteration = config.global_batch_size * rows * config.seq_length
    per_shard = layout.context_parallel_size if config.per_shard_loss_normalization else None
    forward_step_func = functools.partial(forward_step, per_shard_cp_size=per_shard)
    bar = tqdm(
        total=config.train_iters,
        desc=desc,
        unit="it",
        disable=not (config.progress and is_rank_zero()) or config.skip_train,
        dynamic_ncols=True,
    )
    start_iteration = 0
    if config.pretrained_checkpoint:  # the frozen base of a LoRA run
        _, _, notes = load_checkpoint(
            config.pretrained_checkpoint,
            model,
            optimizer,
            layout=_layout_record(layout),
            run_settings=_settings_record(config),
            finetune=True,
        )
        for note in notes:
            _print(note.replace("--finetune: ", "--pretrained-checkpoint: "))
    if config.load:
        start_iteration, _, notes = load_checkpoint(
            config.load,
            model,
            optimizer,
            scheduler,
            layout=_layout_record(layout),
            save_dir=config.save,
            run_settings=_settings_record(config),
            ckpt_step=config.ckpt_step,
            finetune=config.finetune,
            load_optim=not config.no_load_optim,
            load_rng=not config.no_load_rng,
            train_iters=None if config.skip_train else config.train_iters,
            exit_on_missing_checkpoint=config.exit_on_missing_checkpoint,
            override_scheduler=config.override_opt_param_scheduler,
            use_checkpoint_scheduler=config.use_checkpoint_opt_param_scheduler,
            base_source=config.hf_model or config.pretrained_checkpoint,
            base_flag="--pretrained-checkpoint" if config.pretrained_checkpoint else "--hf-model",
        )
        for note in notes:
            _print(note)
        bar.update(start_iteration)
    records = []
    skipped = 0  # iterations of this run whose update the optimizer skipped
    dpo = None  # --dpo: the reference pass, the objective and its metrics (training/dpo.py)
    if config.dpo:
        dpo = PreferenceTraining(config, layout, pg_collection, model, forward_backward_func)
        _print(dpo.describe())

    def microbatches_of(global_batch):
        """This rank's microbatches of ``global_batch`` (this CP rank's shard, on the
        compute device); the padding mask only for a model with MoE layers."""
        if config.num_experts is None:
            global_batch = without_padding_mask(global_batch)
        return [
            _on_this_cp_rank(microbatch, pg_collection)
            for microbatch in microbatches_for_rank(
                global_batch, config.micro_batch_size * rows, layout.num_microbatches, dp_rank
            )
        ]

    def batch_of(iteration: int):
        """The global batch of ``iteration`` and this rank's microbatches of it."""
        global_batch = dataset.global_batch(iteration - 1, config.global_batch_size)
        return global_batch, microbatches_of(global_batch)

    def validate(iteration: int) -> Optional[dict]:
        """The validation pass after ``iteration`` (``evaluation.evaluate``): its record
        fields, printed on rank 0."""
        stop_check = exits.stop_check if exits is not None and exits.active else None
        if dpo is not None:  # the preference objective and TRL's metrics (dpo.py)
            fields = dpo.validate(validation_set, microbatches_of, stop_check)
            if fields is not None and config.progress and is_rank_zero():
                bar.write(f"validation at iteration {iteration}: {dpo_line(fields)}")
            elif fields is not None:
                _print(f"validation at iteration {iteration}: {dpo_line(fields)}")
            return fields
        result = evaluate(
            model,
            validation_set,
            forward_backward_func,
            functools.partial(forward_step, per_shard_cp_size=None),
            microbatches_of,
            num_microbatches=layout.num_microbatches,
            seq_length=config.seq_length,
            micro_batch_size=config.micro_batch_size,
            pg_collection=pg_collection,
            interleaved=bool(vpp),
            loss_key=LOSS_KEY,
            stop_check=stop_check,
        )
        if result is None:
            return None
        if config.progress and is_rank_zero():
            bar.write(_validation_line(iteration, result))
        else:
            _print(_validation_line(iteration, result))
        return {
            "valid_loss": result.loss,
            "valid_ppl": result.ppl,
            "validation_tokens": result.tokens,
        }

    lora_base = _lora_base(config)

    def save_at(iteration: int) -> None:
        save_checkpoint(
            config.save,
            iteration,
            model,
            optimizer,
            scheduler,
            layout=_layout_record(layout),
            consumed_samples=iteration * config.global_batch_size,
            run_settings=_settings_record(config),
            trainable_only=config.save_trainable_params_only,
            lora_base=lora_base,
        )

    if config.skip_train:
        bar.close()
        record = {"iteration": start_iteration, **(validate(start_iteration) or {})}
        sinks.log(record)
        return [record]

    upcoming = batch_of(start_iteration + 1) if start_iteration < config.train_iters else None
    last_validation = None
    for iteration in range(start_iteration + 1, config.train_iters + 1):
        start = time.perf_counter()
        global_batch, microbatches = upcoming
        for chunk in model:
            chunk.zero_grad_buffer()
        reported = forward_backward_func(
            forward_step_func=(
                forward_step_func
                if dpo is None
                else dpo.forward_step_func(global_batch, microbatches)
            ),
            data_iterator=[iter(microbatches) for _ in model] if vpp else iter(microbatches),
            model=model if vpp else model[0],
            num_microbatches=layout.num_microbatches,
            seq_length=config.seq_length,
            micro_batch_size=config.micro_batch_size * rows,
            pg_collection=pg_collection,
            forward_only=False,
        )
        if scheduler.num_steps != iteration - 1:  # e.g. resumed from a checkpoint
            scheduler.step(increment=iteration - 1 - scheduler.num_steps)
        lr = optimizer.param_groups[0]["lr"]
        updated, grad_norm, num_zeros = optimizer.step()
        scheduler.step(increment=1)
        # The next batch is made while the device finishes this step (the logged loss waits).
        upcoming = batch_of(iteration + 1) if iteration < config.train_iters else None
        if dpo is None:
            loss, preference = logged_loss(reported, pg_collection), {}
        else:
            loss, preference = dpo.logged(reported)
        skipped += 0 if updated else 1
        if config.check_for_nan_in_loss_and_grad:
            check_step(iteration, loss, grad_norm)
        seconds = time.perf_counter() - start
        data_tokens = dataset.data_tokens(iteration - 1, config.global_batch_size)
        records.append(
            {
                "iteration": iteration,
                "loss": loss,
                **preference,
                "grad_norm": grad_norm,
                **({"num_zeros_in_grad": num_zeros} if config.log_num_zeros_in_grad else {}),
                "lr": lr,
                "tokens_per_s": data_tokens / seconds,
                "valid_tokens": int(global_batch["loss_mask"].sum().item()),
                "data_tokens": data_tokens,
                "padding_tokens": tokens_per_iteration - data_tokens,
                "iteration_time_s": seconds,
                "skipped_iterations": skipped,
                "loss_scale": optimizer.get_loss_scale().item() if scaled else None,
                **_memory_record(),
                **_moe_record(config, layout, pg_collection),
            }
        )
        postfix = dict(loss=f"{loss:.4f}", tokens_per_s=f"{data_tokens / seconds:.0f}")
        if scaled:
            postfix["skipped"] = skipped
        if validation_set is not None and evaluation_due(config, iteration):
            records[-1].update(validate(iteration) or {})
        if "valid_loss" in records[-1]:
            last_validation = records[-1]["valid_loss"]
        if last_validation is not None:
            postfix["valid_loss"] = f"{last_validation:.4f}"
        bar.set_postfix(**postfix)
        bar.update()
        sinks.log(records[-1])  # metrics.jsonl, console, TensorBoard, W&B (loggers.SINKS)
        if config.save and _save_due(config, iteration):
            save_at(iteration)
            if config.export_hf and iteration < config.train_iters:
                target = Path(config.export_hf) / f"iter_{iteration:07d}"
                export_hf(checkpoint_dir(config.save, iteration), target)
                _print(f"exported iteration {iteration} to {target} (HuggingFace format)")
        # Every rank agrees here whether to stop (a signal, the duration, the interval).
        reason = exits.agreed(iteration) if exits is not None else None
        if reason is not None and iteration < config.train_iters:
            if not _save_due(config, iteration):
                save_at(iteration)
            exits.stopped = reason
            bar.close()
            _print(exit_message(reason, iteration, config.save))
            break
    bar.close()
    if config.export_hf and records and not (exits is not None and exits.stopped):
        _export_final_model(config, model, optimizer, scheduler, layout, records[-1]["iteration"])
    return records


def _training_data(config: TrainingConfig) -> Tuple[Any, TrainingConfig]:
    """The training data set (None with ``--skip-train``: nothing is trained, so no
    ``--data-path`` is read) and ``config`` with the model's vocabulary: the tokenizer's
    for data files, checked against ``--hf-model``'s (which may be padded)."""
    build = build_preference_dataset if config.dpo else build_sft_dataset
    dataset = None if config.skip_train else build(config)
    for note in getattr(dataset, "notes", []):  # truncation and empty-loss counts
        _print(note)
    if not (config.data_path or config.valid_data_path):  # generated data: its own ids
        return dataset, config
    vocab = (
        dataset.vocab_size
        if dataset is not None
        else build_training_tokenizer(config.tokenizer, config.eod_token).vocab_size
    )
    if not config.hf_model:
        return dataset, dataclasses.replace(config, vocab_size=vocab)
    if vocab > config.vocab_size:
        raise ValueError(
            f"--tokenizer {config.tokenizer}: {vocab} tokens, more than --hf-model "
            f"{config.hf_model}'s vocab_size {config.vocab_size}"
        )
    return dataset, config


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


def _export_final_model(config, model, optimizer, scheduler, layout, iteration: int) -> None:
    """``--export-hf DIR``: the model after ``iteration`` in HuggingFace format, from the
    ``--save`` checkpoint of that iteration, else from a temporary one beside DIR."""
    target = Path(config.export_hf)
    temporary = None
    merge = config.merge_lora
    if (
        config.save
        and _save_due(config, iteration)
        and not (merge and config.save_trainable_params_only)  # merging needs the base too
    ):
        source = checkpoint_dir(config.save, iteration)
    else:
        shared = str(target.parent / f".{target.name}.checkpoint") if is_rank_zero() else None
        temporary = broadcast_object(shared, world_group())
        source = save_checkpoint(
            temporary,
            iteration,
            model,
            optimizer,
            scheduler,
            layout=_layout_record(layout),
            run_settings=_settings_record(config),
            lora_base=_lora_base(config),
        )
    export_hf(source, target, merge_lora=merge)
    if temporary is not None and is_rank_zero():
        shutil.rmtree(temporary, ignore_errors=True)
    what = (
        "the LoRA adapter (PEFT format)"
        if config.lora_dim and not merge
        else "the merged model" if merge else "the model"
    )
    _print(f"exported {what} of iteration {iteration} to {target} (HuggingFace format)")


def _lora_base(config: TrainingConfig) -> Optional[Dict[str, str]]:
    """A LoRA run's frozen base as its checkpoints record it (``lora_base_record``)."""
    if config.lora_dim is None:
        return None
    if config.pretrained_checkpoint:
        path = config.pretrained_checkpoint
        return lora_base_record("--pretrained-checkpoint", path, base_weights(path))
    return lora_base_record("--hf-model", config.hf_model) if config.hf_model else None


def build_optimizer(
    config: TrainingConfig,
    model: List[torch.nn.Module],
    pg_collection: Optional[ProcessGroupCollection],
):
    """megatron-core's optimizer (AdamW, or SGD with ``--optimizer sgd``; clipping by the
    global gradient norm; fp32 main parameters and, with ``--fp16``, loss scaling for
    half-precision weights) and its learning-rate schedule: linear warm-up from 0 over
    ``--lr-warmup-iters``, then ``--lr-decay-style`` down to ``--min-lr`` at
    ``--train-iters``; constant weight decay (none on biases and 1-D parameters, as
    megatron)."""
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=config.optimizer,
            sgd_momentum=config.sgd_momentum,
            lr=config.lr,
            min_lr=config.min_lr,
            weight_decay=config.weight_decay,
            adam_beta1=config.adam_beta1,
            adam_beta2=config.adam_beta2,
            adam_eps=config.adam_eps,
            clip_grad=config.clip_grad,
            bf16=config.bf16,
            fp16=config.fp16,
            params_dtype=precision_dtype(config),
            loss_scale=config.loss_scale,
            initial_loss_scale=config.initial_loss_scale,
            min_loss_scale=config.min_loss_scale,
            loss_scale_window=config.loss_scale_window,
            hysteresis=config.hysteresis,
            use_distributed_optimizer=config.use_distributed_optimizer,
            overlap_param_gather=config.overlap_param_gather,
            log_num_zeros_in_grad=config.log_num_zeros_in_grad,
        ),
        model,
        pg_collection=pg_collection,
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if config.lr_warmup_iters else config.lr,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=config.lr_warmup_iters,
        lr_decay_steps=config.train_iters,
        lr_decay_style=config.lr_decay_style,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=config.train_iters,
        wd_incr_style="constant",
        # A resume has refused another schedule unless one of megatron's two flags says
        # which one wins (checkpointing.compare_optimizer_settings).
        use_checkpoint_opt_param_scheduler=not config.override_opt_param_scheduler,
        override_opt_param_scheduler=config.override_opt_param_scheduler,
    )
    return optimizer, scheduler


def _perturb_weights(model: List[torch.nn.Module], relative: float) -> None:
    """Scale each weight by ``1 + relative * u``, u uniform in [-1, 1] (fixed generator)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for chunk in model:
            for _, parameter in sorted(chunk.named_parameters()):
                noise = torch.rand(parameter.shape, generator=generator, dtype=torch.float64)
                factor = 1 + relative * (2 * noise - 1)
                parameter.mul_(factor.to(device=parameter.device, dtype=parameter.dtype))


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
        1.0 / layout.num_microbatches, config.num_layers, config.moe_layer_freq, pg_collection
    )
    moe_utils.clear_aux_losses_tracker()
    record = {f"moe_{name}": 0.0 for name in logged_router_losses(config)}
    for name, values in metrics.items():
        if name == "tokens_per_expert":
            record["moe_tokens_per_expert"] = values.tolist()
        elif values.numel():
            record[f"moe_{name}"] = float(values.double().mean())
    return record


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


def _save_due(config: TrainingConfig, iteration: int) -> bool:
    """Every ``--save-interval`` iterations, and after the last one."""
    interval = config.save_interval
    return iteration == config.train_iters or (interval is not None and iteration % interval == 0)


def _layout_record(layout: Layout) -> Dict[str, int]:
    """The layout as plain values (kept in checkpoints; decides whether RNG states apply)."""
    return {
        "world_size": layout.world_size,
        "tensor_model_parallel_size": getattr(layout, "tensor_model_parallel_size", 1),
        "context_parallel_size": layout.context_parallel_size,
        "pipeline_model_parallel_size": layout.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": layout.virtual_pipeline_model_parallel_size or 0,
    }


def _settings_record(config: TrainingConfig) -> Dict[str, object]:
    """The run's settings as plain values, lists of them as lists (for the record in the
    checkpoint); with ``--hf-model``, also its config.json text (``--export-hf`` writes it
    back)."""
    plain = (int, float, str, bool, type(None))
    record: Dict[str, object] = {}
    for name, value in vars(config).items():
        if isinstance(value, plain):
            record[name] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, plain) for v in value):
            record[name] = list(value)  # e.g. the LoRA targets, a --moe-layer-freq list
    if config.hf_model:
        record["hf_config"] = (Path(config.hf_model) / "config.json").read_text()
    return record


PRECISION_FIELDS = (
    "bf16",
    "fp16",
    "loss_scale",
    "initial_loss_scale",
    "min_loss_scale",
    "loss_scale_window",
    "hysteresis",
)
FP32_COMPARE_TOLERANCE = 1e-4
HALF_PRECISION_TOLERANCE_FACTOR = 3.0
SENSITIVITY_PERTURBATION = 1e-6
SENSITIVITY_FACTOR = 10.0


def comparison_tolerances(
    config: TrainingConfig, reference: Optional[List[dict]]
) -> Tuple[Optional[List[float]], str]:
    """The per-iteration tolerances of ``--compare-single-process`` and their rule, on
    rank 0 (None elsewhere); the rule of ``megatron.training.compare``:

    - ``--compare-tolerance T``: T everywhere;
    - fp32: ``max(1e-4, 10 * e_i)``, e_i the running largest |difference| between the
      one-process run and a second one whose initial weights are scaled by
      ``1 + 1e-6 * u`` (u uniform in [-1, 1], fixed): the run's own sensitivity to
      rounding-sized changes, which Adam amplifies over long runs;
    - bf16 / fp16: ``3 * max_i |one process half - one process fp32|`` everywhere: a
      layout's rounding and the one-process run's are independent, each about as large as
      that difference, so the two runs can differ by about twice it.

    The extra one-process run trains on rank 0 while the other ranks wait."""
    n = len(reference) if reference is not None else 0
    if config.compare_tolerance is not None:
        tolerance = config.compare_tolerance
        return [tolerance] * n, f"--compare-tolerance {tolerance:.2e} at every iteration"
    if not (config.bf16 or config.fp16):
        perturbed = train_single_process(config, perturbation=SENSITIVITY_PERTURBATION)
        if not is_rank_zero():
            return None, ""
        tolerances = sensitivity_tolerances(
            reference, perturbed, FP32_COMPARE_TOLERANCE, SENSITIVITY_FACTOR
        )
        return tolerances, (
            f"{FP32_COMPARE_TOLERANCE:.0e}, or {SENSITIVITY_FACTOR:g} x the one-process run's "
            "own sensitivity when larger (the running largest |difference| from a one-process "
            f"run with initial weights perturbed by {SENSITIVITY_PERTURBATION:.0e}, relative)"
        )
    defaults = TrainingConfig()
    fp32 = dataclasses.replace(
        config, **{name: getattr(defaults, name) for name in PRECISION_FIELDS}
    )
    fp32_records = train_single_process(fp32)
    if not is_rank_zero():
        return None, ""
    rounding = max(abs(a["loss"] - b["loss"]) for a, b in zip(reference, fp32_records))
    tolerance = HALF_PRECISION_TOLERANCE_FACTOR * rounding
    precision = "bf16" if config.bf16 else "fp16"
    return [tolerance] * n, (
        f"{tolerance:.2e} at every iteration = {HALF_PRECISION_TOLERANCE_FACTOR:g} x the "
        f"largest |one process {precision} - one process fp32| loss difference "
        f"({rounding:.2e})"
    )


def train_single_process(config: TrainingConfig, perturbation: float = 0.0) -> Optional[List[dict]]:
    """The same training on one process: here when there is no torch.distributed, else on
    global rank 0 with groups of its own while the other ranks wait. Returns the records
    on the process that trained, None elsewhere. ``perturbation``: see ``train``."""
    reference_config = single_process_config(config)
    layout = validate_config(reference_config, 1)
    groups = single_process_groups(rank=0)
    records = None
    if is_rank_zero():
        label = "1 process, perturbed" if perturbation else "1 process"
        records = train(reference_config, layout, groups, desc=label, perturbation=perturbation)
    barrier(world_group())
    return records


def forward_step(data_iterator, model, per_shard_cp_size: Optional[int] = None):
    """Run one microbatch through one chunk; the loss function gets the loss mask.

    A microbatch with a ``padding_mask`` (this CP rank's shard, True = padding; the trainer
    keeps it for MoE models only) hands it to the model on every pipeline stage: MoE
    layers leave padding out of their router losses and token counts.
    ``per_shard_cp_size``: see ``loss_func`` (None: the exact objective).
    """
    batch = next(data_iterator)
    extra = {}
    packed = batch.get("packed_seq_params")  # built once, by _on_this_cp_rank
    if packed is not None:
        extra["packed_seq_params"] = packed
    if batch.get("padding_mask") is not None:
        extra["padding_mask"] = batch["padding_mask"]
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], **extra)
    return output, functools.partial(loss_func, batch["loss_mask"], per_shard_cp_size)


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


# Record fields each rank measures for itself (the rest is the same on every rank).
MEASURED_FIELDS = (
    "iteration_time_s",
    "tokens_per_s",
    "mem_allocated_bytes",
    "mem_max_allocated_bytes",
    "mem_reserved_bytes",
)


def _as_the_last_rank_measured(records: List[dict]) -> List[dict]:
    """The records with the last rank's timings and memory (what it logged to TensorBoard /
    W&B), so that metrics.jsonl, written on rank 0, holds the same values: one broadcast
    after training."""
    world = world_group()
    if get_pg_size(world) == 1:
        return records
    measured = [{k: r[k] for k in MEASURED_FIELDS if k in r} for r in records]
    measured = broadcast_object(measured, world, src=get_pg_size(world) - 1)
    return [{**r, **m} for r, m in zip(records, measured)]


def _is_last_rank() -> bool:
    """The last global rank (it holds the last pipeline stage): the one metrics writer."""
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


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


def _validation_line(iteration: int, result: Validation) -> str:
    """``validation at iteration 20: loss 1.2345, perplexity 3.437 (1234 tokens)``."""
    return (
        f"validation at iteration {iteration}: loss {result.loss:.4f}, perplexity "
        f"{result.ppl:.3f} ({result.tokens} tokens)"
    )


def _agree_on_rank_zero(passed: bool) -> bool:
    """Rank 0's verdict, on every rank."""
    flag = torch.tensor([1 if passed else 0], device=comm_device())
    return bool(broadcast_(flag, world_group()).item())


def _summary(records: List[dict], layout: Layout, seconds: float) -> str:
    """One line: loss at the first and last iteration, skipped iterations (with loss
    scaling), time."""
    if not records:
        return f"{layout.name}: no iterations left to train, {seconds:.1f} s"
    if "loss" not in records[0]:  # --skip-train
        return f"{layout.name}: evaluated only (--skip-train), {seconds:.1f} s"
    first, last = records[0]["loss"], records[-1]["loss"]
    trend = "falls" if last < first else "does not fall"
    skipped = ""
    if records[-1].get("loss_scale") is not None:
        skipped = f", {records[-1]['skipped_iterations']} skipped (fp16 overflow)"
    return (
        f"{layout.name}: loss {first:.4f} -> {last:.4f} over {len(records)} iterations "
        f"({trend}){skipped}, {seconds:.1f} s"
    )


def _processes(count: int) -> str:
    """``1 process``, ``4 processes``."""
    return f"{count} process{'es' if count > 1 else ''}"


def _print_header(config: TrainingConfig, layout: Layout) -> None:
    """What is being trained, how, on rank 0."""
    backend = dist.get_backend() if dist.is_initialized() else "no torch.distributed"
    backend += f", {describe_device(comm_device())}"
    _print(
        f"{'DPO' if config.dpo else 'SFT'} of a GPT ({config.num_layers} layers, hidden "
        f"{config.hidden_size}, {config.num_attention_heads} heads, vocab "
        f"{_data_description(config)}; "
        f"layout {layout.name} on {_processes(layout.world_size)} "
        f"({backend}); {layout.num_microbatches} microbatch(es) of {config.micro_batch_size} "
        f"x {config.seq_length} tokens per replica, global batch {config.global_batch_size}"
        f"{_model_description(config)}"
    )
    if comm_device().type == "cpu" and (config.bf16 or config.fp16):
        _print(half_precision_on_cpu_warning(config))


def _model_description(config: TrainingConfig) -> str:
    """The header's experts and LoRA parts (empty for a dense model without adapters)."""
    parts = []
    if config.num_experts is not None:
        freq = config.moe_layer_freq
        where = "every layer" if freq == 1 else f"--moe-layer-freq {freq}"
        parts.append(f"MoE: {config.num_experts} experts, top-{config.moe_router_topk}, {where}")
    if config.lora_dim is not None:
        parts.append(
            f"LoRA: rank {config.lora_dim}, alpha {config.lora_alpha:g} on "
            f"{', '.join(config.lora_target_modules)} (base weights frozen)"
        )
    return "".join(f"; {part}" for part in parts)


def parameter_counts(
    model: List[torch.nn.Module], pg_collection: Optional[ProcessGroupCollection]
) -> Tuple[int, int]:
    """(parameters, trainable parameters) of the whole model, each element once whatever the
    layout (the gradient norm's rule: TP-replicated ones on TP rank 0, not the tied output
    copy of the embeddings; dense ones on dp = cp = 0, expert ones on expert-dp 0); summed
    over the run's ranks (collective)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    groups = pg_collection
    dense_home = groups is None or (get_pg_rank(groups.dp) == 0 and get_pg_rank(groups.cp) == 0)
    expert_home = groups is None or get_pg_rank(groups.expt_dp) == 0
    counts = torch.zeros(2, dtype=torch.float64)
    for chunk in model:
        for parameter in chunk.parameters():
            expert = not getattr(parameter, "allreduce", True)
            tp = None if groups is None else (groups.expt_tp if expert else groups.tp)
            if (
                (expert_home if expert else dense_home)
                and param_is_not_shared(parameter)
                and param_is_not_tensor_parallel_duplicate(parameter, tp)
            ):
                counts += torch.tensor(
                    [parameter.numel(), parameter.numel() * parameter.requires_grad]
                )
    if groups is not None:  # every rank of the run: tp x dp x cp, then the stages
        counts = communication.all_reduce(counts, groups.tp_dp_cp)
        counts = communication.all_reduce(counts, groups.pp)
    return int(counts[0].item()), int(counts[1].item())


def _parameters_line(total: int, trainable: int) -> str:
    """``parameters: 52,480 (52,480 trainable)``."""
    share = "" if trainable == total else f", {100 * trainable / max(total, 1):.2f}%"
    return f"parameters: {total:,} ({trainable:,} trainable{share})"


def half_precision_on_cpu_warning(config: TrainingConfig) -> str:
    """The header's warning for ``--bf16``/``--fp16`` on the CPU: CPUs have few half-precision
    kernels, so the run is slower than in fp32, not faster (--bf16 measured 3-4.5x slower
    than fp32 on the default model, issue 29)."""
    flag = "--bf16" if config.bf16 else "--fp16"
    return (
        f"warning: {flag} on the CPU is slower than fp32 (3-4.5x measured for --bf16 on this "
        "model): CPUs have few half-precision kernels; leave it out unless you are testing "
        "what a GPU run will do"
    )


def _data_description(config: TrainingConfig) -> str:
    """``64) on generated prompt/response pairs`` or the data path and tokenizer."""
    path = config.data_path
    if config.skip_train and config.valid_data_path:  # the only data an evaluation reads
        path = config.valid_data_path
    if not path:
        return f"{config.vocab_size}) on generated prompt/response pairs"
    vocab = build_training_tokenizer(config.tokenizer, config.eod_token).vocab_size
    return f"{vocab}) on {path} ({config.tokenizer or 'byte-level'} tokenizer)"


def _print(message: str) -> None:
    """Print on rank 0 only."""
    if is_rank_zero():
        print(message, flush=True)
