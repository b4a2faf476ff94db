"""The main job's settings: one dataclass whose fields declare their command line, and the
layout it implies.

Each field of ``TrainingConfig`` is declared once, with ``option(default, "--flag", ...,
help=..., check=...)`` (``megatron.training.options``): its flag (the first one names it in
errors; later ones are aliases, megatron's long names among them), its help text and the
check of its own value. The ``argparse`` parser is generated from the fields
(``build_parser``), and ``command_line`` writes a config back as flags. ``validate_config``
runs the per-field checks, then the rules between fields (the ones shared with
``TransformerConfig`` live in ``megatron.core.config_rules``); it rejects impossible layouts
and combinations with a message naming the flag, the value and what was expected, before any
process group exists, identically on every rank.

Every default (model size, batch sizes, sequence length, iterations) is independent of the
parallel layout, so two runs that differ only in ``--cp/--pp/--vpp/--nproc-per-node`` train
on the same data with the same objective. This module imports no torch (the launcher parses
and checks the command line before starting the workers).

Why one module of ~800 lines: it is the trainer's list of flags (one declaration each, about
60) followed by the rules between them; a flag and the rules that mention it are meant to be
read and changed together.
"""

import argparse
from dataclasses import Field, dataclass, fields
from typing import Dict, List, Optional, Sequence, Tuple, Union

from megatron.core import config_rules
from megatron.core.config_rules import ATTENTION_BACKENDS, CP_COMM_TYPES, NORMALIZATIONS
from megatron.training import options
from megatron.training.errors import UsageError
from megatron.training.options import (
    Check,
    Option,
    check_fields,
    command_line,
    is_int,
    is_number,
    non_negative,
    non_negative_number,
    one_of,
    option,
    option_of,
    positive,
    loss_scale_number,
    positive_number,
    unit_interval,
)

LR_DECAY_STYLES = ("constant", "linear", "cosine")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")

__all__ = [
    "CP_COMM_TYPES",
    "Check",
    "Layout",
    "Option",
    "TrainingConfig",
    "build_parser",
    "command_line",
    "explicit_options",
    "option",
    "option_of",
    "parse_args",
    "single_process_config",
    "validate_config",
]


# --help sections: the field that opens each one (the following fields belong to it).
_SECTIONS = {
    "nproc_per_node": "layout",
    "micro_batch_size": "data and batches",
    "num_layers": "model",
    "train_iters": "optimization",
    "bf16": "mixed precision (docs/mixed_precision.md)",
    "save_metrics": "output and checks",
    "save": "checkpoints (docs/checkpoints.md)",
    "compare_single_process": "output and checks",
}


