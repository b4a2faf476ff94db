"""The main job's settings: one dataclass whose fields declare their command line.

Each field of ``TrainingConfig`` is declared once, with ``option(default, "--flag", ...,
kind=..., help=..., check=...)`` (``megatron.training.options``): its flag (the first one
names it in errors; later ones are aliases, megatron's long names among them), its kind
(model, data, precision, optimizer, layout, output or run: what a resume compares, what the
one-process comparison resets, what ``--load`` adopts), its help text and the check of its
own value. The ``argparse`` parser is generated from the fields (``build_parser``), and
``command_line`` writes a config back as flags. The rules between fields and the layout they
imply are in ``megatron.training.validation`` (``validate_config``); the derived model
defaults in ``megatron.training.model_settings`` (``resolved_model``).

Every default (model size, batch sizes, sequence length, iterations) is independent of the
parallel layout, so two runs that differ only in ``--cp/--pp/--vpp/--nproc-per-node`` train
on the same data with the same objective. This module imports no torch (the launcher parses
and checks the command line before starting the workers).

Why one module of more than 700 lines: it is one concern, the trainer's list of flags (one
declaration of 5-10 lines each, about 85 of them, in their ``--help`` sections); splitting
the list would only scatter where a flag is declared.
"""

import argparse
from dataclasses import Field, dataclass, fields
from typing import Dict, List, Optional, Sequence, Union

from megatron.core import config_rules
from megatron.core.config_rules import ATTENTION_BACKENDS, CP_COMM_TYPES, NORMALIZATIONS
from megatron.core.fp8.config import FP8_RECIPES
from megatron.training import options
from megatron.training.model_settings import resolved_model
from megatron.training.options import (
    DATA,
    DDP_CONFIG,
    GPT_MODEL,
    LAYOUT,
    LORA_CONFIG,
    MODEL,
    OPTIMIZER,
    OUTPUT,
    PRECISION,
    RUN,
    SCHEDULER,
    Check,
    Option,
    Sets,
    command_line,
    is_int,
    is_number,
    loss_scale_number,
    non_negative,
    non_negative_number,
    one_of,
    option,
    option_of,
    positive,
    positive_number,
    unit_interval,
)
from megatron.training.validation import Layout, validate_config

LR_DECAY_STYLES = ("constant", "linear", "cosine")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn")
ROPE_TYPES = ("rope", "yarn")
DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")
OPTIMIZERS = ("adam", "sgd")

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
    "resolved_model",
    "single_process_config",
    "validate_config",
]


# Signals no handler can catch (the kernel acts on them directly).
_UNCATCHABLE_SIGNALS = ("SIGKILL", "SIGSTOP")


def catchable_signals() -> List[str]:
    """The names of the signal module's ``Signals`` a handler can catch (SIGTERM, ...)."""
    import signal

    return [name for name in signal.Signals.__members__ if name not in _UNCATCHABLE_SIGNALS]


def _is_signal_name(name: object) -> bool:
    """A name of a catchable signal (``catchable_signals``)."""
    return isinstance(name, str) and name in catchable_signals()


def _yarn(c) -> bool:
    return c.position_embedding_type == "yarn"


def _moe(field: str, value=None, from_layout: bool = False) -> Sets:
    """A ``TransformerConfig`` MoE field, set only with ``--num-experts``."""
    return Sets(
        field, value=value, when=lambda c: c.num_experts is not None, from_layout=from_layout
    )


