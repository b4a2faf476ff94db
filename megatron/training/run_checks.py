"""The rules between the run's options that neither the layout nor a model feature owns:
what an option needs or excludes (so none is silently ignored): the optimizer step and
recomputation, checkpoints and exits, the schedule and data, validation, logging, positions
and activations, loss scaling. ``validation.validate_config`` calls ``check_run_options``. No
torch here (the launcher checks the command line before starting the workers).
"""

from megatron.core import config_rules
from megatron.training.errors import UsageError
from megatron.training.flag_checks import Config, Given
from megatron.training.flag_checks import default as _default
from megatron.training.flag_checks import flag as _flag
from megatron.training.flag_checks import require as _require


def check_run_options(c: Config, given: Given) -> None:
    """Options that need, or exclude, another one (so none is silently ignored)."""
    _check_step_options(c)
    _check_checkpoint_options(c)
    _check_schedule_and_data(c)
    _check_evaluation(c, given)
    _check_logging(c)
    _check_model_options(c)
    _check_loss_scaling(c)


def _check_step_options(c: Config) -> None:
    """--overlap-param-gather, recomputation and the per-shard loss: what they need."""
    _require(
        not c.overlap_param_gather or c.use_distributed_optimizer,
        "--overlap-param-gather only supported with distributed optimizer: add "
        "--use-distributed-optimizer",
    )
    recompute = config_rules.recompute_problems(
        c.recompute_granularity,
        c.recompute_method,
        c.recompute_num_layers,
        c.recompute_modules,
        c.num_layers // c.pipeline_model_parallel_size,
        name=lambda field: "--" + field.replace("_", "-"),
    )
    _require(not recompute, "; ".join(recompute))
    _require(
        c.recompute_modules is None or c.recompute_granularity == "selective",
        f"--recompute-modules {' '.join(c.recompute_modules or [])} needs "
        f"--recompute-granularity selective (got {c.recompute_granularity})",
    )
    _require(
        not (c.per_shard_loss_normalization and c.calculate_per_token_loss),
        "--per-shard-loss-normalization emulates the averaged mode; it cannot be combined "
        "with --calculate-per-token-loss",
    )


def _check_checkpoint_options(c: Config) -> None:
    """--save / --load and the flags that need them; the exit conditions save first."""
    _require(
        c.save_interval is None or c.save is not None,
        f"--save-interval {c.save_interval} needs --save DIR",
    )
    for name in (
        "ckpt_step",
        "finetune",
        "no_load_optim",
        "no_load_rng",
        "exit_on_missing_checkpoint",
        "override_opt_param_scheduler",
        "use_checkpoint_opt_param_scheduler",
    ):
        value = getattr(c, name)
        _require(
            value is None or value is False or c.load is not None,
            f"{_flag(c, name)}"
            f"{'' if isinstance(value, bool) else f' {value}'} needs --load DIR "
            "(nothing is loaded)",
        )
    _require(
        not (c.override_opt_param_scheduler and c.use_checkpoint_opt_param_scheduler),
        "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each "
        "other (the command line's schedule, or the checkpoint's)",
    )
    exits = [
        f"{_flag(c, name)}{'' if value is True else f' {value}'}"
        for name in ("exit_signal_handler", "exit_duration_in_mins", "exit_interval")
        for value in [getattr(c, name)]
        if value not in (None, False)
    ]
    _require(
        not exits or c.save is not None,
        f"{', '.join(exits)} save a checkpoint before exiting: add --save DIR",
    )
    _require(
        c.exit_signal_handler or c.exit_signal == _default(c, "exit_signal"),
        f"--exit-signal {c.exit_signal} needs --exit-signal-handler",
    )
    _require(
        not (c.compare_single_process and c.load),
        "--compare-single-process compares a whole run from iteration 1; it cannot be "
        f"combined with --load {c.load}",
    )