@dataclass
class TrainingConfig:
    """Settings of one run (CLI flag ``--foo-bar`` is field ``foo_bar``, with the aliases
    ``--tp``, ``--cp``, ``--pp``, ``--vpp``)."""

    # Layout. DP = world / (TP * CP * PP).
    nproc_per_node: Optional[int] = option(
        None,
        "--nproc-per-node",
        type=int,
        metavar="N",
        check=positive,
        help="processes to launch (with torch.distributed.run) when not already under "
        "torchrun; default: 1. Under torchrun it must match the launch, or be left out",
    )
    tensor_model_parallel_size: int = option(
        1,
        "--tp",
        "--tensor-model-parallel-size",
        metavar="T",
        check=positive,
        help="tensor-parallel size T (heads, FFN and vocabulary split over T ranks)",
    )
    sequence_parallel: bool = option(
        False,
        "--sequence-parallel",
        help="with --tp > 1: norms, dropout and residuals on a 1/T share of the sequence",
    )
    context_parallel_size: int = option(
        1,
        "--cp",
        "--context-parallel-size",
        metavar="C",
        check=positive,
        help="context-parallel size C (each sequence split into 2C chunks)",
    )
    pipeline_model_parallel_size: int = option(
        1,
        "--pp",
        "--pipeline-model-parallel-size",
        metavar="P",
        check=positive,
        help="pipeline-parallel size",
    )
    virtual_pipeline_model_parallel_size: Optional[int] = option(
        None,
        "--vpp",
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        metavar="V",
        check=positive,
        help="model chunks per pipeline rank (interleaved schedule); default: none",
    )
    distributed_backend: str = option(
        "auto",
        "--distributed-backend",
        choices=DISTRIBUTED_BACKENDS,
        check=one_of(DISTRIBUTED_BACKENDS),
        help="auto: nccl when every local process has a GPU, else gloo; one process "
        "without torchrun then computes on cuda:0 too (a one-process nccl group)",
    )
    cp_comm_type: Union[str, List[str]] = option(
        "all_gather",
        "--cp-comm-type",
        nargs="+",
        choices=CP_COMM_TYPES,
        metavar="KIND",
        one_or_list=True,
        help="how context-parallel attention brings keys to queries (megatron-core's "
        "cp_comm_type), one kind or one per layer: all_gather (K/V gathered per head "
        "group), p2p (the load-balanced ring), a2a (heads all-to-all) or a2a+p2p (heads "
        "all-to-all within A ranks, the ring over P)",
    )
    hierarchical_context_parallel_sizes: Optional[List[int]] = option(
        None,
        "--hierarchical-context-parallel-sizes",
        nargs=2,
        type=int,
        metavar=("A", "P"),
        help="the two levels of --cp for --cp-comm-type a2a+p2p: A consecutive ranks "
        "exchange heads, the ring runs over P (A x P = --cp)",
    )
    # Data and batches.
    micro_batch_size: int = option(
        2, "--micro-batch-size", check=positive, help="sequences per microbatch"
    )
    global_batch_size: int = option(
        8,
        "--global-batch-size",
        check=positive,
        help="sequences per step, over all data-parallel replicas and microbatches",
    )
    seq_length: int = option(32, "--seq-length", check=positive, help="tokens per sequence")
    vocab_size: int = option(
        64,
        "--vocab-size",
        check=Check("an integer >= 5", lambda v: is_int(v) and v >= 5),
        help="vocabulary size (4 special tokens)",
    )
    data_path: Optional[str] = option(
        None,
        "--data-path",
        type=str,
        metavar="PATH",
        help="train on a JSONL file (chat 'messages' records rendered with the tokenizer's "
        "chat template, loss on assistant tokens only; prompt/completion, prompt/response or "
        "text records, the prompt masked out of the loss) or an indexed dataset prefix "
        "written by python -m megatron.training.preprocess_data; the vocabulary is then "
        "the tokenizer's. "
        "Default: generated prompt/response pairs",
    )
    tokenizer: Optional[str] = option(
        None,
        "--tokenizer",
        type=str,
        metavar="T",
        help="with --data-path: 'byte-level' (default; UTF-8 bytes, no file), a HuggingFace "
        "tokenizer folder (tokenizer.json + tokenizer_config.json with its chat template) or a "
        "tokenizers JSON file",
    )
    eod_token: Optional[str] = option(
        None,
        "--eod-token",
        type=str,
        metavar="TOKEN",
        help="the end-of-document token of --tokenizer (appended to text records, used as "
        "padding); default: the tokenizer config's eos_token, else <|endoftext|>, </s>, ...",
    )
    pack_sequences: bool = option(
        False,
        "--pack-sequences",
        help="pack documents (generated pairs or --data-path records) into rows of "
        "--seq-length tokens (THD format: documents never attend to each other, each "
        "padded to a multiple of 16, padding "
        "and prompts masked out of the loss); needs --micro-batch-size 1",
    )
    # Model.
    num_layers: int = option(4, "--num-layers", check=positive, help="transformer layers")
    hidden_size: int = option(32, "--hidden-size", check=positive, help="hidden size (model width)")
    num_attention_heads: int = option(
        4, "--num-attention-heads", check=positive, help="attention heads"
    )
    num_query_groups: Optional[int] = option(
        None,
        "--num-query-groups",
        type=int,
        check=positive,
        help="key/value head groups (grouped-query attention); default: one per head",
    )
    ffn_hidden_size: Optional[int] = option(
        None,
        "--ffn-hidden-size",
        type=int,
        check=positive,
        help="MLP hidden size; default: 4 x hidden size",
    )
    normalization: str = option(
        "LayerNorm",
        "--normalization",
        choices=NORMALIZATIONS,
        check=one_of(NORMALIZATIONS),
        help="normalization layer",
    )
    swiglu: bool = option(
        False, "--swiglu", help="gated MLP silu(x W_gate) * (x W_up) instead of gelu(x W_1)"
    )
    position_embedding_type: str = option(
        "learned_absolute",
        "--position-embedding-type",
        choices=POSITION_EMBEDDING_TYPES,
        check=one_of(POSITION_EMBEDDING_TYPES),
        help="learned absolute positions or rotary embeddings",
    )
    disable_bias_linear: bool = option(
        False, "--disable-bias-linear", help="no biases in the linear layers"
    )
    label_smoothing: float = option(
        0.0,
        "--label-smoothing",
        check=Check("in [0, 1)", config_rules.label_smoothing_allowed),
        help="label smoothing of the cross-entropy over the whole vocabulary",
    )
    init_method_std: float = option(
        0.02, "--init-method-std", check=non_negative_number, help="std of initial weights"
    )
    untie_embeddings_and_output_weights: bool = option(
        False,
        "--untie-embeddings-and-output-weights",
        help="separate output layer (default: tied to the word embeddings)",
    )
    kv_channels: Optional[int] = option(
        None,
        "--kv-channels",
        type=int,
        check=positive,
        help="size of each attention head; default: hidden size / attention heads",
    )
    max_position_embeddings: Optional[int] = option(
        None,
        "--max-position-embeddings",
        type=int,
        check=positive,
        help="rows of the learned position table (learned_absolute); default: --seq-length",
    )
    norm_epsilon: float = option(
        1e-5, "--norm-epsilon", check=positive_number, help="epsilon of LayerNorm / RMSNorm"
    )
    rotary_base: float = option(
        10000.0, "--rotary-base", check=positive_number, help="RoPE base (rope_theta)"
    )
    use_rope_scaling: bool = option(
        False,
        "--use-rope-scaling",
        help="Llama 3.x RoPE frequency scaling (by --rope-scaling-factor)",
    )
    rope_scaling_factor: float = option(
        8.0,
        "--rope-scaling-factor",
        check=positive_number,
        help="--use-rope-scaling: the factor long wavelengths are divided by",
    )
    add_qkv_bias: bool = option(
        False,
        "--add-qkv-bias",
        help="biases on the query/key/value projection even with --disable-bias-linear (Qwen2)",
    )
    openai_gelu: bool = option(
        False,
        "--openai-gelu",
        help="GELU's tanh approximation (OpenAI's, GPT-2's gelu_new) instead of the exact one",
    )
    attention_backend: str = option(
        "auto",
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        check=one_of(ATTENTION_BACKENDS),
        help="attention kernel: auto (the one PyTorch's scaled_dot_product_attention picks for "
        "the tensors: cuDNN on Hopper-class GPUs, flash otherwise, the CPU flash op on CPUs), "
        "flash, fused (cuDNN), unfused or local (an explicit score matrix)",
    )
    window_size: Optional[List[int]] = option(
        None,
        "--window-size",
        nargs=2,
        type=int,
        metavar=("LEFT", "RIGHT"),
        check=Check(
            "LEFT >= 0 (or -1: no limit) and RIGHT 0 or -1", config_rules.window_size_valid
        ),
        help="sliding-window attention: a query sees LEFT earlier keys (RIGHT 0: causal); "
        "default: no window",
    )
    hf_model: Optional[str] = option(
        None,
        "--hf-model",
        type=str,
        metavar="DIR",
        help="start from a HuggingFace model (config.json + safetensors: Llama, Mistral, "
        "Qwen2, GPT-2; docs/huggingface.md): its config.json sets the model options above "
        "(an explicit conflicting one is an error), its weights are loaded at any layout, "
        "and with --data-path its tokenizer is the default --tokenizer",
    )
    # Optimization.
    train_iters: int = option(20, "--train-iters", check=positive, help="training iterations")
    lr: float = option(3e-3, "--lr", check=positive_number, help="peak Adam learning rate")
    adam_beta1: float = option(
        0.9, "--adam-beta1", check=unit_interval, help="Adam's first-moment decay"
    )
    adam_beta2: float = option(
        0.999, "--adam-beta2", check=unit_interval, help="Adam's second-moment decay"
    )
    adam_eps: float = option(
        1e-8,
        "--adam-eps",
        check=positive_number,
        help="Adam's epsilon added to the root of the second moment",
    )
    weight_decay: float = option(
        0.0,
        "--weight-decay",
        check=non_negative_number,
        help="decoupled weight decay (AdamW)",
    )
    lr_warmup_iters: int = option(
        0, "--lr-warmup-iters", check=non_negative, help="linear warm-up from 0"
    )
    lr_decay_style: str = option(
        "constant",
        "--lr-decay-style",
        choices=LR_DECAY_STYLES,
        check=one_of(LR_DECAY_STYLES),
        help="learning-rate decay after warm-up, down to --min-lr at --train-iters",
    )
    min_lr: float = option(
        0.0,
        "--min-lr",
        check=non_negative_number,
        help="learning rate at the end of the decay",
    )
    clip_grad: float = option(
        1.0,
        "--clip-grad",
        check=Check("a finite number >= 0 (0 disables)", lambda v: is_number(v) and v >= 0),
        help="gradient-norm clipping threshold, 0: off",
    )
    calculate_per_token_loss: bool = option(
        False,
        "--calculate-per-token-loss",
        help="train sum(loss)/sum(tokens) over the global batch instead of the mean over "
        "microbatches of each microbatch's token mean",
    )
    per_shard_loss_normalization: bool = option(
        False,
        "--per-shard-loss-normalization",
        help="negative control: train megatron-core 0.16.1's objective, each CP shard's "
        "loss divided by its own valid-token count and averaged over shards; with --cp > 1 "
        "on prompt-masked data it drifts from the one-process run",
    )
    overlap_grad_reduce: bool = option(
        False,
        "--overlap-grad-reduce",
        help="reduce gradient buckets asynchronously during the backward",
    )
    use_distributed_optimizer: bool = option(
        False,
        "--use-distributed-optimizer",
        help="ZeRO-1: gradients reduce-scattered over data x context parallel ranks, fp32 "
        "main parameters and Adam state kept for this rank's shard only, parameters "
        "all-gathered after the step (docs/memory.md)",
    )
    overlap_param_gather: bool = option(
        False,
        "--overlap-param-gather",
        help="with --use-distributed-optimizer: all-gather the updated parameters "
        "asynchronously, each module's forward waiting for its own bucket",
    )
    # Activation recomputation (megatron's flags; docs/memory.md).
    recompute_granularity: Optional[str] = option(
        None,
        "--recompute-granularity",
        choices=config_rules.RECOMPUTE_GRANULARITIES,
        help="recompute activations in the backward: full (whole layers, with "
        "--recompute-method and --recompute-num-layers) or selective (--recompute-modules)",
    )
    recompute_method: Optional[str] = option(
        None,
        "--recompute-method",
        choices=config_rules.RECOMPUTE_METHODS,
        help="with --recompute-granularity full: uniform (groups of --recompute-num-layers "
        "layers, one checkpoint each) or block (the first --recompute-num-layers layers of "
        "each pipeline chunk)",
    )
    recompute_num_layers: Optional[int] = option(
        None,
        "--recompute-num-layers",
        type=int,
        metavar="N",
        help="layers per checkpoint (uniform) or layers checkpointed per chunk (block)",
    )
    recompute_modules: Optional[List[str]] = option(
        None,
        "--recompute-modules",
        nargs="+",
        choices=config_rules.RECOMPUTE_MODULES,
        metavar="MODULE",
        help="with --recompute-granularity selective: which parts of each layer to "
        "recompute: core_attn (default), mlp, layernorm",
    )
    gradient_accumulation_fusion: bool = option(
        False,
        "--gradient-accumulation-fusion",
        help="linear layers add their weight gradients into the fp32 main_grad inside the "
        "GEMM (megatron-core's gradient_accumulation_fusion)",
    )
    compile: bool = option(
        False,
        "--compile",
        help="torch.compile each transformer layer and the loss (an extra of this trainer; "
        "megatron-core's fusion switches are set too): the same math, fewer memory passes "
        "(docs/mixed_precision.md)",
    )
    seed: int = option(
        1234,
        "--seed",
        check=non_negative,
        help="seed of the weights and of the generated data",
    )
    # Mixed precision (megatron's flags; docs/mixed_precision.md).
    bf16: bool = option(
        False,
        "--bf16",
        help="bf16 weights and activations (Float16Module), fp32 main_grad and fp32 main "
        "parameters in the optimizer, loss in fp32",
    )
    fp16: bool = option(
        False, "--fp16", help="as --bf16 in fp16, with dynamic loss scaling (below)"
    )
    loss_scale: Optional[float] = option(
        None,
        "--loss-scale",
        type=float,
        check=loss_scale_number,
        help="a fixed loss scale instead of --fp16's dynamic one",
    )
    initial_loss_scale: float = option(
        2.0**32, "--initial-loss-scale", check=loss_scale_number, help="--fp16: the first scale"
    )
    min_loss_scale: float = option(
        1.0, "--min-loss-scale", check=loss_scale_number, help="--fp16: the smallest scale"
    )
    loss_scale_window: float = option(
        1000.0,
        "--loss-scale-window",
        check=Check("a finite number >= 1", lambda v: is_number(v) and v >= 1),
        help="--fp16: clean steps before the scale doubles",
    )
    hysteresis: int = option(
        2, "--hysteresis", check=positive, help="--fp16: overflowing steps before it halves"
    )
    check_for_nan_in_loss_and_grad: bool = option(
        True,
        "--no-check-for-nan-in-loss-and-grad",
        help="train on after an iteration whose loss or (unscaled) gradient norm is NaN or "
        "inf; by default the run stops there naming the iteration (an fp16 overflow that "
        "loss scaling skips is not stopped)",
    )
    # Output and checks.
    save_metrics: Optional[str] = option(
        None,
        "--save-metrics",
        type=str,
        metavar="DIR",
        help="write DIR/metrics.jsonl (one line per iteration) and DIR/loss.png (loss, "
        "gradient norm and learning rate against iteration)",
    )
    save: Optional[str] = option(
        None,
        "--save",
        type=str,
        metavar="DIR",
        help="save checkpoints to DIR/iter_NNNNNNN (every --save-interval iterations and at "
        "the end) and point DIR/latest_checkpointed_iteration.txt at the newest",
    )
    load: Optional[str] = option(
        None,
        "--load",
        type=str,
        metavar="DIR",
        help="resume from the newest complete checkpoint in DIR, or from DIR itself when it "
        "is one checkpoint's iter_NNNNNNN directory (any layout). No checkpoint there is an "
        "error, except when DIR is also --save (auto-resume: starts from scratch). Settings "
        "that change the model or the data must equal the saved ones",
    )
    export_hf: Optional[str] = option(
        None,
        "--export-hf",
        type=str,
        metavar="DIR",
        help="write the trained model to DIR in HuggingFace format (config.json + "
        "safetensors) at the end, and to DIR/iter_NNNNNNN beside each earlier --save",
    )
    save_interval: Optional[int] = option(
        None,
        "--save-interval",
        type=int,
        check=positive,
        help="iterations between checkpoints",
    )
    ckpt_step: Optional[int] = option(
        None,
        "--ckpt-step",
        type=int,
        metavar="N",
        check=non_negative,
        help="with --load DIR: load DIR/iter_N instead of the newest checkpoint",
    )
    finetune: bool = option(
        False,
        "--finetune",
        help="with --load: load the model weights only (no optimizer, scheduler or RNG "
        "state) and start at iteration 0; --data-path may differ from the saved run's",
    )
    no_load_optim: bool = option(
        False,
        "--no-load-optim",
        help="with --load: do not load the optimizer and scheduler state",
    )
    no_load_rng: bool = option(
        False, "--no-load-rng", help="with --load: do not restore the RNG states"
    )
    exit_on_missing_checkpoint: bool = option(
        False,
        "--exit-on-missing-checkpoint",
        help="with --load DIR --save DIR: an error instead of starting from scratch when DIR "
        "holds no checkpoint yet (any other --load without a checkpoint is an error anyway)",
    )
    compare_single_process: bool = option(
        False,
        "--compare-single-process",
        help="also train on one process and compare the losses per iteration; exit 1 when "
        "they differ by more than --compare-tolerance",
    )
    compare_tolerance: Optional[float] = option(
        None,
        "--compare-tolerance",
        type=float,
        check=non_negative_number,
        help="largest accepted |loss difference| per iteration; default 1e-4 in fp32, and "
        "with --bf16/--fp16 three times the largest difference between the one-process run "
        "in that precision and in fp32 (the precision's own rounding)",
    )
    progress: bool = option(
        True,
        "--no-progress",
        help="hide the progress bar (rank 0 shows one by default)",
    )
    debug: bool = option(
        False,
        "--debug",
        help="show the traceback of every error (also MEGATRON_DEBUG=1); without it an "
        "error in a flag, a file or the data is printed once, as one line",
    )


