"""The main job's settings: one dataclass, its command line, and the layout it implies.

Every default (model size, batch sizes, sequence length, iterations) is independent of the
parallel layout, so two runs that differ only in ``--cp/--pp/--vpp/--nproc-per-node`` train
on the same data with the same objective. ``validate_config`` rejects impossible layouts
with a message naming the flag, the value and what was expected; it runs before any process
group exists, identically on every rank.
"""

import argparse
from dataclasses import dataclass, fields
from typing import List, Optional, Sequence, Tuple, Union

LR_DECAY_STYLES = ("constant", "linear", "cosine")
CP_COMM_TYPES = ("all_gather", "p2p", "a2a", "a2a+p2p")  # transformer_config's (no torch here)


@dataclass
class TrainingConfig:
    """Settings of one run (CLI flag ``--foo-bar`` is field ``foo_bar``)."""

    # Layout. DP = world / (TP * CP * PP).
    nproc_per_node: Optional[int] = None
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    distributed_backend: str = "auto"
    cp_comm_type: Union[str, List[str]] = "all_gather"  # one kind, or one per layer
    hierarchical_context_parallel_sizes: Optional[List[int]] = None  # [A, P] for a2a+p2p
    # Data and batches.
    micro_batch_size: int = 2
    global_batch_size: int = 8
    seq_length: int = 32
    vocab_size: int = 64
    data_path: Optional[str] = None
    tokenizer: Optional[str] = None
    pack_sequences: bool = False
    # Model.
    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    normalization: str = "LayerNorm"
    swiglu: bool = False
    position_embedding_type: str = "learned_absolute"
    disable_bias_linear: bool = False
    label_smoothing: float = 0.0
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = False
    # Optimization.
    train_iters: int = 20
    lr: float = 3e-3
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "constant"
    min_lr: float = 0.0
    clip_grad: float = 1.0
    calculate_per_token_loss: bool = False
    per_shard_loss_normalization: bool = False
    overlap_grad_reduce: bool = False
    gradient_accumulation_fusion: bool = False
    seed: int = 1234
    # Output and checks.
    save_metrics: Optional[str] = None
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    ckpt_step: Optional[int] = None
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    compare_single_process: bool = False
    compare_tolerance: float = 1e-4
    progress: bool = True


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

    DP = world / (TP * CP * PP); M = GBS / (micro batch * DP). Checks: positive sizes;
    world divisible by TP * CP * PP; seq_length divisible by 2 * CP (load-balanced CP
    split), times TP under sequence parallelism; heads, query groups, FFN size and
    vocabulary divisible by TP; sequence parallelism only with TP > 1; layers divisible by
    PP * VPP; GBS divisible by micro batch * DP; VPP only with PP >= 2 and a microbatch
    count the interleaved schedule can run.
    """
    c = config
    for flag, value in [
        ("--nproc-per-node", world_size),
        ("--tp", c.tensor_model_parallel_size),
        ("--cp", c.context_parallel_size),
        ("--pp", c.pipeline_model_parallel_size),
        ("--micro-batch-size", c.micro_batch_size),
        ("--global-batch-size", c.global_batch_size),
        ("--num-layers", c.num_layers),
        ("--hidden-size", c.hidden_size),
        ("--num-attention-heads", c.num_attention_heads),
        ("--train-iters", c.train_iters),
    ]:
        _require(
            isinstance(value, int) and value >= 1, f"{flag} must be an integer >= 1, got {value}"
        )
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
        _require(isinstance(vpp, int) and vpp >= 1, f"--vpp must be an integer >= 1, got {vpp}")
        _require(pp >= 2, f"--vpp {vpp} needs pipeline parallelism: --pp must be >= 2, got {pp}")
    chunks = pp * (vpp or 1)
    _require(
        c.num_layers % chunks == 0,
        f"--num-layers {c.num_layers} is not divisible among {chunks} pipeline chunks "
        f"(--pp {pp} x --vpp {vpp or 1}); use a multiple of {chunks} layers",
    )
    _require(
        c.hidden_size % c.num_attention_heads == 0,
        f"--hidden-size {c.hidden_size} is not divisible by --num-attention-heads "
        f"{c.num_attention_heads}",
    )
    _require(c.vocab_size >= 5, f"--vocab-size must be >= 5, got {c.vocab_size}")
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
            raise ValueError(
                f"--vpp {vpp}: {num_microbatches} microbatches per data-parallel replica "
                f"(--global-batch-size {c.global_batch_size} / (--micro-batch-size "
                f"{c.micro_batch_size} x DP {dp})) cannot be interleaved: {exc}"
            ) from None
    _check_cp_comm_type(c)
    if c.pack_sequences:
        # Imported here: the self-launching process checks layouts without importing torch.
        from megatron.training.data import PACK_PAD_MULTIPLE

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
        _require(
            c.data_path is None,
            f"--pack-sequences packs the generated prompt/response pairs; it cannot be "
            f"combined with --data-path (got {c.data_path!r})",
        )
    _require(
        not (c.per_shard_loss_normalization and c.calculate_per_token_loss),
        "--per-shard-loss-normalization emulates the averaged mode; it cannot be combined "
        "with --calculate-per-token-loss",
    )
    if c.save_interval is not None:
        _require(
            isinstance(c.save_interval, int) and c.save_interval >= 1,
            f"--save-interval must be an integer >= 1, got {c.save_interval}",
        )
        _require(c.save is not None, "--save-interval needs --save DIR")
    _check_load_options(c)
    _require(
        not (c.compare_single_process and c.load),
        "--compare-single-process compares a whole run from iteration 1; it cannot be "
        f"combined with --load {c.load}",
    )
    _require(c.lr > 0, f"--lr must be > 0, got {c.lr}")
    _require(
        c.lr_decay_style in LR_DECAY_STYLES,
        f"--lr-decay-style must be one of {', '.join(LR_DECAY_STYLES)}, got {c.lr_decay_style!r}",
    )
    _require(
        isinstance(c.lr_warmup_iters, int) and 0 <= c.lr_warmup_iters < c.train_iters,
        f"--lr-warmup-iters must be >= 0 and < --train-iters {c.train_iters}, "
        f"got {c.lr_warmup_iters}",
    )
    _require(0 <= c.min_lr <= c.lr, f"--min-lr must be in [0, --lr {c.lr}], got {c.min_lr}")
    _require(c.weight_decay >= 0, f"--weight-decay must be >= 0, got {c.weight_decay}")
    _require(
        c.tokenizer is None or c.data_path is not None,
        f"--tokenizer {c.tokenizer!r} needs --data-path (the generated data has its own ids)",
    )
    _require(c.clip_grad >= 0, f"--clip-grad must be >= 0 (0 disables), got {c.clip_grad}")
    _require(
        c.distributed_backend in ("auto", "gloo", "nccl"),
        f"--distributed-backend must be auto, gloo or nccl, got {c.distributed_backend!r}",
    )
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


def _check_load_options(c: TrainingConfig) -> None:
    """--ckpt-step, --finetune, --no-load-optim, --no-load-rng act on --load."""
    for flag, given in (
        (f"--ckpt-step {c.ckpt_step}", c.ckpt_step is not None),
        ("--finetune", c.finetune),
        ("--no-load-optim", c.no_load_optim),
        ("--no-load-rng", c.no_load_rng),
    ):
        _require(not given or c.load is not None, f"{flag} needs --load DIR (nothing is loaded)")
    _require(
        c.ckpt_step is None or (isinstance(c.ckpt_step, int) and c.ckpt_step >= 0),
        f"--ckpt-step must be an integer >= 0, got {c.ckpt_step}",
    )


def _check_cp_comm_type(c: TrainingConfig) -> None:
    """--cp-comm-type: one kind or one per layer; a2a splits each tensor-parallel rank's
    heads over CP, a2a+p2p over the first of --hierarchical-context-parallel-sizes [A, P]
    (A x P = CP)."""
    kinds = [c.cp_comm_type] if isinstance(c.cp_comm_type, str) else list(c.cp_comm_type)
    _require(
        len(kinds) in (1, c.num_layers),
        f"--cp-comm-type takes one kind or one per layer (--num-layers {c.num_layers}), got "
        f"{len(kinds)}: {kinds}",
    )
    bad = [k for k in kinds if k not in CP_COMM_TYPES]
    _require(not bad, f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got {bad}")
    tp, cp = c.tensor_model_parallel_size, c.context_parallel_size
    hierarchical = c.hierarchical_context_parallel_sizes
    if hierarchical is not None:
        _require(
            len(hierarchical) == 2 and all(isinstance(x, int) and x >= 1 for x in hierarchical)
            and hierarchical[0] * hierarchical[1] == cp,
            f"--hierarchical-context-parallel-sizes takes two sizes [A, P] with A x P = --cp "
            f"{cp}, got {list(hierarchical)}",
        )  # fmt: skip
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
    """The model options and the sizes TP splits: heads, query groups, FFN, vocabulary; the
    sequence under sequence parallelism (2C chunks, each split over TP)."""
    tp, cp = c.tensor_model_parallel_size, c.context_parallel_size
    _require(
        c.normalization in ("LayerNorm", "RMSNorm"),
        f"--normalization must be LayerNorm or RMSNorm, got {c.normalization!r}",
    )
    _require(
        c.position_embedding_type in ("learned_absolute", "rope"),
        f"--position-embedding-type must be learned_absolute or rope, got "
        f"{c.position_embedding_type!r}",
    )
    _require(
        0.0 <= c.label_smoothing < 1.0,
        f"--label-smoothing must be in [0, 1), got {c.label_smoothing}",
    )
    _require(
        not c.sequence_parallel or tp > 1,
        f"--sequence-parallel needs tensor parallelism: --tp must be > 1, got {tp}",
    )
    heads = c.num_attention_heads
    _require(
        heads % tp == 0,
        f"--num-attention-heads {heads} is not divisible by --tp {tp}",
    )
    groups = heads if c.num_query_groups is None else c.num_query_groups
    _require(
        isinstance(groups, int) and groups >= 1 and heads % groups == 0,
        f"--num-query-groups {groups} must be an integer >= 1 dividing --num-attention-heads "
        f"{heads}",
    )
    _require(groups % tp == 0, f"--num-query-groups {groups} is not divisible by --tp {tp}")
    ffn = 4 * c.hidden_size if c.ffn_hidden_size is None else c.ffn_hidden_size
    _require(
        isinstance(ffn, int) and ffn >= 1 and ffn % tp == 0,
        f"--ffn-hidden-size {ffn} must be an integer >= 1 divisible by --tp {tp}",
    )
    _require(
        c.vocab_size % tp == 0,
        f"--vocab-size {c.vocab_size} is not divisible by --tp {tp}",
    )
    if c.position_embedding_type == "rope":
        head_dim = c.hidden_size // heads
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
    """The same run on one process: TP = CP = PP = 1, no VPP, no comparison, no metrics."""
    changes = {f.name: getattr(config, f.name) for f in fields(config)}
    changes.update(
        nproc_per_node=1,
        tensor_model_parallel_size=1,
        sequence_parallel=False,
        context_parallel_size=1,
        hierarchical_context_parallel_sizes=None,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        compare_single_process=False,
        save_metrics=None,
        save=None,
        load=None,
        save_interval=None,
        ckpt_step=None,
        finetune=False,
        no_load_optim=False,
        no_load_rng=False,
    )
    return TrainingConfig(**changes)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m megatron.training`` / ``megatron-train`` command line."""
    d = TrainingConfig()
    parser = argparse.ArgumentParser(
        prog="python -m megatron.training",
        description=(
            "Supervised fine-tuning of a small GPT on generated prompt/response pairs "
            "(prompt tokens masked out of the loss), under any context/pipeline/virtual-"
            "pipeline/data-parallel layout. CPU (gloo) by default, NCCL when every process "
            "has a GPU. The logged loss is the same for every layout."
        ),
        formatter_class=_HelpFormatter,
    )
    layout = parser.add_argument_group("layout")
    layout.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        default=d.nproc_per_node,
        help="processes to launch (with torch.distributed.run) when not already under "
        "torchrun; default: 1. Under torchrun it must match the launch, or be left out",
    )
    layout.add_argument(
        "--tp",
        "--tensor-model-parallel-size",
        dest="tensor_model_parallel_size",
        type=int,
        metavar="T",
        default=d.tensor_model_parallel_size,
        help="tensor-parallel size T (heads, FFN and vocabulary split over T ranks)",
    )
    layout.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp > 1: norms, dropout and residuals on a 1/T share of the sequence",
    )
    layout.add_argument(
        "--cp",
        "--context-parallel-size",
        dest="context_parallel_size",
        type=int,
        metavar="C",
        default=d.context_parallel_size,
        help="context-parallel size C (each sequence split into 2C chunks)",
    )
    layout.add_argument(
        "--pp",
        "--pipeline-model-parallel-size",
        dest="pipeline_model_parallel_size",
        type=int,
        metavar="P",
        default=d.pipeline_model_parallel_size,
        help="pipeline-parallel size",
    )
    layout.add_argument(
        "--vpp",
        "--num-virtual-stages-per-pipeline-rank",
        dest="virtual_pipeline_model_parallel_size",
        type=int,
        metavar="V",
        default=d.virtual_pipeline_model_parallel_size,
        help="model chunks per pipeline rank (interleaved schedule); default: none",
    )
    layout.add_argument(
        "--cp-comm-type",
        nargs="+",
        choices=CP_COMM_TYPES,
        default=d.cp_comm_type,
        metavar="KIND",
        help="how context-parallel attention brings keys to queries (megatron-core's "
        "cp_comm_type), one kind or one per layer: all_gather (K/V gathered per head "
        "group), p2p (the load-balanced ring), a2a (heads all-to-all) or a2a+p2p (heads "
        "all-to-all within A ranks, the ring over P)",
    )
    layout.add_argument(
        "--hierarchical-context-parallel-sizes",
        nargs=2,
        type=int,
        metavar=("A", "P"),
        default=d.hierarchical_context_parallel_sizes,
        help="the two levels of --cp for a2a+p2p: A consecutive ranks exchange heads, the "
        "ring runs over P (A x P = --cp)",
    )
    layout.add_argument(
        "--distributed-backend",
        choices=["auto", "gloo", "nccl"],
        default=d.distributed_backend,
        help="auto: nccl when every local process has a GPU, else gloo",
    )
    data = parser.add_argument_group("data and batches")
    _add(data, "--micro-batch-size", int, d.micro_batch_size, "sequences per microbatch")
    _add(
        data,
        "--global-batch-size",
        int,
        d.global_batch_size,
        "sequences per step, over all data-parallel replicas and microbatches",
    )
    _add(data, "--seq-length", int, d.seq_length, "tokens per sequence")
    _add(data, "--vocab-size", int, d.vocab_size, "vocabulary size (4 special tokens)")
    data.add_argument(
        "--data-path",
        metavar="PATH",
        default=d.data_path,
        help="train on a JSONL file (prompt/response or text records; the prompt is masked "
        "out of the loss) or an indexed dataset prefix written by python -m "
        "megatron.training.preprocess_data; the vocabulary is then the tokenizer's. "
        "Default: generated prompt/response pairs",
    )
    data.add_argument(
        "--tokenizer",
        metavar="T",
        default=d.tokenizer,
        help="with --data-path: 'byte-level' (default; UTF-8 bytes, no file) or a "
        "HuggingFace tokenizers JSON file",
    )
    data.add_argument(
        "--pack-sequences",
        action="store_true",
        help="pack prompt/response pairs into rows of --seq-length tokens (THD format: "
        "documents never attend to each other, each padded to a multiple of 16, padding "
        "and prompts masked out of the loss); needs --micro-batch-size 1",
    )
    model = parser.add_argument_group("model")
    _add(model, "--num-layers", int, d.num_layers, "transformer layers")
    _add(model, "--hidden-size", int, d.hidden_size, "hidden size")
    _add(model, "--num-attention-heads", int, d.num_attention_heads, "attention heads")
    model.add_argument(
        "--num-query-groups",
        type=int,
        default=d.num_query_groups,
        help="key/value head groups (grouped-query attention); default: one per head",
    )
    model.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=d.ffn_hidden_size,
        help="MLP hidden size; default: 4 x hidden size",
    )
    model.add_argument(
        "--normalization",
        choices=["LayerNorm", "RMSNorm"],
        default=d.normalization,
        help="normalization layer",
    )
    model.add_argument(
        "--swiglu",
        action="store_true",
        help="gated MLP silu(x W_gate) * (x W_up) instead of gelu(x W_1)",
    )
    model.add_argument(
        "--position-embedding-type",
        choices=["learned_absolute", "rope"],
        default=d.position_embedding_type,
        help="learned absolute positions or rotary embeddings",
    )
    model.add_argument(
        "--disable-bias-linear",
        action="store_true",
        help="no biases in the linear layers",
    )
    _add(
        model,
        "--label-smoothing",
        float,
        d.label_smoothing,
        "label smoothing of the cross-entropy over the whole vocabulary",
    )
    _add(model, "--init-method-std", float, d.init_method_std, "std of initial weights")
    model.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="separate output layer (default: tied to the word embeddings)",
    )
    optim = parser.add_argument_group("optimization")
    _add(optim, "--train-iters", int, d.train_iters, "training iterations")
    _add(optim, "--lr", float, d.lr, "peak Adam learning rate")
    _add(optim, "--min-lr", float, d.min_lr, "learning rate at the end of the decay")
    _add(optim, "--lr-warmup-iters", int, d.lr_warmup_iters, "linear warm-up from 0")
    optim.add_argument(
        "--lr-decay-style",
        choices=LR_DECAY_STYLES,
        default=d.lr_decay_style,
        help="learning-rate decay after warm-up, down to --min-lr at --train-iters",
    )
    _add(optim, "--adam-beta1", float, d.adam_beta1, "Adam beta1")
    _add(optim, "--adam-beta2", float, d.adam_beta2, "Adam beta2")
    _add(optim, "--adam-eps", float, d.adam_eps, "Adam epsilon")
    _add(optim, "--weight-decay", float, d.weight_decay, "decoupled weight decay (AdamW)")
    _add(optim, "--clip-grad", float, d.clip_grad, "gradient-norm clipping threshold, 0: off")
    optim.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="train sum(loss)/sum(tokens) over the global batch instead of the mean over "
        "microbatches of each microbatch's token mean",
    )
    optim.add_argument(
        "--per-shard-loss-normalization",
        action="store_true",
        help="negative control: train megatron-core 0.16.1's objective, each CP shard's "
        "loss divided by its own valid-token count and averaged over shards; with --cp > 1 "
        "on prompt-masked data it drifts from the one-process run",
    )
    optim.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="reduce gradient buckets asynchronously during the backward",
    )
    optim.add_argument(
        "--gradient-accumulation-fusion",
        action="store_true",
        help="linear layers add their weight gradients into the fp32 main_grad inside the "
        "GEMM (megatron-core's gradient_accumulation_fusion)",
    )
    _add(optim, "--seed", int, d.seed, "seed of the weights and of the generated data")
    out = parser.add_argument_group("output and checks")
    out.add_argument(
        "--save-metrics",
        metavar="DIR",
        default=d.save_metrics,
        help="write DIR/metrics.jsonl (one line per iteration) and DIR/loss.png",
    )
    out.add_argument(
        "--compare-single-process",
        action="store_true",
        help="also train on one process and compare the losses per iteration; exit 1 when "
        "they differ by more than --compare-tolerance",
    )
    _add(
        out,
        "--compare-tolerance",
        float,
        d.compare_tolerance,
        "largest accepted |loss difference| per iteration",
    )
    ckpt = parser.add_argument_group("checkpoints (docs/checkpoints.md)")
    ckpt.add_argument(
        "--save",
        metavar="DIR",
        default=d.save,
        help="save checkpoints to DIR/iter_NNNNNNN (every --save-interval iterations and at "
        "the end) and point DIR/latest_checkpointed_iteration.txt at the newest",
    )
    ckpt.add_argument(
        "--load",
        metavar="DIR",
        default=d.load,
        help="resume from the newest complete checkpoint in DIR, or from DIR itself when it "
        "is one checkpoint's iter_NNNNNNN directory (any layout). No checkpoint there is an "
        "error, except when DIR is also --save (auto-resume: starts from scratch). Settings "
        "that change the model or the data must equal the saved ones",
    )
    _add(ckpt, "--save-interval", int, d.save_interval, "iterations between checkpoints")
    ckpt.add_argument(
        "--ckpt-step",
        type=int,
        metavar="N",
        default=d.ckpt_step,
        help="with --load DIR: load DIR/iter_N instead of the newest checkpoint",
    )
    ckpt.add_argument(
        "--finetune",
        action="store_true",
        help="with --load: load the model weights only (no optimizer, scheduler or RNG "
        "state) and start at iteration 0; --data-path may differ from the saved run's",
    )
    ckpt.add_argument(
        "--no-load-optim",
        action="store_true",
        help="with --load: do not load the optimizer and scheduler state",
    )
    ckpt.add_argument(
        "--no-load-rng",
        action="store_true",
        help="with --load: do not restore the RNG states",
    )
    out.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="hide the progress bar (rank 0 shows one by default)",
    )
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> TrainingConfig:
    """Parse the command line into a ``TrainingConfig`` (no layout checks)."""
    args = build_parser().parse_args(argv)
    if isinstance(args.cp_comm_type, list) and len(args.cp_comm_type) == 1:
        args.cp_comm_type = args.cp_comm_type[0]  # one kind for every layer
    return TrainingConfig(**vars(args))


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show the default of options that take a value (not of switches, not of None)."""

    def _get_help_string(self, action):
        if action.nargs == 0 or action.default is None:
            return action.help
        return super()._get_help_string(action)


def _add(group, flag: str, kind: type, default, help_text: str) -> None:
    """Add a plain ``--flag VALUE`` option."""
    group.add_argument(flag, type=kind, default=default, help=help_text)


def _require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless ``condition``."""
    if not condition:
        raise ValueError(message)