def _check_schedule_and_data(c: Config) -> None:
    """The learning-rate schedule, the tokenizer and vocabulary, the comparison's tolerance
    and the precision."""
    _require(
        c.lr_warmup_iters < c.train_iters,
        f"--lr-warmup-iters must be >= 0 and < --train-iters {c.train_iters}, "
        f"got {c.lr_warmup_iters}",
    )
    _require(c.min_lr <= c.lr, f"--min-lr must be in [0, --lr {c.lr}], got {c.min_lr}")
    _require(
        c.tokenizer is None or c.data_path is not None or c.valid_data_path is not None,
        f"--tokenizer {c.tokenizer!r} needs --data-path (the generated data has its own ids)",
    )
    _require(
        c.eod_token is None or c.tokenizer not in (None, "byte-level"),
        f"--eod-token {c.eod_token!r} needs --tokenizer DIR_OR_tokenizer.json (the byte-level "
        "tokenizer's end-of-document id is fixed)",
    )
    _require(
        c.data_path is None or c.vocab_size == _default(c, "vocab_size") or c.hf_model,
        f"--vocab-size {c.vocab_size} is not used with --data-path: the vocabulary is the "
        "tokenizer's (see --tokenizer); leave --vocab-size out",
    )
    _require(
        c.min_lr == 0 or c.lr_decay_style != "constant",
        f"--min-lr {c.min_lr} is the end of a decay, but --lr-decay-style constant keeps "
        "--lr; use --lr-decay-style linear or cosine, or leave --min-lr out",
    )
    _require(
        c.compare_single_process or c.compare_tolerance == _default(c, "compare_tolerance"),
        f"--compare-tolerance {c.compare_tolerance} needs --compare-single-process",
    )
    _require(not (c.bf16 and c.fp16), "--bf16 and --fp16 were both given; expected at most one")


def _check_model_options(c: Config) -> None:
    """Positions, RoPE, the activation and the q/k norm: none given where it is not used."""
    _require(
        c.position_embedding_type == "learned_absolute" or c.max_position_embeddings is None,
        f"--max-position-embeddings {c.max_position_embeddings} sizes the learned position "
        f"table; --position-embedding-type {c.position_embedding_type} has none",
    )
    _require(
        c.position_embedding_type != "learned_absolute"
        or (c.max_position_embeddings or c.seq_length) >= c.seq_length,
        f"--seq-length {c.seq_length} is longer than the learned position table "
        f"(--max-position-embeddings {c.max_position_embeddings})",
    )
    _require(
        c.position_embedding_type == "rope"
        or not (c.use_rope_scaling or c.rotary_percent != _default(c, "rotary_percent")),
        "--use-rope-scaling and --rotary-percent need --position-embedding-type rope",
    )
    _require(
        c.position_embedding_type in ("rope", "yarn")
        or c.rotary_base == _default(c, "rotary_base"),
        "--rotary-base needs --position-embedding-type rope or yarn",
    )
    _require(
        c.use_rope_scaling or c.rope_scaling_factor == _default(c, "rope_scaling_factor"),
        f"--rope-scaling-factor {c.rope_scaling_factor} needs --use-rope-scaling",
    )
    _require(not (c.openai_gelu and c.swiglu), "--openai-gelu and --swiglu exclude each other")
    _require(not (c.geglu and c.swiglu), "--geglu and --swiglu exclude each other")
    _require(
        not (c.quick_geglu and (c.swiglu or c.geglu or c.openai_gelu)),
        "--quick-geglu is its own gated activation; leave out --swiglu, --geglu and "
        "--openai-gelu",
    )
    _check_gemma_features(c)
    _require(
        not c.qk_layernorm_whole_projection or (c.qk_layernorm and c.normalization == "RMSNorm"),
        "--qk-layernorm-whole-projection needs --qk-layernorm and --normalization RMSNorm "
        f"(got --qk-layernorm {c.qk_layernorm}, --normalization {c.normalization})",
    )


def _check_gemma_features(c: Config) -> None:
    """The window pattern and local RoPE base need a window; soft-capped attention needs the
    explicit attention kernel."""
    windowed = c.window_size is not None and c.window_size[0] != -1
    for flag, value in (
        ("--window-attn-skip-freq", c.window_attn_skip_freq),
        ("--local-rotary-base", c.local_rotary_base),
    ):
        _require(
            value is None or windowed,
            f"{flag} {value} needs --window-size LEFT 0 with LEFT >= 0 (got --window-size "
            f"{c.window_size})",
        )
    factor = c.rotary_seq_len_interpolation_factor
    _require(
        factor is None or c.position_embedding_type == "rope",
        f"--rotary-seq-len-interpolation-factor {factor} needs --position-embedding-type rope",
    )
    _require(
        c.local_rotary_base is None or c.position_embedding_type == "rope",
        f"--local-rotary-base {c.local_rotary_base} needs --position-embedding-type rope",
    )
    _require(
        not (c.apply_layernorm_1p and c.qk_layernorm_whole_projection),
        "--apply-layernorm-1p and --qk-layernorm-whole-projection exclude each other (the "
        "whole-projection q/k norm has no zero-centred weight)",
    )
    _require(
        c.attn_logit_softcapping is None or c.attention_backend in ("auto", "unfused", "local"),
        f"--attn-logit-softcapping {c.attn_logit_softcapping} is computed by the explicit "
        f"attention kernel only; expected --attention-backend auto, unfused or local, got "
        f"{c.attention_backend}",
    )