def flag_of(name: str) -> str:
    """The flag naming ``TrainingConfig`` field ``name`` in messages (e.g. ``--tp``)."""
    return option_of(_FIELDS[name]).flag


_FIELDS: Dict[str, Field] = {f.name: f for f in fields(TrainingConfig)}


@dataclass(frozen=True)
class Layout:
    """A run's parallel layout: world = TP * CP * PP * DP; M microbatches per replica per
    step."""

    world_size: int
    context_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int]
    data_parallel_size: int
    num_microbatches: int
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    hierarchical_context_parallel_sizes: Optional[Tuple[int, ...]] = None

    @property
    def hierarchical_sizes(self) -> Optional[List[int]]:
        """``hierarchical_context_parallel_sizes`` as the list megatron-core takes, or None."""
        sizes = self.hierarchical_context_parallel_sizes
        return None if sizes is None else list(sizes)

    @property
    def name(self) -> str:
        """Short name, e.g. ``cp2-pp2-vpp2-dp1`` or ``tp2-sp-cp2-pp1-dp1``."""
        vpp = self.virtual_pipeline_model_parallel_size
        tp = self.tensor_model_parallel_size
        return (
            f"{f'tp{tp}-' if tp > 1 else ''}{'sp-' if self.sequence_parallel else ''}"
            f"cp{self.context_parallel_size}-pp{self.pipeline_model_parallel_size}"
            f"{f'-vpp{vpp}' if vpp else ''}-dp{self.data_parallel_size}"
        )


