"""The main job: supervised fine-tuning of the small GPT under any CP/PP/VPP/DP layout.

``pretrain`` runs a whole job (groups, training, the optional one-process comparison,
metrics); ``train`` sets up one training run (data, model, optimizer, the checkpoint it
resumes from, the metric sinks) and runs the loop of ``loop.py`` on it (one ``step`` per
iteration, then the after-step hooks). ``comparison.py`` is ``--compare-single-process``.
"""

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import communication
from megatron.core.communication import broadcast_object, world_group
from megatron.core.device import comm_device, describe_device
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.process_groups_config import ProcessGroupCollection, get_pg_rank, get_pg_size
from megatron.core.transformer.moe import moe_utils
from megatron.training.arguments import Layout, TrainingConfig, validate_config
from megatron.training.checkpoint_layout import layout_record, settings_record
from megatron.training.checkpointing import base_weights, load_checkpoint
from megatron.training.compare import Comparison
from megatron.training.comparison import compare_with_single_process
from megatron.training.datasets import build_sft_dataset, build_training_tokenizer
from megatron.training.dpo import PreferenceTraining, build_preference_validation
from megatron.training.dpo_reference import reference_source
from megatron.training.evaluation import build_validation_set
from megatron.training.exits import ExitConditions
from megatron.training.hf_settings import resolve_hf_model
from megatron.training.initialize import (
    initialize_distributed,
    initialize_model_parallel_groups,
    initialize_single_gpu,
    is_rank_zero,
    launched_world_size,
    print_rank_0,
    tear_down_distributed,
)
from megatron.training.loggers import MetricSinks, Ranks
from megatron.training.loop import (  # noqa: F401 - the step's names, importable from here
    RECENT_STEPS,
    Run,
    check_recent_steps,
    check_step,
    forward_step,
    loss_func,
    run_loop,
    without_padding_mask,
)
from megatron.training.lora_base import lora_base_record
from megatron.training.metrics import save_metrics
from megatron.training.model import build_model, precision_dtype
from megatron.training.preference_data import build_preference_dataset


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


def pretrain(config: TrainingConfig, dpo_source: Optional[dict] = None) -> TrainingResult:
    """Run the job on this process: one process without torchrun, else this rank's part.

    Validates the layout before any collective, starts torch.distributed when launched by
    torchrun (reusing an existing default group) or, without torchrun, a one-process nccl
    group when the backend means the GPU (``initialize_single_gpu``), trains, compares
    with the one-process run when asked (``--compare-single-process``), writes metrics on
    rank 0, and tears down the model-parallel state (and the default group if it created
    it). ``dpo_source``: the DPO reference's source the command line checked already
    (``dpo_reference.reference_source``; None: ``train`` finds it).
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
                train(config, layout, groups, desc=label, exits=exits, dpo_source=dpo_source)
            )
        result = TrainingResult(layout, records, stopped=exits.stopped)
        print_rank_0(_summary(records, layout, time.perf_counter() - started))
        if config.compare_single_process and exits.stopped:
            print_rank_0("--compare-single-process: not compared (the run stopped early)")
        elif config.compare_single_process:
            result.reference, result.comparison, result.passed = compare_with_single_process(
                train, config, records, label
            )
        if config.save_metrics and is_rank_zero() and records:
            result.metrics_files = save_metrics(
                config.save_metrics, records, label, result.reference
            )
            print_rank_0(f"metrics written to {', '.join(str(p) for p in result.metrics_files)}")
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
    dpo_source: Optional[dict] = None,
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
    stops the run (``loop.check_step``).
    ``perturbation`` > 0 scales every initial weight by ``1 + perturbation * u``, u uniform
    in [-1, 1] from a fixed generator (the comparison's sensitivity run).
    ``dpo_source``: the DPO reference's source (None: ``dpo_reference.reference_source``).
    """
    sinks = MetricSinks(config, Ranks(first=is_rank_zero(), last=_is_last_rank()))
    try:
        reference = dpo_source or reference_source(config)
        run = _build_run(config, layout, pg_collection, perturbation, sinks, reference)
        run.desc, run.exits = desc, exits
        return run_loop(run)
    finally:
        sinks.close()