def moe_freq_type(text: str) -> Union[int, List[int]]:
    """A ``--moe-layer-freq`` entry: an int, or megatron's list expression ("([0]*1+[1]*3)",
    "[0,1,1,1]": lists of ints, ``*`` by an int, ``+``), evaluated without ``eval``."""
    import ast

    def value(node):
        if isinstance(node, ast.Constant) and is_int(node.value):
            return node.value
        if isinstance(node, ast.List):
            items = [value(e) for e in node.elts]
            if all(is_int(i) for i in items):
                return items
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) == isinstance(right, list):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, list) and is_int(right):
                return left * right
        raise ValueError(text)

    try:
        return value(ast.parse(text.strip().strip("'\""), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        raise argparse.ArgumentTypeError(
            f"--moe-layer-freq {text!r}: expected an int N, 0/1 entries or a list expression "
            'such as "([0]*1+[1]*3)"'
        ) from None


def _mla(field: str) -> Sets:
    """An ``MLATransformerConfig`` field, set only with ``--multi-latent-attention``."""
    return Sets(field, when=_mla_on)


def _mla_on(c) -> bool:
    return c.multi_latent_attention


def _mla_yarn_factor(c, _layout) -> float:
    """``--rotary-scaling-factor`` for multi-latent attention (megatron's default 1)."""
    return 1.0 if c.rotary_scaling_factor is None else c.rotary_scaling_factor


def _fusion(field: str) -> Sets:
    """One of megatron-core's fusion switches, on with ``--compile`` (torch.compile'd
    functions); ``bias_activation_fusion`` stays off for OpenAI's tanh GELU and GPT-OSS's
    gated unit (--quick-geglu, an offset or a clamp), which it does not fuse."""

    def value(config, _layout) -> bool:
        tanh_gelu = config.openai_gelu and not config.swiglu
        gpt_oss = config.quick_geglu or config.glu_linear_offset
        gpt_oss = gpt_oss or config.activation_func_clamp_value is not None
        unfused = field == "bias_activation_fusion" and (tanh_gelu or gpt_oss)
        return config.compile and not unfused

    return Sets(field, value=value)


# megatron-core's fusion switches, set by --compile.
FUSIONS = (
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",
)
_FUSION_SWITCHES = tuple(_fusion(field) for field in FUSIONS)


# Where --hf-model's help names the families: the converter's registry fills it in
# (``build_parser(hf_families=...)``; the converter imports this module, not the reverse).
HF_FAMILIES = "the HuggingFace families listed"


# --help sections: the field that opens each one (the following fields belong to it).
_SECTIONS = {
    "nproc_per_node": "layout",
    "micro_batch_size": "data and batches",
    "num_layers": "model",
    "train_iters": "optimization",
    "bf16": "mixed precision (docs/mixed_precision.md)",
    "eval_interval": "validation (docs/lifecycle.md)",
    "lora_dim": "LoRA (docs/lora.md)",
    "log_interval": "logging (docs/lifecycle.md)",
    "save_metrics": "output and checks",
    "save": "checkpoints (docs/checkpoints.md)",
    "compare_single_process": "output and checks",
}


@dataclass
class TrainingConfig:
    """Settings of one run (CLI flag ``--foo-bar`` is field ``foo_bar``, with the aliases
    ``--tp``, ``--cp``, ``--pp``, ``--vpp``)."""

    # Every field is one ``option(...)`` declaration of the same shape (``duplicates`` pairs
    # ~100 of them): the table of flags, kept one entry per flag (module docstring).

    # Layout. DP = world / (TP * CP * PP).
    nproc_per_node: Optional[int] = option(
        None,
        "--nproc-per-node",
        kind=LAYOUT,
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
        kind=LAYOUT,
        library=Sets("tensor_model_parallel_size", from_layout=True),
        metavar="T",
        check=positive,
        help="tensor-parallel size T (heads, FFN and vocabulary split over T ranks)",
    )
    sequence_parallel: bool = option(
        False,
        "--sequence-parallel",
        kind=LAYOUT,
        library="sequence_parallel",
        help="with --tp > 1: norms, dropout and residuals on a 1/T share of the sequence",
    )
    context_parallel_size: int = option(
        1,
        "--cp",
        "--context-parallel-size",
        kind=LAYOUT,
        library=Sets("context_parallel_size", from_layout=True),
        metavar="C",
        check=positive,
        help="context-parallel size C (each sequence split into 2C chunks)",
    )
    pipeline_model_parallel_size: int = option(
        1,
        "--pp",
        "--pipeline-model-parallel-size",
        kind=LAYOUT,
        library=Sets("pipeline_model_parallel_size", from_layout=True),
        metavar="P",
        check=positive,
        help="pipeline-parallel size",
    )
    virtual_pipeline_model_parallel_size: Optional[int] = option(
        None,
        "--vpp",
        "--num-virtual-stages-per-pipeline-rank",
        kind=LAYOUT,
        library=Sets("virtual_pipeline_model_parallel_size", from_layout=True),
        type=int,
        metavar="V",
        check=positive,
        help="model chunks per pipeline rank (interleaved schedule); default: none",
    )
    distributed_backend: str = option(
        "auto",
        "--distributed-backend",
        kind=RUN,
        choices=DISTRIBUTED_BACKENDS,
        check=one_of(DISTRIBUTED_BACKENDS),
        help="auto: nccl when every local process has a GPU, else gloo; one process "
        "without torchrun then computes on cuda:0 too (a one-process nccl group)",
    )
    cp_comm_type: Union[str, List[str]] = option(
        "all_gather",
        "--cp-comm-type",
        kind=LAYOUT,
        library="cp_comm_type",
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
        kind=LAYOUT,
        library=Sets(
            "hierarchical_context_parallel_sizes", value=lambda c, layout: layout.hierarchical_sizes
        ),
        nargs=2,
        type=int,
        metavar=("A", "P"),
        help="the two levels of --cp for --cp-comm-type a2a+p2p: A consecutive ranks "
        "exchange heads, the ring runs over P (A x P = --cp)",
    )
    # Data and batches.
    micro_batch_size: int = option(
        2, "--micro-batch-size", kind=RUN, check=positive, help="sequences per microbatch"
    )
    global_batch_size: int = option(
        8,
        "--global-batch-size",
        kind=RUN,
        check=positive,
        help="sequences per step, over all data-parallel replicas and microbatches",
    )
    seq_length: int = option(
        32, "--seq-length", kind=MODEL, check=positive, help="tokens per sequence"
    )
    vocab_size: int = option(
        64,
        "--vocab-size",
        kind=MODEL,
        check=Check("an integer >= 5", lambda v: is_int(v) and v >= 5),
        help="vocabulary size (4 special tokens)",
    )
    make_vocab_size_divisible_by: int = option(
        1,
        "--make-vocab-size-divisible-by",
        kind=RUN,
        check=positive,
        help="pad the model's vocabulary to a multiple of this x --tp (megatron's flag, whose "
        "default is 128); padded ids are excluded from the softmax, so results do not depend "
        "on it",
    )
    data_path: Optional[str] = option(
        None,
        "--data-path",
        kind=DATA,
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
        kind=MODEL,
        type=str,
        metavar="T",
        help="with --data-path: 'byte-level' (default; UTF-8 bytes, no file), a HuggingFace "
        "tokenizer folder (tokenizer.json + tokenizer_config.json with its chat template) or a "
        "tokenizers JSON file",
    )
    eod_token: Optional[str] = option(
        None,
        "--eod-token",
        kind=DATA,
        type=str,
        metavar="TOKEN",
        help="the end-of-document token of --tokenizer (appended to text records, used as "
        "padding); default: the tokenizer config's eos_token, else <|endoftext|>, </s>, ...",
    )
    allow_truncation: bool = option(
        False,
        "--allow-truncation",
        kind=RUN,
        help="train even when more than 10%% of the --data-path records are longer than "
        "--seq-length + 1 tokens and get cut (by default such a run stops and names the count)",
    )
    pack_sequences: bool = option(
        False,
        "--pack-sequences",
        kind=RUN,
        help="pack documents (generated pairs or --data-path records) into rows of "
        "--seq-length tokens (THD format: documents never attend to each other, each "
        "padded to a multiple of 16, padding "
        "and prompts masked out of the loss); needs --micro-batch-size 1; with --dpo whole "
        "pairs in rows of 2 x --seq-length, --global-batch-size counting rows (docs/dpo.md)",
    )
    # Model.
    num_layers: int = option(
        4,
        "--num-layers",
        kind=MODEL,
        library="num_layers",
        check=positive,
        help="transformer layers",
    )
    hidden_size: int = option(
        32,
        "--hidden-size",
        kind=MODEL,
        library="hidden_size",
        check=positive,
        help="hidden size (model width)",
    )
    num_attention_heads: int = option(
        4,
        "--num-attention-heads",
        kind=MODEL,
        library="num_attention_heads",
        check=positive,
        help="attention heads",
    )
    num_query_groups: Optional[int] = option(
        None,
        "--num-query-groups",
        kind=MODEL,
        library="num_query_groups",
        type=int,
        check=positive,
        help="key/value head groups (grouped-query attention); default: one per head",
    )
    ffn_hidden_size: Optional[int] = option(
        None,
        "--ffn-hidden-size",
        kind=MODEL,
        library="ffn_hidden_size",
        type=int,
        check=positive,
        help="MLP hidden size; default: 4 x hidden size",
    )
    normalization: str = option(
        "LayerNorm",
        "--normalization",
        kind=MODEL,
        library="normalization",
        choices=NORMALIZATIONS,
        check=one_of(NORMALIZATIONS),
        help="normalization layer",
    )
    swiglu: bool = option(
        False,
        "--swiglu",
        kind=MODEL,
        library=Sets("gated_linear_unit", value=lambda c, _: c.swiglu or c.geglu or c.quick_geglu),
        help="gated MLP silu(x W_gate) * (x W_up) instead of gelu(x W_1)",
    )
    quick_geglu: bool = option(
        False,
        "--quick-geglu",
        kind=MODEL,
        help="gated MLP quick_gelu(x W_gate) * (x W_up), quick_gelu(x) = x sigmoid(1.702 x) "
        "(GPT-OSS's experts, with --glu-linear-offset 1 --activation-func-clamp-value 7)",
    )
    glu_linear_offset: float = option(
        0.0,
        "--glu-linear-offset",
        kind=MODEL,
        library="glu_linear_offset",
        help="gated MLP: act(x W_gate) * (x W_up + OFFSET) (GPT-OSS: 1)",
    )
    activation_func_clamp_value: Optional[float] = option(
        None,
        "--activation-func-clamp-value",
        kind=MODEL,
        type=float,
        library="activation_func_clamp_value",
        check=positive_number,
        help="gated MLP: x W_gate clamped above, x W_up on both sides at this value (GPT-OSS: 7)",
    )
    softmax_type: str = option(
        "vanilla",
        "--softmax-type",
        kind=MODEL,
        library="softmax_type",
        choices=config_rules.SOFTMAX_TYPES,
        check=one_of(config_rules.SOFTMAX_TYPES),
        help="attention softmax: vanilla; learnable: attention sinks, a learned logit per head "
        "in the denominator (GPT-OSS); off-by-one: a sink of 0",
    )
    geglu: bool = option(
        False,
        "--geglu",
        kind=MODEL,
        help="gated MLP gelu(x W_gate) * (x W_up) (GELU's tanh approximation with "
        "--openai-gelu: Gemma's gelu_pytorch_tanh)",
    )
    apply_layernorm_1p: bool = option(
        False,
        "--apply-layernorm-1p",
        kind=MODEL,
        library="layernorm_zero_centered_gamma",
        help="zero-centred norm weights: norm(x) * (1 + weight), the weights starting at 0 "
        "(Gemma's RMSNorm)",
    )
    sandwich_layernorm: bool = option(
        False,
        "--sandwich-layernorm",
        kind=MODEL,
        library="sandwich_layernorm",
        help="a norm after attention and after the MLP as well, before each residual add "
        "(Gemma 2 / 3)",
    )
    embedding_scale_sqrt_hidden: bool = option(
        False,
        "--embedding-scale-sqrt-hidden",
        kind=MODEL,
        library="embedding_scale_sqrt_hidden",
        help="multiply the word embeddings by sqrt(hidden size) (Gemma)",
    )
    softmax_scale: Optional[float] = option(
        None,
        "--softmax-scale",
        kind=MODEL,
        library="softmax_scale",
        type=float,
        check=positive_number,
        help="attention scores' scale; default: 1 / sqrt(kv-channels) (Gemma: "
        "query_pre_attn_scalar ** -0.5)",
    )
    attn_logit_softcapping: Optional[float] = option(
        None,
        "--attn-logit-softcapping",
        kind=MODEL,
        library="attn_logit_softcapping",
        type=float,
        check=positive_number,
        help="cap the attention scores: c * tanh(s / c) (Gemma 2; the explicit attention "
        "kernel: --attention-backend auto, unfused or local)",
    )
    final_logit_softcapping: Optional[float] = option(
        None,
        "--final-logit-softcapping",
        kind=MODEL,
        library="final_logit_softcapping",
        type=float,
        check=positive_number,
        help="cap the output logits: c * tanh(z / c) (Gemma 2)",
    )
    position_embedding_type: str = option(
        "learned_absolute",
        "--position-embedding-type",
        kind=MODEL,
        library=Sets("position_embedding_type", GPT_MODEL),
        choices=POSITION_EMBEDDING_TYPES,
        check=one_of(POSITION_EMBEDDING_TYPES),
        help="learned absolute positions or rotary embeddings",
    )
    disable_bias_linear: bool = option(
        False,
        "--disable-bias-linear",
        kind=MODEL,
        library=Sets("add_bias_linear", value=lambda c, _: not c.disable_bias_linear),
        help="no biases in the linear layers",
    )
    label_smoothing: float = option(
        0.0,
        "--label-smoothing",
        kind=RUN,
        library="label_smoothing",
        check=Check("in [0, 1)", config_rules.label_smoothing_allowed),
        help="label smoothing of the cross-entropy over the whole vocabulary",
    )
    init_method_std: float = option(
        0.02,
        "--init-method-std",
        kind=RUN,
        library="init_method_std",
        check=non_negative_number,
        help="std of initial weights",
    )
    untie_embeddings_and_output_weights: bool = option(
        False,
        "--untie-embeddings-and-output-weights",
        kind=MODEL,
        library=Sets(
            "share_embeddings_and_output_weights",
            GPT_MODEL,
            lambda c, _: not c.untie_embeddings_and_output_weights,
        ),
        help="separate output layer (default: tied to the word embeddings)",
    )
    kv_channels: Optional[int] = option(
        None,
        "--kv-channels",
        kind=MODEL,
        library="kv_channels",
        type=int,
        check=positive,
        help="size of each attention head; default: hidden size / attention heads",
    )
    max_position_embeddings: Optional[int] = option(
        None,
        "--max-position-embeddings",
        kind=MODEL,
        library=Sets(
            "max_sequence_length", GPT_MODEL, lambda c, _: c.max_position_embeddings or c.seq_length
        ),
        type=int,
        check=positive,
        help="rows of the learned position table (learned_absolute); default: --seq-length",
    )
    norm_epsilon: float = option(
        1e-5,
        "--norm-epsilon",
        kind=MODEL,
        library="layernorm_epsilon",
        check=positive_number,
        help="epsilon of LayerNorm / RMSNorm",
    )
    rotary_base: float = option(
        10000.0,
        "--rotary-base",
        kind=MODEL,
        library=(Sets("rotary_base", GPT_MODEL), _mla("rotary_base")),
        check=positive_number,
        help="RoPE base (rope_theta)",
    )
    rotary_scaling_factor: Optional[float] = option(
        None,
        "--rotary-scaling-factor",
        kind=MODEL,
        type=float,
        library=(
            Sets("yarn_rotary_scaling_factor", when=lambda c: _yarn(c)),
            Sets("rotary_scaling_factor", value=_mla_yarn_factor, when=_mla_on),
        ),
        check=positive_number,
        help="the YaRN scaling factor (the context extension factor): --position-embedding-type "
        "yarn's (needed there), or multi-latent attention's --rope-type yarn (default 1)",
    )
    yarn_original_max_position_embeddings: Optional[int] = option(
        None,
        "--yarn-original-max-position-embeddings",
        kind=MODEL,
        type=int,
        library=Sets("yarn_original_max_position_embeddings", when=lambda c: _yarn(c)),
        check=positive,
        help="--position-embedding-type yarn: the length the model was trained at",
    )
    yarn_beta_fast: Optional[float] = option(
        None,
        "--yarn-beta-fast",
        kind=MODEL,
        type=float,
        library=Sets("yarn_beta_fast", when=lambda c: _yarn(c)),
        check=positive_number,
        help="--position-embedding-type yarn: turns of the ramp's high end (usually 32)",
    )
    yarn_beta_slow: Optional[float] = option(
        None,
        "--yarn-beta-slow",
        kind=MODEL,
        type=float,
        library=Sets("yarn_beta_slow", when=lambda c: _yarn(c)),
        check=positive_number,
        help="--position-embedding-type yarn: turns of the ramp's low end (usually 1)",
    )
    no_yarn_correction_range_round_to_int: bool = option(
        False,
        "--no-yarn-correction-range-round-to-int",
        kind=MODEL,
        library=Sets(
            "yarn_correction_range_round_to_int",
            value=lambda c, _: not c.no_yarn_correction_range_round_to_int,
        ),
        help="--position-embedding-type yarn: keep the ramp's ends fractional (GPT-OSS; "
        "HuggingFace's truncate: false)",
    )
    use_rope_scaling: bool = option(
        False,
        "--use-rope-scaling",
        kind=MODEL,
        library=Sets("rope_scaling", GPT_MODEL),
        help="Llama 3.x RoPE frequency scaling (by --rope-scaling-factor)",
    )
    rope_scaling_factor: float = option(
        8.0,
        "--rope-scaling-factor",
        kind=MODEL,
        library=Sets("rope_scaling_factor", GPT_MODEL),
        check=positive_number,
        help="--use-rope-scaling: the factor long wavelengths are divided by",
    )
    rotary_percent: float = option(
        1.0,
        "--rotary-percent",
        kind=MODEL,
        library=Sets("rotary_percent", GPT_MODEL),
        check=Check("in (0, 1]", lambda v: is_number(v) and 0 < v <= 1),
        help="fraction of each head's channels the rotary embedding rotates (the first "
        "int(kv-channels x it); Phi-3's partial_rotary_factor); the rest pass unrotated",
    )
    rotary_seq_len_interpolation_factor: Optional[float] = option(
        None,
        "--rotary-seq-len-interpolation-factor",
        kind=MODEL,
        library=Sets("seq_len_interpolation_factor", GPT_MODEL),
        type=float,
        check=positive_number,
        help="linear RoPE scaling: positions divided by this factor (with --local-rotary-base: "
        "the full-attention layers' only, Gemma 3's rope_scaling); default: none",
    )
    add_qkv_bias: bool = option(
        False,
        "--add-qkv-bias",
        kind=MODEL,
        library="add_qkv_bias",
        help="biases on the query/key/value projection even with --disable-bias-linear (Qwen2)",
    )
    qk_layernorm: bool = option(
        False,
        "--qk-layernorm",
        kind=MODEL,
        library="qk_layernorm",
        help="normalize each query and key head (--normalization, over kv-channels) before "
        "the rotary embedding (Qwen3)",
    )
    qk_layernorm_whole_projection: bool = option(
        False,
        "--qk-layernorm-whole-projection",
        kind=MODEL,
        library="qk_layernorm_whole_projection",
        help="with --qk-layernorm and RMSNorm: one norm over all heads of the query and of "
        "the key projection (weights [heads x kv-channels]), not one per head (OLMoE)",
    )
    # Multi-latent attention (megatron's flags and defaults; docs/deepseek.md). Off unless
    # --multi-latent-attention.
    multi_latent_attention: bool = option(
        False,
        "--multi-latent-attention",
        kind=MODEL,
        library=_mla("multi_latent_attention"),
        help="multi-latent attention (DeepSeek-V2/V3: low-rank q and kv projections, a rotary "
        "part shared by all heads); needs --position-embedding-type rope",
    )
    q_lora_rank: Optional[int] = option(
        None,
        "--q-lora-rank",
        kind=MODEL,
        library=_mla("q_lora_rank"),
        type=int,
        check=positive,
        help="rank of the query's down projection; default: none (one q projection, "
        "DeepSeek-V2-Lite)",
    )
    kv_lora_rank: int = option(
        32,
        "--kv-lora-rank",
        kind=MODEL,
        library=_mla("kv_lora_rank"),
        check=positive,
        help="rank of the key/value down projection",
    )
    qk_head_dim: int = option(
        128,
        "--qk-head-dim",
        kind=MODEL,
        library=_mla("qk_head_dim"),
        check=positive,
        help="per-head query/key dim without rotary embedding",
    )
    qk_pos_emb_head_dim: int = option(
        64,
        "--qk-pos-emb-head-dim",
        kind=MODEL,
        library=_mla("qk_pos_emb_head_dim"),
        check=Check("an even integer >= 2", lambda v: is_int(v) and v >= 2 and v % 2 == 0),
        help="per-head query/key dim with rotary embedding (the key's part shared by all heads)",
    )
    v_head_dim: int = option(
        128,
        "--v-head-dim",
        kind=MODEL,
        library=_mla("v_head_dim"),
        check=positive,
        help="per-head value dim",
    )
    rope_type: Optional[str] = option(
        None,
        "--rope-type",
        kind=MODEL,
        library=Sets(
            "rope_type", when=lambda c: c.multi_latent_attention and c.rope_type is not None
        ),
        type=str,
        choices=ROPE_TYPES,
        check=one_of(ROPE_TYPES),
        help="multi-latent attention's rotary embedding: rope, or yarn (default, with "
        "--rotary-scaling-factor, --original-max-position-embeddings, --beta-fast, "
        "--beta-slow, --mscale, --mscale-all-dim)",
    )
    original_max_position_embeddings: int = option(
        4096,
        "--original-max-position-embeddings",
        kind=MODEL,
        library=_mla("original_max_position_embeddings"),
        check=positive,
        help="yarn: the context length the model was trained at before extension",
    )
    beta_fast: float = option(
        32.0,
        "--beta-fast",
        kind=MODEL,
        library=_mla("beta_fast"),
        check=positive_number,
        help="yarn: rotations above which frequencies are kept",
    )
    beta_slow: float = option(
        1.0,
        "--beta-slow",
        kind=MODEL,
        library=_mla("beta_slow"),
        check=positive_number,
        help="yarn: rotations below which frequencies are interpolated",
    )
    mscale: float = option(
        1.0,
        "--mscale",
        kind=MODEL,
        library=_mla("mscale"),
        check=non_negative_number,
        help="yarn: mscale of the cos/sin scale",
    )
    mscale_all_dim: float = option(
        0.0,
        "--mscale-all-dim",
        kind=MODEL,
        library=_mla("mscale_all_dim"),
        check=non_negative_number,
        help="yarn: mscale_all_dim of the cos/sin and softmax scales",
    )
    openai_gelu: bool = option(
        False,
        "--openai-gelu",
        kind=MODEL,
        help="GELU's tanh approximation (OpenAI's, GPT-2's gelu_new) instead of the exact one",
    )
    attention_backend: str = option(
        "auto",
        "--attention-backend",
        kind=RUN,
        library="attention_backend",
        choices=ATTENTION_BACKENDS,
        check=one_of(ATTENTION_BACKENDS),
        help="attention kernel: auto (the one PyTorch's scaled_dot_product_attention picks for "
        "the tensors: cuDNN on Hopper-class GPUs, flash otherwise, the CPU flash op on CPUs), "
        "flash, fused (cuDNN), unfused or local (an explicit score matrix)",
    )
    window_size: Optional[List[int]] = option(
        None,
        "--window-size",
        kind=MODEL,
        library=Sets(
            "window_size",
            value=lambda c, _: None if c.window_size is None else tuple(c.window_size),
        ),
        nargs=2,
        type=int,
        metavar=("LEFT", "RIGHT"),
        check=Check(
            "LEFT >= 0 (or -1: no limit) and RIGHT 0 or -1", config_rules.window_size_valid
        ),
        help="sliding-window attention: a query sees LEFT earlier keys (RIGHT 0: causal); "
        "default: no window",
    )
    window_attn_skip_freq: Union[None, int, List[int]] = option(
        None,
        "--window-attn-skip-freq",
        kind=MODEL,
        library="window_attn_skip_freq",
        type=int,
        nargs="+",
        one_or_list=True,
        metavar="N",
        help="with --window-size: N, every N-th layer (1-based) has full attention, the others "
        "the window (GPT-OSS and Gemma 2: 2, Gemma 3: 6); or one value per layer, 1 = sliding "
        "window, 0 = full attention; default: every layer has the window",
    )
    local_rotary_base: Optional[float] = option(
        None,
        "--local-rotary-base",
        kind=MODEL,
        library="local_rotary_base",
        type=float,
        check=positive_number,
        help="RoPE base of the sliding-window layers (Gemma 3's rope_local_base_freq); "
        "default: --rotary-base",
    )
    hf_model: Optional[str] = option(
        None,
        "--hf-model",
        kind=RUN,
        library=Sets("perform_initialization", value=lambda c, _: not c.hf_model),
        type=str,
        metavar="DIR",
        help="start from a HuggingFace model (config.json + safetensors; its model_type one "
        f"of {HF_FAMILIES}; docs/huggingface.md): its config.json sets the model options "
        "above (an explicit conflicting one is an error), its weights are loaded at any "
        "layout, and with --data-path its tokenizer is the default --tokenizer",
    )
    # Multi-token prediction (megatron's flags; docs/deepseek.md). Off unless --mtp-num-layers.
    mtp_num_layers: Optional[int] = option(
        None,
        "--mtp-num-layers",
        kind=MODEL,
        library=Sets("mtp_num_layers", value=lambda c, _: c.mtp_num_layers or None),
        type=int,
        metavar="K",
        check=non_negative,
        help="multi-token prediction depths (DeepSeek-V3's MTP) on the last pipeline stage, "
        "each predicting one token further; the log gains 'mtp_1 loss' ... 'mtp_K loss'; "
        "default: none (a --hf-model checkpoint's own; 0 drops them)",
    )
    mtp_loss_scaling_factor: float = option(
        0.1,
        "--mtp-loss-scaling-factor",
        kind=OPTIMIZER,
        library=Sets("mtp_loss_scaling_factor", when=lambda c: bool(c.mtp_num_layers)),
        check=Check("a finite number", is_number),
        help="weight of the MTP loss (the mean of the depths' losses) added to the LM loss",
    )
    # Mixture of experts (megatron's flags; docs/moe.md). Off unless --num-experts.
    num_experts: Optional[int] = option(
        None,
        "--num-experts",
        kind=MODEL,
        library=_moe("num_moe_experts"),
        type=int,
        metavar="E",
        check=positive,
        help="routed experts per MoE layer (megatron-core's num_moe_experts); default: a "
        "dense model. Needs --disable-bias-linear",
    )
    moe_router_topk: int = option(
        2,
        "--moe-router-topk",
        kind=MODEL,
        library=_moe("moe_router_topk"),
        check=positive,
        help="experts per token (k)",
    )
    moe_ffn_hidden_size: Optional[int] = option(
        None,
        "--moe-ffn-hidden-size",
        kind=MODEL,
        library=_moe(
            "moe_ffn_hidden_size", lambda c, _: c.moe_ffn_hidden_size or c.ffn_hidden_size
        ),
        type=int,
        check=positive,
        help="each routed expert's FFN size; default: --ffn-hidden-size",
    )
    moe_shared_expert_intermediate_size: Optional[int] = option(
        None,
        "--moe-shared-expert-intermediate-size",
        kind=MODEL,
        library=_moe("moe_shared_expert_intermediate_size"),
        type=int,
        check=positive,
        help="FFN size of the shared expert every token goes through; default: none",
    )
    moe_shared_expert_gate: bool = option(
        False,
        "--moe-shared-expert-gate",
        kind=MODEL,
        library=_moe("moe_shared_expert_gate"),
        help="scale the shared expert by sigmoid(x . g) (Qwen2-MoE)",
    )
    moe_router_load_balancing_type: str = option(
        "aux_loss",
        "--moe-router-load-balancing-type",
        kind=OPTIMIZER,
        library=_moe("moe_router_load_balancing_type"),
        check=one_of(config_rules.MOE_LOAD_BALANCING_TYPES),
        help="aux_loss (over each micro-batch), seq_aux_loss (per sequence) or none; "
        "sinkhorn and global_aux_loss are refused (layout-dependent)",
    )
    moe_aux_loss_coeff: float = option(
        0.0,
        "--moe-aux-loss-coeff",
        kind=OPTIMIZER,
        library=_moe("moe_aux_loss_coeff"),
        check=non_negative_number,
        help="load-balancing loss coefficient c (docs/moe.md has the definition)",
    )
    moe_z_loss_coeff: Optional[float] = option(
        None,
        "--moe-z-loss-coeff",
        kind=OPTIMIZER,
        library=_moe("moe_z_loss_coeff"),
        type=float,
        check=non_negative_number,
        help="router z-loss coefficient; default: none",
    )
    moe_router_pre_softmax: bool = option(
        False,
        "--moe-router-pre-softmax",
        kind=MODEL,
        library=_moe("moe_router_pre_softmax"),
        help="softmax over all experts before the top-k (default: over the selected k)",
    )
    moe_router_score_function: str = option(
        "softmax",
        "--moe-router-score-function",
        kind=MODEL,
        library=_moe("moe_router_score_function"),
        check=one_of(config_rules.MOE_SCORE_FUNCTIONS),
        help="softmax or sigmoid routing scores",
    )
    moe_router_dtype: Optional[str] = option(
        None,
        "--moe-router-dtype",
        kind=MODEL,
        library=_moe("moe_router_dtype"),
        check=one_of(("fp32", "fp64")),
        help="the router's logits, routing and router losses in this dtype (default: the "
        "model's; fp32 as transformers' MoE routers in a bf16 run)",
    )
    moe_router_enable_expert_bias: bool = option(
        False,
        "--moe-router-enable-expert-bias",
        kind=MODEL,
        library=_moe("moe_router_enable_expert_bias"),
        help="aux-loss-free balancing: a per-expert bias on the selection scores, updated "
        "after every step from the token counts (needs --moe-router-score-function sigmoid)",
    )
    moe_router_bias_update_rate: float = option(
        1e-3,
        "--moe-router-bias-update-rate",
        kind=OPTIMIZER,
        library=_moe("moe_router_bias_update_rate"),
        check=positive_number,
        help="step of the expert-bias update",
    )
    moe_router_topk_scaling_factor: Optional[float] = option(
        None,
        "--moe-router-topk-scaling-factor",
        kind=MODEL,
        library=_moe("moe_router_topk_scaling_factor"),
        type=float,
        check=positive_number,
        help="multiply the routing probabilities by this factor; default: none",
    )
    moe_router_num_groups: Optional[int] = option(
        None,
        "--moe-router-num-groups",
        kind=MODEL,
        library=_moe("moe_router_num_groups"),
        type=int,
        check=positive,
        help="group-limited routing: expert groups (with --moe-router-group-topk)",
    )
    moe_router_group_topk: Optional[int] = option(
        None,
        "--moe-router-group-topk",
        kind=MODEL,
        library=_moe("moe_router_group_topk"),
        type=int,
        check=positive,
        help="group-limited routing: groups each token may use",
    )
    moe_layer_freq: Union[int, List[int]] = option(
        1,
        "--moe-layer-freq",
        kind=MODEL,
        library=_moe("moe_layer_freq"),
        type=moe_freq_type,
        nargs="+",
        one_or_list=True,
        metavar="N",
        help="N: every N-th layer (0, N, 2N, ...) is a MoE layer; or one 0/1 per layer, as "
        'entries (0 1 1 1) or megatron\'s list expression ("([0]*1+[1]*3)")',
    )
    moe_grouped_gemm: bool = option(
        False,
        "--moe-grouped-gemm",
        kind=RUN,
        library=_moe("moe_grouped_gemm"),
        help="GroupedMLP experts (one grouped GEMM on a GPU; same values as the default "
        "SequentialMLP)",
    )
    moe_token_dispatcher_type: str = option(
        "allgather",
        "--moe-token-dispatcher-type",
        kind=RUN,
        library=_moe("moe_token_dispatcher_type"),
        check=one_of(config_rules.MOE_TOKEN_DISPATCHERS),
        help="allgather or alltoall (flex is refused)",
    )
    expert_model_parallel_size: int = option(
        1,
        "--expert-model-parallel-size",
        "--ep",
        kind=LAYOUT,
        library=_moe("expert_model_parallel_size", from_layout=True),
        check=positive,
        help="expert-parallel size (experts split over EP ranks)",
    )
    expert_tensor_parallel_size: Optional[int] = option(
        None,
        "--expert-tensor-parallel-size",
        "--etp",
        kind=LAYOUT,
        library=_moe("expert_tensor_parallel_size", from_layout=True),
        type=int,
        check=positive,
        help="tensor-parallel size inside each expert; default: --tp",
    )
    # Optimization.
    train_iters: int = option(
        20,
        "--train-iters",
        kind=OPTIMIZER,
        library=Sets("lr_decay_steps", SCHEDULER),
        check=positive,
        help="training iterations",
    )
    lr: float = option(
        3e-3, "--lr", kind=OPTIMIZER, check=positive_number, help="peak Adam learning rate"
    )
    adam_beta1: float = option(
        0.9, "--adam-beta1", kind=OPTIMIZER, check=unit_interval, help="Adam's first-moment decay"
    )
    adam_beta2: float = option(
        0.999,
        "--adam-beta2",
        kind=OPTIMIZER,
        check=unit_interval,
        help="Adam's second-moment decay",
    )
    adam_eps: float = option(
        1e-8,
        "--adam-eps",
        kind=OPTIMIZER,
        check=positive_number,
        help="Adam's epsilon added to the root of the second moment",
    )
    weight_decay: float = option(
        0.0,
        "--weight-decay",
        kind=OPTIMIZER,
        check=non_negative_number,
        help="decoupled weight decay (AdamW)",
    )
    lr_warmup_iters: int = option(
        0,
        "--lr-warmup-iters",
        kind=OPTIMIZER,
        library=Sets("lr_warmup_steps", SCHEDULER),
        check=non_negative,
        help="linear warm-up from 0",
    )
    lr_decay_style: str = option(
        "constant",
        "--lr-decay-style",
        kind=OPTIMIZER,
        choices=LR_DECAY_STYLES,
        check=one_of(LR_DECAY_STYLES),
        help="learning-rate decay after warm-up, down to --min-lr at --train-iters",
    )
    min_lr: float = option(
        0.0,
        "--min-lr",
        kind=OPTIMIZER,
        check=non_negative_number,
        help="learning rate at the end of the decay",
    )
    clip_grad: float = option(
        1.0,
        "--clip-grad",
        kind=OPTIMIZER,
        check=Check("a finite number >= 0 (0 disables)", lambda v: is_number(v) and v >= 0),
        help="gradient-norm clipping threshold, 0: off",
    )
    optimizer: str = option(
        "adam",
        "--optimizer",
        kind=PRECISION,  # the optimizer state's form: refused on a resume that loads it
        choices=OPTIMIZERS,
        check=one_of(OPTIMIZERS),
        help="adam (AdamW: --adam-beta1/2, --adam-eps) or sgd (--sgd-momentum); megatron's flag",
    )
    sgd_momentum: float = option(
        0.9,
        "--sgd-momentum",
        kind=OPTIMIZER,
        check=Check("in [0, 1)", lambda v: is_number(v) and 0 <= v < 1),
        help="with --optimizer sgd: the momentum (megatron's default 0.9; 0: plain SGD)",
    )
    calculate_per_token_loss: bool = option(
        False,
        "--calculate-per-token-loss",
        kind=RUN,
        library="calculate_per_token_loss",
        help="train sum(loss)/sum(tokens) over the global batch instead of the mean over "
        "microbatches of each microbatch's token mean",
    )
    per_shard_loss_normalization: bool = option(
        False,
        "--per-shard-loss-normalization",
        kind=RUN,
        help="negative control: train megatron-core 0.16.1's objective, each CP shard's "
        "loss divided by its own valid-token count and averaged over shards; with --cp > 1 "
        "on prompt-masked data it drifts from the one-process run",
    )
    overlap_grad_reduce: bool = option(
        False,
        "--overlap-grad-reduce",
        kind=RUN,
        library=Sets("overlap_grad_reduce", DDP_CONFIG),
        help="reduce gradient buckets asynchronously during the backward",
    )
    use_distributed_optimizer: bool = option(
        False,
        "--use-distributed-optimizer",
        kind=RUN,
        library=Sets("use_distributed_optimizer", DDP_CONFIG),
        help="ZeRO-1: gradients reduce-scattered over data x context parallel ranks, fp32 "
        "main parameters and Adam state kept for this rank's shard only, parameters "
        "all-gathered after the step (docs/memory.md)",
    )
    overlap_param_gather: bool = option(
        False,
        "--overlap-param-gather",
        kind=RUN,
        library=Sets("overlap_param_gather", DDP_CONFIG),
        help="with --use-distributed-optimizer: all-gather the updated parameters "
        "asynchronously, each module's forward waiting for its own bucket",
    )
    # Activation recomputation (megatron's flags; docs/memory.md).
    recompute_granularity: Optional[str] = option(
        None,
        "--recompute-granularity",
        kind=RUN,
        library="recompute_granularity",
        choices=config_rules.RECOMPUTE_GRANULARITIES,
        help="recompute activations in the backward: full (whole layers, with "
        "--recompute-method and --recompute-num-layers) or selective (--recompute-modules)",
    )
    recompute_method: Optional[str] = option(
        None,
        "--recompute-method",
        kind=RUN,
        library="recompute_method",
        choices=config_rules.RECOMPUTE_METHODS,
        help="with --recompute-granularity full: uniform (groups of --recompute-num-layers "
        "layers, one checkpoint each) or block (the first --recompute-num-layers layers of "
        "each pipeline chunk)",
    )
    recompute_num_layers: Optional[int] = option(
        None,
        "--recompute-num-layers",
        kind=RUN,
        library="recompute_num_layers",
        type=int,
        metavar="N",
        help="layers per checkpoint (uniform) or layers checkpointed per chunk (block)",
    )
    recompute_modules: Optional[List[str]] = option(
        None,
        "--recompute-modules",
        kind=RUN,
        library="recompute_modules",
        nargs="+",
        choices=config_rules.RECOMPUTE_MODULES,
        metavar="MODULE",
        help="with --recompute-granularity selective: which parts of each layer to "
        "recompute: core_attn (default), mlp, layernorm",
    )
    gradient_accumulation_fusion: bool = option(
        False,
        "--gradient-accumulation-fusion",
        kind=RUN,
        library="gradient_accumulation_fusion",
        help="linear layers add their weight gradients into the fp32 main_grad inside the "
        "GEMM (megatron-core's gradient_accumulation_fusion)",
    )
    compile: bool = option(
        False,
        "--compile",
        kind=RUN,
        library=_FUSION_SWITCHES,
        help="torch.compile each transformer layer and the loss (an extra of this trainer; "
        "megatron-core's fusion switches are set too): the same math, fewer memory passes "
        "(docs/mixed_precision.md)",
    )
    seed: int = option(
        1234,
        "--seed",
        kind=RUN,
        library=(Sets("seed", GPT_MODEL), Sets("seed", LORA_CONFIG)),
        check=non_negative,
        help="seed of the weights and of the generated data",
    )
    # Mixed precision (megatron's flags; docs/mixed_precision.md).
    bf16: bool = option(
        False,
        "--bf16",
        kind=PRECISION,
        library="bf16",
        help="bf16 weights and activations (Float16Module), fp32 main_grad and fp32 main "
        "parameters in the optimizer, loss in fp32",
    )
    fp16: bool = option(
        False,
        "--fp16",
        kind=PRECISION,
        library="fp16",
        help="as --bf16 in fp16, with dynamic loss scaling (below)",
    )
    fp8_format: Optional[str] = option(
        None,
        "--fp8-format",
        kind=RUN,
        library=Sets("fp8"),
        type=str,
        choices=("e4m3", "hybrid"),
        help="FP8 GEMMs in the attention and MLP linears and the experts (docs/fp8.md): e4m3 "
        "everywhere, or hybrid (e5m2 gradients); every scale from the tensor's global amax, "
        "so every layout trains the same model",
    )
    fp8_recipe: str = option(
        "delayed",
        "--fp8-recipe",
        kind=RUN,
        library="fp8_recipe",
        choices=FP8_RECIPES,
        help="with --fp8-format: the scaling recipe; tensorwise (current per-tensor scaling) "
        "is implemented, the others are refused (megatron's default: delayed)",
    )
    fp8_margin: int = option(
        0,
        "--fp8-margin",
        kind=RUN,
        library="fp8_margin",
        check=non_negative,
        help="with --fp8-format: scale = fp8_max / amax / 2^margin",
    )
    fp8_amax_history_len: int = option(
        1,
        "--fp8-amax-history-len",
        kind=RUN,
        library="fp8_amax_history_len",
        check=positive,
        help="delayed recipe only (refused otherwise): the amax history length",
    )
    fp8_amax_compute_algo: str = option(
        "most_recent",
        "--fp8-amax-compute-algo",
        kind=RUN,
        library="fp8_amax_compute_algo",
        choices=("most_recent", "max"),
        help="delayed recipe only (refused otherwise): the amax of the history",
    )
    fp8_wgrad: bool = option(
        True,
        "--no-fp8-wgrad",
        kind=RUN,
        library="fp8_wgrad",
        help="with --fp8-format: the weight-gradient GEMM in the input precision, not FP8",
    )
    loss_scale: Optional[float] = option(
        None,
        "--loss-scale",
        kind=OPTIMIZER,
        type=float,
        check=loss_scale_number,
        help="a fixed loss scale instead of --fp16's dynamic one",
    )
    initial_loss_scale: float = option(
        2.0**32,
        "--initial-loss-scale",
        kind=OPTIMIZER,
        check=loss_scale_number,
        help="--fp16: the first scale",
    )
    min_loss_scale: float = option(
        1.0,
        "--min-loss-scale",
        kind=OPTIMIZER,
        check=loss_scale_number,
        help="--fp16: the smallest scale",
    )
    loss_scale_window: float = option(
        1000.0,
        "--loss-scale-window",
        kind=OPTIMIZER,
        check=Check("a finite number >= 1", lambda v: is_number(v) and v >= 1),
        help="--fp16: clean steps before the scale doubles",
    )
    hysteresis: int = option(
        2,
        "--hysteresis",
        kind=OPTIMIZER,
        check=positive,
        help="--fp16: overflowing steps before it halves",
    )
    check_for_nan_in_loss_and_grad: bool = option(
        True,
        "--no-check-for-nan-in-loss-and-grad",
        kind=RUN,
        help="train on after an iteration whose loss or (unscaled) gradient norm is NaN or "
        "inf; by default the run stops there naming the iteration (an fp16 overflow that "
        "loss scaling skips is not stopped)",
    )
    # Validation (megatron's flags; docs/lifecycle.md).
    eval_interval: Optional[int] = option(
        None,
        "--eval-interval",
        kind=RUN,
        type=int,
        metavar="N",
        check=positive,
        help="compute the validation loss every N iterations (and after the last one)",
    )
    eval_iters: int = option(
        100,
        "--eval-iters",
        kind=RUN,
        metavar="K",
        check=Check("an integer >= -1", lambda v: is_int(v) and v >= -1),
        help="global batches per validation pass (the first K of the validation set, "
        "fewer when it is smaller); -1: the whole validation set once; 0: no validation",
    )
    valid_data_path: Optional[str] = option(
        None,
        "--valid-data-path",
        kind=RUN,
        type=str,
        metavar="PATH",
        help="validation data (the forms of --data-path: JSONL, chat, indexed), every "
        "record in file order",
    )
    split: Optional[str] = option(
        None,
        "--split",
        kind=DATA,
        type=str,
        metavar="TRAIN,VALID,TEST",
        help="split --data-path's records by weight, in file order (megatron's form, e.g. "
        "969,30,1): the first part trains, the second validates, the third is held out; "
        "the same for every layout and seed",
    )
    skip_train: bool = option(
        False,
        "--skip-train",
        kind=RUN,
        help="only evaluate: the validation loss of --load's checkpoint or --hf-model, then "
        "exit",
    )
    # LoRA (Megatron-Bridge's semantics; docs/lora.md).
    lora_dim: Optional[int] = option(
        None,
        "--lora-dim",
        kind=MODEL,
        library=Sets("dim", LORA_CONFIG),
        type=int,
        check=positive,
        metavar="R",
        help="train LoRA adapters of rank R on the target layers; every base weight frozen",
    )
    lora_alpha: float = option(
        32.0,
        "--lora-alpha",
        kind=MODEL,
        library=Sets("alpha", LORA_CONFIG),
        type=float,
        check=options.positive_number,
        help="with --lora-dim: the adapter output is scaled by alpha / dim",
    )
    lora_target_modules: Sequence[str] = option(
        tuple(config_rules.LORA_TARGETS),
        "--lora-target-modules",
        kind=MODEL,
        library=Sets("target_modules", LORA_CONFIG, lambda c, _: tuple(c.lora_target_modules)),
        type=str,
        nargs="+",
        metavar="MODULE",
        help="with --lora-dim: linear_qkv, linear_proj, linear_fc1, linear_fc2 (with "
        "--multi-latent-attention also linear_q_down_proj, linear_q_up_proj, linear_q_proj, "
        "linear_kv_down_proj, linear_kv_up_proj), or wildcards on the global module name "
        "(e.g. '*.layers.0.*.linear_qkv')",
    )
    lora_exclude_modules: Sequence[str] = option(
        (),
        "--lora-exclude-modules",
        kind=MODEL,
        library=Sets("exclude_modules", LORA_CONFIG, lambda c, _: tuple(c.lora_exclude_modules)),
        type=str,
        nargs="+",
        metavar="MODULE",
        help="with --lora-dim: names or wildcards removed from the targets",
    )
    lora_dropout: float = option(
        0.0,
        "--lora-dropout",
        kind=RUN,
        library=Sets("dropout", LORA_CONFIG),
        type=float,
        check=options.unit_interval,
        help="with --lora-dim: dropout on the adapter's input (or output, see below)",
    )
    lora_dropout_position: str = option(
        "pre",
        "--lora-dropout-position",
        kind=RUN,
        library=Sets("dropout_position", LORA_CONFIG),
        choices=config_rules.LORA_DROPOUT_POSITIONS,
        help="with --lora-dim: pre (on the adapter's input) or post (on its output)",
    )
    lora_a_init_method: str = option(
        "xavier",
        "--lora-a-init-method",
        kind=RUN,
        library=Sets("lora_A_init_method", LORA_CONFIG),
        choices=config_rules.LORA_INIT_METHODS,
        help="with --lora-dim: how A is drawn (seeded by --seed and the layer's name)",
    )
    lora_b_init_method: str = option(
        "zero",
        "--lora-b-init-method",
        kind=RUN,
        library=Sets("lora_B_init_method", LORA_CONFIG),
        choices=config_rules.LORA_INIT_METHODS,
        help="with --lora-dim: how B is drawn (zero: training starts at the base model)",
    )
    save_trainable_params_only: bool = option(
        False,
        "--save-trainable-params-only",
        kind=OUTPUT,
        help="with --lora-dim and --save: checkpoints hold the adapters and their optimizer "
        "state only (the base comes from --hf-model or --pretrained-checkpoint on resume)",
    )
    pretrained_checkpoint: Optional[str] = option(
        None,
        "--pretrained-checkpoint",
        kind=MODEL,
        metavar="DIR",
        help="with --lora-dim: load the frozen base weights from this checkpoint of ours "
        "(weights only) before --load",
    )
    hf_adapter: Optional[str] = option(
        None,
        "--hf-adapter",
        kind=RUN,
        metavar="DIR",
        help="with --hf-model: start the adapters from this PEFT adapter folder "
        "(adapter_config.json + adapter_model.safetensors, e.g. an earlier --export-hf); its "
        "r, lora_alpha and target_modules set --lora-dim, --lora-alpha and the targets unless "
        "given",
    )
    merge_lora: bool = option(
        False,
        "--merge-lora",
        kind=OUTPUT,
        help="with --lora-dim and --export-hf: write the merged model (W + alpha/dim B A, "
        "merged in float32) instead of the PEFT adapter folder",
    )
    # Preference training (docs/dpo.md).
    dpo: bool = option(
        False,
        "--dpo",
        kind=DATA,
        help="train on preference pairs (DPO) instead of SFT: --data-path is TRL's preference "
        "JSONL (prompt / chosen / rejected), default generated pairs; --global-batch-size and "
        "--micro-batch-size count pairs",
    )
    dpo_beta: float = option(
        0.1, "--dpo-beta", kind=RUN, check=positive_number, help="with --dpo: beta"
    )
    dpo_loss_type: str = option(
        "sigmoid",
        "--dpo-loss-type",
        kind=RUN,
        choices=config_rules.DPO_LOSS_TYPES,
        check=one_of(config_rules.DPO_LOSS_TYPES),
        help="with --dpo: sigmoid (DPO), hinge (SLiC) or ipo (on per-token mean log-ratios)",
    )
    dpo_label_smoothing: float = option(
        0.0,
        "--dpo-label-smoothing",
        kind=RUN,
        check=Check("in [0, 0.5)", lambda v: is_number(v) and 0 <= v < 0.5),
        help="with --dpo --dpo-loss-type sigmoid: the probability of a flipped label "
        "(conservative DPO)",
    )
    dpo_sft_weight: float = option(
        0.0,
        "--dpo-sft-weight",
        kind=RUN,
        check=non_negative_number,
        help="with --dpo: add this x the NLL of every chosen-completion token of the global "
        "batch over their count",
    )
    dpo_reference_free: bool = option(
        False,
        "--dpo-reference-free",
        kind=RUN,
        help="with --dpo: no reference model (its log-probabilities taken as 0)",
    )
    dpo_reference_hf_model: Optional[str] = option(
        None,
        "--dpo-reference-hf-model",
        kind=RUN,
        type=str,
        metavar="DIR",
        help="with --dpo: the frozen reference, a HuggingFace model with the policy's "
        "architecture and tokenizer (default: the policy's starting weights; with LoRA the "
        "base with its adapters off)",
    )
    # Logging (megatron's flags; docs/lifecycle.md).
    log_interval: int = option(
        100,
        "--log-interval",
        kind=OUTPUT,
        check=positive,
        help="with --no-progress: iterations between console lines",
    )
    tensorboard_log_interval: int = option(
        1,
        "--tensorboard-log-interval",
        kind=OUTPUT,
        check=positive,
        help="iterations between TensorBoard / W&B training scalars (validation results are "
        "always logged)",
    )
    log_num_zeros_in_grad: bool = option(
        False,
        "--log-num-zeros-in-grad",
        kind=RUN,
        help="record each iteration's number of zero gradient elements (num_zeros_in_grad: "
        "every element of the model once, experts included, the same at every layout)",
    )
    tensorboard_dir: Optional[str] = option(
        None,
        "--tensorboard-dir",
        kind=OUTPUT,
        type=str,
        metavar="DIR",
        help="write TensorBoard event files to DIR (megatron's scalar names: lm loss, lm loss "
        "validation, learning-rate, grad-norm, ...; the 'tensorboard' extra)",
    )
    wandb_project: Optional[str] = option(
        None,
        "--wandb-project",
        kind=OUTPUT,
        type=str,
        metavar="NAME",
        help="log the same scalars to this Weights & Biases project (the 'wandb' extra; "
        "WANDB_MODE=offline writes the run locally)",
    )
    wandb_exp_name: Optional[str] = option(
        None,
        "--wandb-exp-name",
        kind=OUTPUT,
        type=str,
        metavar="NAME",
        help="the W&B run's name",
    )
    wandb_save_dir: Optional[str] = option(
        None,
        "--wandb-save-dir",
        kind=OUTPUT,
        type=str,
        metavar="DIR",
        help="where W&B keeps its run files; default: --save DIR/wandb, else ./wandb",
    )
    # Output and checks.
    save_metrics: Optional[str] = option(
        None,
        "--save-metrics",
        kind=OUTPUT,
        type=str,
        metavar="DIR",
        help="write DIR/metrics.jsonl (one line per iteration) and DIR/loss.png (loss, "
        "gradient norm and learning rate against iteration)",
    )
    save: Optional[str] = option(
        None,
        "--save",
        kind=OUTPUT,
        type=str,
        metavar="DIR",
        help="save checkpoints to DIR/iter_NNNNNNN (every --save-interval iterations and at "
        "the end) and point DIR/latest_checkpointed_iteration.txt at the newest",
    )
    load: Optional[str] = option(
        None,
        "--load",
        kind=OUTPUT,
        type=str,
        metavar="DIR",
        help="resume from the newest complete checkpoint in DIR, or from DIR itself when it "
        "is one checkpoint's iter_NNNNNNN directory (any layout). No checkpoint there is an "
        "error, except when DIR is also --save (auto-resume: starts from scratch). The model "
        "and data settings the checkpoint recorded are used for the flags left out; a flag "
        "that contradicts them is refused",
    )
    export_hf: Optional[str] = option(
        None,
        "--export-hf",
        kind=OUTPUT,
        type=str,
        metavar="DIR",
        help="write the trained model to DIR in HuggingFace format (config.json + "
        "safetensors) at the end, and to DIR/iter_NNNNNNN beside each earlier --save",
    )
    save_interval: Optional[int] = option(
        None,
        "--save-interval",
        kind=OUTPUT,
        type=int,
        check=positive,
        help="iterations between checkpoints",
    )
    ckpt_step: Optional[int] = option(
        None,
        "--ckpt-step",
        kind=OUTPUT,
        type=int,
        metavar="N",
        check=non_negative,
        help="with --load DIR: load DIR/iter_N instead of the newest checkpoint",
    )
    finetune: bool = option(
        False,
        "--finetune",
        kind=OUTPUT,
        help="with --load: load the model weights only (no optimizer, scheduler or RNG "
        "state) and start at iteration 0; --data-path may differ from the saved run's",
    )
    no_load_optim: bool = option(
        False,
        "--no-load-optim",
        kind=OUTPUT,
        help="with --load: do not load the optimizer and scheduler state",
    )
    no_load_rng: bool = option(
        False, "--no-load-rng", kind=OUTPUT, help="with --load: do not restore the RNG states"
    )
    exit_on_missing_checkpoint: bool = option(
        False,
        "--exit-on-missing-checkpoint",
        kind=OUTPUT,
        help="with --load DIR --save DIR: an error instead of starting from scratch when DIR "
        "holds no checkpoint yet (any other --load without a checkpoint is an error anyway)",
    )
    override_opt_param_scheduler: bool = option(
        False,
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        kind=OUTPUT,
        help="with --load: the learning-rate and weight-decay schedule of this command line "
        "(--lr, --min-lr, --lr-warmup-iters, --lr-decay-style, --train-iters, --weight-decay) "
        "replaces the checkpoint's (megatron's flag); without it or "
        "--use-checkpoint-opt_param-scheduler another value is refused",
    )
    use_checkpoint_opt_param_scheduler: bool = option(
        False,
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        kind=OUTPUT,
        help="with --load: keep the checkpoint's learning-rate and weight-decay schedule, "
        "whatever this command line gives (megatron's flag)",
    )
    exit_signal_handler: bool = option(
        False,
        "--exit-signal-handler",
        kind=OUTPUT,
        help="on --exit-signal (to the launcher or to any rank) every rank finishes the "
        "step it is in, saves a checkpoint to --save and exits 0 (preemption)",
    )
    exit_signal: str = option(
        "SIGTERM",
        "--exit-signal",
        kind=OUTPUT,
        check=Check(
            "the name of a signal a handler can catch (SIGKILL and SIGSTOP cannot be "
            f"caught): one of {', '.join(catchable_signals())}",
            _is_signal_name,
        ),
        help="the signal --exit-signal-handler catches",
    )
    exit_duration_in_mins: Optional[float] = option(
        None,
        "--exit-duration-in-mins",
        type=float,
        check=positive_number,
        kind=OUTPUT,
        help="save a checkpoint to --save and exit 0 at the first step boundary after this "
        "many minutes of training",
    )
    exit_interval: Optional[int] = option(
        None,
        "--exit-interval",
        type=int,
        check=positive,
        kind=OUTPUT,
        help="save a checkpoint to --save and exit 0 after the iteration divisible by N",
    )
    compare_single_process: bool = option(
        False,
        "--compare-single-process",
        kind=OUTPUT,
        help="also train on one process and compare the losses per iteration; exit 1 when "
        "they differ by more than --compare-tolerance",
    )
    compare_tolerance: Optional[float] = option(
        None,
        "--compare-tolerance",
        kind=OUTPUT,
        type=float,
        check=non_negative_number,
        help="largest accepted |loss difference| at every iteration; default: in fp32 1e-4, "
        "or 10x the one-process run's own sensitivity when larger (a second one-process "
        "run with perturbed initial weights; docs/lifecycle.md), and with --bf16/--fp16 "
        "three times the largest difference between the one-process run in that precision "
        "and in fp32 (the precision's own rounding)",
    )
    progress: bool = option(
        True,
        "--no-progress",
        kind=RUN,
        help="hide the progress bar (rank 0 shows one by default)",
    )
    debug: bool = option(
        False,
        "--debug",
        kind=RUN,
        help="show the traceback of every error (also MEGATRON_DEBUG=1); without it an "
        "error in a flag, a file or the data is printed once, as one line",
    )


def flag_of(name: str) -> str:
    """The flag naming ``TrainingConfig`` field ``name`` in messages (e.g. ``--tp``)."""
    return option_of(_FIELDS[name]).flag


_FIELDS: Dict[str, Field] = {f.name: f for f in fields(TrainingConfig)}


def single_process_config(config: TrainingConfig) -> TrainingConfig:
    """The same run on one process: the layout and output options (``kind=LAYOUT`` /
    ``OUTPUT``: TP = CP = PP = 1, no VPP, no comparison, no metrics, no checkpoints) back at
    their defaults, one process."""
    changes = {f.name: getattr(config, f.name) for f in fields(config)}
    reset = options.fields_of_kind(TrainingConfig, LAYOUT, OUTPUT)
    changes.update({name: _FIELDS[name].default for name in reset})
    changes.update(nproc_per_node=1)
    return TrainingConfig(**changes)


# ----------------------------------------------------------------------------- command line


def build_parser(hf_families: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The ``python -m megatron.training`` / ``megatron-train`` command line, one option per
    ``TrainingConfig`` field (``options.build_parser``); ``hf_families``: the model types
    ``--hf-model``'s help lists (the converter's registry, passed by the command line)."""
    description = (
        "Supervised fine-tuning of a small GPT on generated prompt/response pairs "
        "(prompt tokens masked out of the loss), under any tensor/context/pipeline/"
        "virtual-pipeline/data-parallel layout. CPU (gloo) by default, NCCL when every "
        "process has a GPU. The logged loss is the same for every layout."
    )
    parser = options.build_parser(
        TrainingConfig, "python -m megatron.training", description, _SECTIONS
    )
    if hf_families:
        for action in parser._actions:
            if action.dest == "hf_model":
                action.help = action.help.replace(HF_FAMILIES, ", ".join(hf_families))
    return parser


def parse_args(
    argv: Optional[Sequence[str]] = None, hf_families: Sequence[str] = ()
) -> TrainingConfig:
    """Parse the command line into a ``TrainingConfig`` (no checks: ``validate_config``); a
    mistake raises ``UsageError``. ``hf_families``: see ``build_parser``."""
    return options.parse(build_parser(hf_families), TrainingConfig, argv)


def explicit_options(argv: Sequence[str]) -> List[str]:
    """The ``TrainingConfig`` fields that ``argv`` gives explicitly (whatever their value).
    Call ``parse_args`` first: a ``--help`` here would list no defaults."""
    return options.explicit_fields(build_parser(), argv)