def validate_config(config: TrainingConfig, world_size: int) -> Layout:
    """The layout of ``config`` on ``world_size`` processes, or ValueError saying why not.

    First each option's own check (``option(..., check=...)``), then the rules between
    options. DP = world / (TP * CP * PP); M = GBS / (micro batch * DP). Rules: world
    divisible by TP * CP * PP; seq_length divisible by 2 * CP (load-balanced CP split), times
    TP under sequence parallelism; heads, query groups, FFN size and vocabulary divisible by
    TP; sequence parallelism only with TP > 1; layers divisible by PP * VPP; GBS divisible by
    micro batch * DP; VPP only with PP >= 2 and a microbatch count the interleaved schedule
    can run; the cp_comm_type rules; combinations of options that one of them would ignore.
    """
    c = config
    _require(
        is_int(world_size) and world_size >= 1,
        f"--nproc-per-node must be an integer >= 1, got {world_size}",
    )
    check_fields(c)
    tp, cp, pp, vpp = (
        c.tensor_model_parallel_size,
        c.context_parallel_size,
        c.pipeline_model_parallel_size,
        c.virtual_pipeline_model_parallel_size,
    )
    model_parallel = tp * cp * pp
    sizes = f"--cp {cp} x --pp {pp}" if tp == 1 else f"--tp {tp} x --cp {cp} x --pp {pp}"
    _require(
        world_size % model_parallel == 0,
        f"world size {world_size} is not divisible by {sizes} = {model_parallel}; "
        f"use a multiple of {model_parallel} processes",
    )
    dp = world_size // model_parallel
    _require(
        c.seq_length >= 4 and c.seq_length % (2 * cp) == 0,
        f"--seq-length {c.seq_length} must be >= 4 and divisible by 2 x --cp = {2 * cp} "
        f"(context parallelism splits each sequence into 2C equal chunks)",
    )
    _check_tensor_parallel(c)
    if vpp is not None:
        _require(pp >= 2, f"--vpp {vpp} needs pipeline parallelism: --pp must be >= 2, got {pp}")
    chunks = pp * (vpp or 1)
    _require(
        c.num_layers % chunks == 0,
        f"--num-layers {c.num_layers} is not divisible among {chunks} pipeline chunks "
        f"(--pp {pp} x --vpp {vpp or 1}); use a multiple of {chunks} layers",
    )
    _require(
        c.kv_channels is not None or c.hidden_size % c.num_attention_heads == 0,
        f"--hidden-size {c.hidden_size} is not divisible by --num-attention-heads "
        f"{c.num_attention_heads}",
    )
    per_step = c.micro_batch_size * dp
    _require(
        c.global_batch_size % per_step == 0,
        f"--global-batch-size {c.global_batch_size} is not divisible by --micro-batch-size "
        f"{c.micro_batch_size} x data-parallel size {dp} = {per_step}",
    )
    num_microbatches = c.global_batch_size // per_step
    if vpp is not None:
        # Imported here: the self-launching process checks layouts without importing torch.
        from megatron.core.pipeline_parallel.schedules import interleaved_schedule_table

        try:
            interleaved_schedule_table(num_microbatches, vpp, pp, pp)
        except ValueError as exc:
            raise UsageError(
                f"--vpp {vpp}: {num_microbatches} microbatches per data-parallel replica "
                f"(--global-batch-size {c.global_batch_size} / (--micro-batch-size "
                f"{c.micro_batch_size} x DP {dp})) cannot be interleaved: {exc}"
            ) from None
    _check_cp_comm_type(c)
    if c.pack_sequences:
        _check_packing(c)
    _check_combinations(c)
    hierarchical = c.hierarchical_context_parallel_sizes
    return Layout(
        world_size,
        cp,
        pp,
        vpp,
        dp,
        num_microbatches,
        tp,
        c.sequence_parallel,
        None if hierarchical is None else tuple(hierarchical),
    )