def _build_run(
    config: TrainingConfig,
    layout: Layout,
    pg_collection: Optional[ProcessGroupCollection],
    perturbation: float,
    sinks: MetricSinks,
    reference: Optional[dict],
) -> Run:
    """The run's data, validation set, model, optimizer and schedule, resumed from
    ``--pretrained-checkpoint`` / ``--load`` when given; ``reference``: where a DPO run's
    reference comes from (``dpo_reference.reference_source``)."""
    dataset, config = _training_data(config)
    build_validation = build_preference_validation if config.dpo else build_validation_set
    validation_set = build_validation(config)
    if validation_set is not None:
        print_rank_0(validation_set.describe())
        for note in validation_set.notes:  # truncation counts of the validation records
            print_rank_0(f"validation data: {note}")
    model = build_model(config, layout, pg_collection)
    print_rank_0(_parameters_line(*parameter_counts(model, pg_collection)))
    if perturbation:
        _perturb_weights(model, perturbation)
    # an entry left by another model of this process (the multi-rank run before
    # --compare-single-process's reference, an earlier run of the launch) is dropped
    moe_utils.reset_aux_losses_tracker()
    optimizer, scheduler = build_optimizer(config, model, pg_collection)
    if config.fp16 or config.loss_scale is not None:  # the schedule scales the loss
        model[0].config.grad_scale_func = optimizer.scale_loss
    start_iteration = _load_checkpoints(config, layout, model, optimizer, scheduler)
    run = Run(
        config, layout, pg_collection, model, optimizer, scheduler, dataset, validation_set,
        sinks, start_iteration=start_iteration, lora_base=_lora_base(config),
    )  # fmt: skip
    if config.dpo:  # the reference (after the loads: the starting weights), the objective
        run.dpo = PreferenceTraining(
            config, layout, pg_collection, model, run.forward_backward_func,
            source=reference, resumed=start_iteration > 0,
        )  # fmt: skip
        print_rank_0(run.dpo.describe())
    return run


def _load_checkpoints(config: TrainingConfig, layout: Layout, model, optimizer, scheduler) -> int:
    """Load ``--pretrained-checkpoint`` (a LoRA run's frozen base) and ``--load``, printing
    their notes; returns the iteration the run resumes after (0 without ``--load``)."""
    if config.pretrained_checkpoint:  # the frozen base of a LoRA run
        _, _, notes = load_checkpoint(
            config.pretrained_checkpoint,
            model,
            optimizer,
            layout=layout_record(layout),
            run_settings=settings_record(config),
            finetune=True,
        )
        for note in notes:
            print_rank_0(note.replace("--finetune: ", "--pretrained-checkpoint: "))
    if not config.load:
        return 0
    start_iteration, _, notes = load_checkpoint(
        config.load,
        model,
        optimizer,
        scheduler,
        layout=layout_record(layout),
        save_dir=config.save,
        run_settings=settings_record(config),
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
        print_rank_0(note)
    return start_iteration


def _training_data(config: TrainingConfig) -> Tuple[Any, TrainingConfig]:
    """The training data set (None with ``--skip-train``: nothing is trained, so no
    ``--data-path`` is read) and ``config`` with the model's vocabulary: the tokenizer's
    for data files, checked against ``--hf-model``'s (which may be padded)."""
    build = build_preference_dataset if config.dpo else build_sft_dataset
    dataset = None if config.skip_train else build(config)
    for note in getattr(dataset, "notes", []):  # truncation and empty-loss counts
        print_rank_0(note)
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
    print_rank_0(
        f"{'DPO' if config.dpo else 'SFT'} of a GPT ({config.num_layers} layers, hidden "
        f"{config.hidden_size}, "
        f"{config.num_attention_heads} heads, vocab {_data_description(config)}; "
        f"layout {layout.name} on {_processes(layout.world_size)} "
        f"({backend}); {layout.num_microbatches} microbatch(es) of {config.micro_batch_size} "
        f"x {config.seq_length} tokens per replica, "
        f"global batch {config.global_batch_size}"
        f"{_model_description(config)}"
    )
    if comm_device().type == "cpu" and (config.bf16 or config.fp16):
        print_rank_0(half_precision_on_cpu_warning(config))
    if config.fp8_format and config.num_experts:
        print_rank_0(FP8_EXPERTS_WARNING)


def _model_description(config: TrainingConfig) -> str:
    """The header's experts, multi-token prediction and LoRA parts (empty for a dense model
    without them)."""
    parts = []
    if config.num_experts is not None:
        freq = config.moe_layer_freq
        where = "every layer" if freq == 1 else f"--moe-layer-freq {freq}"
        parts.append(f"MoE: {config.num_experts} experts, top-{config.moe_router_topk}, {where}")
    if config.mtp_num_layers:
        parts.append(
            f"MTP: {config.mtp_num_layers} depth(s), loss weight {config.mtp_loss_scaling_factor:g}"
        )
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


FP8_EXPERTS_WARNING = (
    "warning: --fp8-format with --num-experts: each routed expert's FP8 GEMM is a "
    "_scaled_mm of its own (measured on an H200: an FP8 MoE layer 7-15x slower than a bf16 "
    "--moe-grouped-gemm one; docs/fp8.md); FP8 pays on the dense layers"
)


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