def _check_loss_scaling(c: Config) -> None:
    """The dynamic loss scaling flags: for --fp16 only, consistent with each other."""
    _require(
        c.min_loss_scale <= c.initial_loss_scale,
        f"--min-loss-scale {c.min_loss_scale} must be <= --initial-loss-scale "
        f"{c.initial_loss_scale}",
    )
    dynamic = [
        _flag(c, name)
        for name in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
        if getattr(c, name) != _default(c, name)
    ]
    _require(
        c.fp16 or not dynamic,
        f"{', '.join(dynamic)} set the dynamic loss scaling of --fp16, which is not given",
    )


def _check_evaluation(c: Config, given: Given) -> None:
    """--eval-interval, --eval-iters, --valid-data-path, --split, --skip-train: each used,
    none contradicting another."""
    _require(
        c.valid_data_path is None or c.data_path is not None or c.skip_train,
        f"--valid-data-path {c.valid_data_path!r} needs --data-path (the generated data "
        "validates on held-out generated pairs), unless --skip-train only evaluates",
    )
    _require(
        c.split is None or c.data_path is not None,
        f"--split {c.split!r} splits --data-path, which is not given",
    )
    _require(
        not (c.split and c.valid_data_path),
        f"--split {c.split!r} and --valid-data-path {c.valid_data_path!r} both name "
        "validation data; give one",
    )
    if c.split is not None:
        from megatron.training.datasets import parse_split

        try:
            weights = parse_split(c.split)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        _require(
            weights[0] > 0 or c.skip_train,
            f"--split {c.split!r} leaves no training data (its first weight is 0)",
        )
        _require(
            weights[1] > 0 or (c.eval_interval is None and not c.skip_train),
            f"--split {c.split!r} has no validation part (its second weight is 0), but "
            f"{'--skip-train' if c.skip_train else f'--eval-interval {c.eval_interval}'} "
            "needs validation data",
        )
    validates = (c.eval_interval or c.skip_train) and c.eval_iters != 0
    _require(
        not (validates and c.data_path and not (c.split or c.valid_data_path)),
        f"{'--skip-train' if c.skip_train else f'--eval-interval {c.eval_interval}'} "
        f"validates, but --data-path {c.data_path!r} has no validation part: add --split "
        "(e.g. 969,30,1) or --valid-data-path PATH",
    )
    _require(
        c.eval_iters != -1 or c.data_path is not None or c.valid_data_path is not None,
        "--eval-iters -1 (the whole validation set) needs --valid-data-path or --split: the "
        "generated validation data is endless; give a number of global batches",
    )
    enabled = c.eval_interval or c.valid_data_path or c.split or c.skip_train
    _require(
        c.eval_iters == _default(c, "eval_iters") or enabled,
        f"--eval-iters {c.eval_iters} needs validation: add --eval-interval N, "
        "--valid-data-path or --split",
    )
    _require(
        not c.skip_train or c.load is not None or c.hf_model is not None,
        "--skip-train evaluates a trained model: add --load DIR or --hf-model DIR",
    )
    _require(
        not c.skip_train or c.eval_iters != 0,
        "--skip-train only evaluates, but --eval-iters 0 turns validation off",
    )
    _require(
        not (c.skip_train and c.compare_single_process),
        "--skip-train trains nothing; --compare-single-process compares training runs",
    )
    _require(
        not c.skip_train or c.export_hf is None,
        f"--skip-train trains nothing, so --export-hf {c.export_hf} would write nothing; to "
        "convert a checkpoint use python -m megatron.training.hf export --load DIR --out "
        f"{c.export_hf}",
    )
    off = [name for name in ("eval_interval", "valid_data_path") if given(name)]
    _require(
        c.eval_iters != 0 or not off,
        f"{' and '.join(f'{_flag(c, n)} {getattr(c, n)}' for n in off)} "
        f"ask{'s' if len(off) == 1 else ''} for validation, but --eval-iters 0 turns it off; "
        "leave one of them out",
    )


def _check_logging(c: Config) -> None:
    """The W&B details need --wandb-project, --tensorboard-log-interval a scalar logger;
    each logger's package is installed."""
    from megatron.training.loggers import check_logging_packages

    _require(
        c.tensorboard_log_interval == _default(c, "tensorboard_log_interval")
        or c.tensorboard_dir is not None
        or c.wandb_project is not None,
        f"--tensorboard-log-interval {c.tensorboard_log_interval} sets when TensorBoard / W&B "
        "get the training scalars: add --tensorboard-dir DIR or --wandb-project NAME",
    )

    for name in ("wandb_exp_name", "wandb_save_dir"):
        value = getattr(c, name)
        _require(
            value is None or c.wandb_project is not None,
            f"{_flag(c, name)} {value} needs --wandb-project NAME",
        )
    check_logging_packages(c)