def _check_combinations(c: TrainingConfig) -> None:
    """Options that need, or exclude, another one (so none is silently ignored)."""
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
    ):
        value = getattr(c, name)
        _require(
            value is None or value is False or c.load is not None,
            f"{option_of(_FIELDS[name]).flag}"
            f"{'' if isinstance(value, bool) else f' {value}'} needs --load DIR "
            "(nothing is loaded)",
        )
    _require(
        not (c.compare_single_process and c.load),
        "--compare-single-process compares a whole run from iteration 1; it cannot be "
        f"combined with --load {c.load}",
    )
    _require(
        c.lr_warmup_iters < c.train_iters,
        f"--lr-warmup-iters must be >= 0 and < --train-iters {c.train_iters}, "
        f"got {c.lr_warmup_iters}",
    )
    _require(c.min_lr <= c.lr, f"--min-lr must be in [0, --lr {c.lr}], got {c.min_lr}")
    _require(
        c.tokenizer is None or c.data_path is not None,
        f"--tokenizer {c.tokenizer!r} needs --data-path (the generated data has its own ids)",
    )
    _require(
        c.eod_token is None or c.tokenizer not in (None, "byte-level"),
        f"--eod-token {c.eod_token!r} needs --tokenizer DIR_OR_tokenizer.json (the byte-level "
        "tokenizer's end-of-document id is fixed)",
    )
    _require(
        c.data_path is None or c.vocab_size == _FIELDS["vocab_size"].default or c.hf_model,
        f"--vocab-size {c.vocab_size} is not used with --data-path: the vocabulary is the "
        "tokenizer's (see --tokenizer); leave --vocab-size out",
    )
    _require(
        c.min_lr == 0 or c.lr_decay_style != "constant",
        f"--min-lr {c.min_lr} is the end of a decay, but --lr-decay-style constant keeps "
        "--lr; use --lr-decay-style linear or cosine, or leave --min-lr out",
    )
    _require(
        c.compare_single_process or c.compare_tolerance == _FIELDS["compare_tolerance"].default,
        f"--compare-tolerance {c.compare_tolerance} needs --compare-single-process",
    )
    _require(not (c.bf16 and c.fp16), "--bf16 and --fp16 were both given; expected at most one")
    _require(
        c.position_embedding_type == "learned_absolute" or c.max_position_embeddings is None,
        f"--max-position-embeddings {c.max_position_embeddings} sizes the learned position "
        "table; --position-embedding-type rope has none",
    )
    _require(
        c.position_embedding_type != "learned_absolute"
        or (c.max_position_embeddings or c.seq_length) >= c.seq_length,
        f"--seq-length {c.seq_length} is longer than the learned position table "
        f"(--max-position-embeddings {c.max_position_embeddings})",
    )
    _require(
        c.position_embedding_type == "rope"
        or not (c.use_rope_scaling or c.rotary_base != _FIELDS["rotary_base"].default),
        "--use-rope-scaling and --rotary-base need --position-embedding-type rope",
    )
    _require(
        c.use_rope_scaling or c.rope_scaling_factor == _FIELDS["rope_scaling_factor"].default,
        f"--rope-scaling-factor {c.rope_scaling_factor} needs --use-rope-scaling",
    )
    _require(not (c.openai_gelu and c.swiglu), "--openai-gelu and --swiglu exclude each other")
    _require(
        c.min_loss_scale <= c.initial_loss_scale,
        f"--min-loss-scale {c.min_loss_scale} must be <= --initial-loss-scale "
        f"{c.initial_loss_scale}",
    )
    dynamic = [
        flag_of(name)
        for name in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
        if getattr(c, name) != _FIELDS[name].default
    ]
    _require(
        c.fp16 or not dynamic,
        f"{', '.join(dynamic)} set the dynamic loss scaling of --fp16, which is not given",
    )


def _check_packing(c: TrainingConfig) -> None:
    """--pack-sequences: one packed row per microbatch, documents padded to a multiple of
    PACK_PAD_MULTIPLE that the 2C context-parallel chunks divide."""
    # Imported here: the self-launching process checks layouts without importing torch.
    from megatron.training.data import PACK_PAD_MULTIPLE

    cp = c.context_parallel_size
    _require(
        c.micro_batch_size == 1,
        f"--pack-sequences packs documents into one row per microbatch: "
        f"--micro-batch-size must be 1, got {c.micro_batch_size}",
    )
    _require(
        c.seq_length % PACK_PAD_MULTIPLE == 0 and PACK_PAD_MULTIPLE % (2 * cp) == 0,
        f"--pack-sequences pads documents to a multiple of {PACK_PAD_MULTIPLE}: "
        f"--seq-length ({c.seq_length}) must be a multiple of it and 2 x --cp "
        f"({2 * cp}) must divide it",
    )


def _check_cp_comm_type(c: TrainingConfig) -> None:
    """--cp-comm-type: one kind or one per layer; a2a splits each tensor-parallel rank's
    heads over CP, a2a+p2p over the first of --hierarchical-context-parallel-sizes [A, P]
    (A x P = CP), which only a2a+p2p uses."""
    kinds = config_rules.cp_comm_kinds(c.cp_comm_type)
    _require(
        config_rules.cp_comm_type_length_ok(c.cp_comm_type, c.num_layers),
        f"--cp-comm-type takes one kind or one per layer (--num-layers {c.num_layers}), got "
        f"{len(kinds)}: {kinds}",
    )
    bad = config_rules.unknown_cp_comm_types(c.cp_comm_type) + [k for k in kinds if k is None]
    _require(not bad, f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got {bad}")
    tp, cp = c.tensor_model_parallel_size, c.context_parallel_size
    _require(
        cp > 1 or set(kinds) == {_FIELDS["cp_comm_type"].default},
        f"--cp-comm-type {' '.join(map(str, kinds))} chooses how context-parallel attention "
        f"exchanges keys and values, but --cp is {cp}: nothing is exchanged; use --cp > 1 "
        "or leave --cp-comm-type out",
    )
    hierarchical = c.hierarchical_context_parallel_sizes
    if hierarchical is not None:
        _require(
            config_rules.hierarchical_sizes_valid(hierarchical)
            and len(hierarchical) == 2
            and config_rules.hierarchical_sizes_product(hierarchical) == cp,
            f"--hierarchical-context-parallel-sizes takes two sizes [A, P] with A x P = --cp "
            f"{cp}, got {hierarchical!r}",
        )
        _require(
            "a2a+p2p" in kinds,
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, hierarchical))} is "
            f"used only by --cp-comm-type a2a+p2p; got --cp-comm-type "
            f"{' '.join(map(str, kinds))}: drop the sizes or use a2a+p2p",
        )
    _require(
        "a2a+p2p" not in kinds or cp == 1 or hierarchical is not None,
        f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (A x P = --cp "
        f"{cp}): heads all-to-all within A ranks, the ring over P",
    )
    heads, groups = c.num_attention_heads, c.num_query_groups or c.num_attention_heads
    for kind, split, flag in (("a2a", cp, "--cp"), ("a2a+p2p", (hierarchical or [1])[0], "A")):
        _require(
            kind not in kinds or (heads % (tp * split) == 0 and groups % (tp * split) == 0),
            f"--cp-comm-type {kind} splits each tensor-parallel rank's heads over {flag}: "
            f"--num-attention-heads ({heads}) and the query groups ({groups}) must be "
            f"divisible by --tp x {flag} = {tp * split}",
        )


def _check_tensor_parallel(c: TrainingConfig) -> None:
    """The sizes TP splits (heads, query groups, FFN, vocabulary: the shared rule of
    ``config_rules``); the sequence under sequence parallelism (2C chunks, each split over
    TP); an even head size for rotary embeddings."""
    tp, cp = c.tensor_model_parallel_size, c.context_parallel_size
    _require(
        config_rules.sequence_parallel_allowed(c.sequence_parallel, tp),
        f"--sequence-parallel needs tensor parallelism: --tp must be > 1, got {tp}",
    )
    heads = c.num_attention_heads
    groups = heads if c.num_query_groups is None else c.num_query_groups
    _require(
        config_rules.is_positive_multiple(heads, groups),
        f"--num-query-groups {groups} must be an integer >= 1 dividing --num-attention-heads "
        f"{heads}",
    )
    ffn = 4 * c.hidden_size if c.ffn_hidden_size is None else c.ffn_hidden_size
    splits = {
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "ffn_hidden_size": ffn,
        "vocab_size": c.vocab_size,
    }
    for name, value in config_rules.tensor_parallel_misfits(tp, splits):
        raise UsageError(f"{flag_of(name)} {value} is not divisible by --tp {tp}")
    if c.position_embedding_type == "rope":
        head_dim = c.kv_channels or c.hidden_size // heads
        _require(
            head_dim % 2 == 0,
            f"--position-embedding-type rope needs an even head size, got --hidden-size "
            f"{c.hidden_size} / --num-attention-heads {heads} = {head_dim}",
        )
    if c.sequence_parallel:
        _require(
            c.seq_length % (2 * cp * tp) == 0,
            f"--seq-length {c.seq_length} is not divisible by --tp {tp} x 2 x --cp {cp} = "
            f"{2 * cp * tp} (sequence parallelism splits each of the 2C chunks over TP)",
        )


def single_process_config(config: TrainingConfig) -> TrainingConfig:
    """The same run on one process: TP = CP = PP = 1, no VPP, no comparison, no metrics,
    no checkpoints (those options back at their defaults)."""
    changes = {f.name: getattr(config, f.name) for f in fields(config)}
    layout_and_output = (
        "tensor_model_parallel_size",
        "sequence_parallel",
        "context_parallel_size",
        "cp_comm_type",
        "hierarchical_context_parallel_sizes",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "compare_single_process",
        "compare_tolerance",
        "save_metrics",
        "save",
        "load",
        "save_interval",
        "ckpt_step",
        "finetune",
        "no_load_optim",
        "no_load_rng",
        "exit_on_missing_checkpoint",
        "export_hf",
    )
    changes.update({name: _FIELDS[name].default for name in layout_and_output})
    changes.update(nproc_per_node=1)
    return TrainingConfig(**changes)


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m megatron.training`` / ``megatron-train`` command line, one option per
    ``TrainingConfig`` field (``options.build_parser``)."""
    description = (
        "Supervised fine-tuning of a small GPT on generated prompt/response pairs "
        "(prompt tokens masked out of the loss), under any tensor/context/pipeline/"
        "virtual-pipeline/data-parallel layout. CPU (gloo) by default, NCCL when every "
        "process has a GPU. The logged loss is the same for every layout."
    )
    return options.build_parser(
        TrainingConfig, "python -m megatron.training", description, _SECTIONS
    )


def parse_args(argv: Optional[Sequence[str]] = None) -> TrainingConfig:
    """Parse the command line into a ``TrainingConfig`` (no checks: ``validate_config``); a
    mistake raises ``UsageError``."""
    return options.parse(build_parser(), TrainingConfig, argv)


def explicit_options(argv: Sequence[str]) -> List[str]:
    """The ``TrainingConfig`` fields that ``argv`` gives explicitly (whatever their value)."""
    return options.explicit_fields(build_parser(), argv)


# ----------------------------------------------------------------------------- checks


def _require(condition: bool, message: str) -> None:
    """Raise UsageError(message) (a ValueError) unless ``condition``."""
    if not condition:
        raise UsageError(message)
