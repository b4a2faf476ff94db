"""The rules between the main job's flags, and the layout they imply.

``validate_config(config, world_size)`` runs each field's own check (declared with the
field in ``megatron.training.arguments``, which re-exports this module's two names), then the
rules between fields (the ones shared with ``TransformerConfig`` live in
``megatron.core.config_rules``); it rejects impossible layouts and combinations with a message
naming the flag, the value and what was expected, before any process group exists,
identically on every rank, and returns the ``Layout``. Derived model
defaults (query groups, FFN size, head size) come from ``resolved_model``. No torch here
(the launcher checks the command line before starting the workers).
"""

import re
from dataclasses import dataclass
from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple

from megatron.core import config_rules
from megatron.core.config_rules import CP_COMM_TYPES
from megatron.training.dpo_checks import check_dpo
from megatron.training.errors import UsageError
from megatron.training.flag_checks import Config
from megatron.training.flag_checks import Given as _Given
from megatron.training.flag_checks import default as _default
from megatron.training.flag_checks import flag as _flag
from megatron.training.flag_checks import require as _require
from megatron.training.fp8_flags import check_fp8_flags
from megatron.training.gpt_oss_flags import check_gpt_oss_flags
from megatron.training.model_settings import resolved_model
from megatron.training.mtp_flags import check_mtp_flags
from megatron.training.options import check_fields, is_int
from megatron.training.run_checks import check_run_options

__all__ = ["Layout", "validate_config"]


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
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None

    @property
    def hierarchical_sizes(self) -> Optional[List[int]]:
        """``hierarchical_context_parallel_sizes`` as the list megatron-core takes, or None."""
        sizes = self.hierarchical_context_parallel_sizes
        return None if sizes is None else list(sizes)

    @property
    def name(self) -> str:
        """Short name, e.g. ``cp2-pp2-vpp2-dp1``, ``tp2-sp-cp2-pp1-dp1`` or, with expert
        parallelism, ``cp2-pp1-dp2-ep2`` (``-etpN`` when the experts' TP differs)."""
        vpp = self.virtual_pipeline_model_parallel_size
        tp = self.tensor_model_parallel_size
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_parallel_size
        return (
            f"{f'tp{tp}-' if tp > 1 else ''}{'sp-' if self.sequence_parallel else ''}"
            f"cp{self.context_parallel_size}-pp{self.pipeline_model_parallel_size}"
            f"{f'-vpp{vpp}' if vpp else ''}-dp{self.data_parallel_size}"
            f"{f'-ep{ep}' if ep > 1 else ''}{f'-etp{etp}' if etp not in (None, tp) else ''}"
        )


def validate_config(
    config: Config, world_size: int, explicit: Optional[Collection[str]] = None
) -> Layout:
    """The layout of ``config`` on ``world_size`` processes, or ValueError saying why not.

    First each option's own check (``option(..., check=...)``), then the rules between
    options. DP = world / (TP * CP * PP); M = GBS / (micro batch * DP). Rules: world
    divisible by TP * CP * PP; seq_length divisible by 2 * CP (load-balanced CP split), times
    TP under sequence parallelism; heads, query groups, FFN size and vocabulary divisible by
    TP; sequence parallelism only with TP > 1; layers divisible by PP * VPP; GBS divisible by
    micro batch * DP; VPP only with PP >= 2 and a microbatch count the interleaved schedule
    can run; the cp_comm_type rules; combinations of options that one of them would ignore.
    ``explicit``: the fields the command line gave (``arguments.explicit_options``); such a
    flag is refused where it would be ignored even when it repeats the default (without
    ``explicit``, a flag counts as given when its value differs from the default).
    """
    c = config
    given = _Given(c, explicit)
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
        _check_interleaving(c, num_microbatches, dp)
    _check_cp_comm_type(c)
    if c.pack_sequences:
        _check_packing(c)
    check_run_options(c, given)
    _check_moe(c, world_size, given)
    check_gpt_oss_flags(c, given)
    _check_mla(c, given)
    check_fp8_flags(c, given)
    check_mtp_flags(c, given)
    _check_lora(c)
    _check_objective(c, given)
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
        c.expert_model_parallel_size,
        c.expert_tensor_parallel_size,
    )


def _check_interleaving(c: Config, num_microbatches: int, dp: int) -> None:
    """--vpp: the interleaved schedule can run ``num_microbatches`` per replica."""
    # Imported here: the self-launching process checks layouts without importing torch.
    from megatron.core.pipeline_parallel.schedules import interleaved_schedule_table

    vpp, pp = c.virtual_pipeline_model_parallel_size, c.pipeline_model_parallel_size
    try:
        interleaved_schedule_table(num_microbatches, vpp, pp, pp)
    except ValueError as exc:
        raise UsageError(
            f"--vpp {vpp}: {num_microbatches} microbatches per data-parallel replica "
            f"(--global-batch-size {c.global_batch_size} / (--micro-batch-size "
            f"{c.micro_batch_size} x DP {dp})) cannot be interleaved: {exc}"
        ) from None


_MOE_FLAGS = (
    "moe_router_topk",
    "moe_layer_freq",
    "moe_router_load_balancing_type",
    "moe_router_bias_update_rate",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_router_pre_softmax",
    "moe_router_score_function",
    "moe_router_dtype",
    "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_grouped_gemm",
    "moe_token_dispatcher_type",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


_LAYOUT_FLAGS = (
    "moe_token_dispatcher_type",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


def _check_moe(c: Config, world_size: int, given: _Given) -> None:
    """The mixture-of-experts flags (TransformerConfig's MoE checks, named by flag)."""
    if c.num_experts is None:
        for name in _MOE_FLAGS:
            # a layout flag typed at its no-op value (megatron scripts pass
            # --expert-model-parallel-size 1 for dense models) changes nothing
            value = getattr(c, name)
            harmless = name in _LAYOUT_FLAGS and value in (None, 1, _default(c, name))
            _require(
                harmless or not given(name),
                f"{_moe_flag(name)} {_shown(getattr(c, name))} needs --num-experts (a "
                "mixture-of-experts model)",
            )
        return
    _check_router_losses(c, given)
    experts, topk = c.num_experts, c.moe_router_topk
    tp, pp = c.tensor_model_parallel_size, c.pipeline_model_parallel_size
    ep = c.expert_model_parallel_size
    etp = c.expert_tensor_parallel_size or tp
    _require(
        tp == 1 or c.sequence_parallel,
        f"--num-experts {experts} with --tp {tp} needs --sequence-parallel (without it every "
        "TP rank routes the same tokens and the router losses would depend on the layout)",
    )
    _require(
        experts % ep == 0,
        f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}",
    )
    _require(
        world_size % (etp * ep * pp) == 0,
        f"world size {world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
        f"--expert-model-parallel-size {ep} x --pp {pp} = {etp * ep * pp}",
    )
    _require(topk <= experts, f"--moe-router-topk {topk} must be at most --num-experts {experts}")
    _require(
        not (topk == 1 and c.moe_router_score_function == "softmax") or c.moe_router_pre_softmax,
        "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax",
    )
    _require(
        not c.moe_router_enable_expert_bias or c.moe_router_score_function == "sigmoid",
        "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid",
    )
    _require(
        not c.moe_shared_expert_gate or c.moe_shared_expert_intermediate_size is not None,
        "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size",
    )
    groups, group_topk = c.moe_router_num_groups, c.moe_router_group_topk
    _require(
        (groups is None) == (group_topk is None),
        "--moe-router-num-groups and --moe-router-group-topk go together (group-limited "
        "routing)",
    )
    if groups is not None:
        _require(
            experts % groups == 0 and group_topk <= groups and topk % group_topk == 0,
            f"--moe-router-num-groups {groups} / --moe-router-group-topk {group_topk}: the "
            f"groups must divide --num-experts {experts}, group-topk be at most the groups "
            f"and divide --moe-router-topk {topk}",
        )
    ffn = c.moe_ffn_hidden_size or c.ffn_hidden_size or 4 * c.hidden_size
    _require(
        ffn % etp == 0,
        f"the expert FFN size {ffn} is not divisible by --expert-tensor-parallel-size {etp}",
    )
    _require(
        config_rules.moe_layer_pattern(c.moe_layer_freq, c.num_layers) is not None,
        f"--moe-layer-freq {c.moe_layer_freq}: expected N >= 1 or --num-layers "
        f"({c.num_layers}) 0/1 entries",
    )


_MLA_FLAGS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
    "rotary_scaling_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)
_YARN_FLAGS = _MLA_FLAGS[6:]


def _check_mla(c: Config, given: _Given) -> None:
    """The multi-latent attention flags: each needs --multi-latent-attention, the yarn ones
    need --rope-type yarn, and the rotary part lives in the attention (rope positions)."""
    if not c.multi_latent_attention:
        for name in _MLA_FLAGS[:6] + _YARN_FLAGS[1:]:  # --rotary-scaling-factor: yarn's too
            _require(
                not given(name),
                f"{_moe_flag(name)} {_shown(getattr(c, name))} needs --multi-latent-attention",
            )
        return
    _require(
        c.position_embedding_type == "rope",
        f"--multi-latent-attention needs --position-embedding-type rope (its rotary part is "
        f"inside the attention), got {c.position_embedding_type}",
    )
    if c.rope_type == "rope":
        for name in _YARN_FLAGS:
            _require(
                not given(name),
                f"{_moe_flag(name)} {_shown(getattr(c, name))} is a yarn setting, but "
                "--rope-type is rope; use --rope-type yarn or leave it out",
            )


def _check_router_losses(c: Config, given: _Given) -> None:
    """The load-balancing coefficient and the expert-bias rate, each used by its mode."""
    _require(
        not (c.moe_router_load_balancing_type == "none" and given("moe_aux_loss_coeff")),
        f"--moe-aux-loss-coeff {c.moe_aux_loss_coeff} weighs the load-balancing loss, but "
        "--moe-router-load-balancing-type none computes none; use aux_loss or seq_aux_loss, "
        "or leave --moe-aux-loss-coeff out",
    )
    _require(
        c.moe_router_enable_expert_bias or not given("moe_router_bias_update_rate"),
        f"--moe-router-bias-update-rate {c.moe_router_bias_update_rate} is the step of the "
        "expert bias, which is off: add --moe-router-enable-expert-bias (with "
        "--moe-router-score-function sigmoid), or leave the rate out",
    )


def _moe_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_packing(c: Config) -> None:
    """--pack-sequences: one packed row per microbatch, documents padded to a multiple of
    PACK_PAD_MULTIPLE that the 2C context-parallel chunks divide (SFT; with --dpo a row of
    --micro-batch-size pairs at its own length, padded as the layout needs)."""
    # Imported here: the self-launching process checks layouts without importing torch.
    from megatron.training.data import PACK_PAD_MULTIPLE

    if c.dpo:  # whole pairs: --micro-batch-size pairs a row (dpo_checks.check_packed_pairs)
        return
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


def _check_windowed_cp(c: Config) -> None:
    """At --cp > 1 a sliding-window layer needs a --cp-comm-type that computes the window."""
    bad = config_rules.unwindowed_cp_layers(
        c.window_size, c.window_attn_skip_freq, c.cp_comm_type, c.num_layers
    )
    if bad:
        layer, kind = bad[0]
        able = " or ".join(config_rules.WINDOWED_CP_COMM_TYPES)
        _require(
            False,
            f"--window-size {' '.join(map(str, c.window_size))} at --cp "
            f"{c.context_parallel_size}: layer {layer} has a sliding window and --cp-comm-type "
            f"{kind}, which cannot compute it; use --cp-comm-type {able} (for every windowed "
            "layer: one kind, or one per layer)",
        )


def _check_cp_comm_type(c: Config) -> None:
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
    if cp > 1:
        _check_windowed_cp(c)
    _require(
        cp > 1 or set(kinds) == {_default(c, "cp_comm_type")},
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
    model = resolved_model(c)
    heads, groups = model["num_attention_heads"], model["num_query_groups"]
    for kind, split, flag in (("a2a", cp, "--cp"), ("a2a+p2p", (hierarchical or [1])[0], "A")):
        _require(
            kind not in kinds or (heads % (tp * split) == 0 and groups % (tp * split) == 0),
            f"--cp-comm-type {kind} splits each tensor-parallel rank's heads over {flag}: "
            f"--num-attention-heads ({heads}) and the query groups ({groups}) must be "
            f"divisible by --tp x {flag} = {tp * split}",
        )


def _check_tensor_parallel(c: Config) -> None:
    """The sizes TP splits (heads, query groups, FFN, vocabulary: the shared rule of
    ``config_rules``); the sequence under sequence parallelism (2C chunks, each split over
    TP); an even head size for rotary embeddings."""
    tp, cp = c.tensor_model_parallel_size, c.context_parallel_size
    _require(
        config_rules.sequence_parallel_allowed(c.sequence_parallel, tp),
        f"--sequence-parallel needs tensor parallelism: --tp must be > 1, got {tp}",
    )
    model = resolved_model(c)
    heads, groups, ffn = (
        model["num_attention_heads"],
        model["num_query_groups"],
        model["ffn_hidden_size"],
    )
    _require(
        config_rules.is_positive_multiple(heads, groups),
        f"--num-query-groups {groups} must be an integer >= 1 dividing --num-attention-heads "
        f"{heads}",
    )
    splits = {
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "ffn_hidden_size": ffn,
    }  # the vocabulary is padded to a multiple of TP (--make-vocab-size-divisible-by)
    for name, value in config_rules.tensor_parallel_misfits(tp, splits):
        raise UsageError(f"{_flag(c, name)} {value} is not divisible by --tp {tp}")
    if c.position_embedding_type in ("rope", "yarn"):
        head_dim = model["kv_channels"]
        _require(
            head_dim % 2 == 0,
            f"--position-embedding-type {c.position_embedding_type} needs an even head size, "
            f"got --hidden-size {c.hidden_size} / --num-attention-heads {heads} = {head_dim}",
        )
        rotary = int(head_dim * c.rotary_percent)
        _require(
            rotary >= 2 and rotary % 2 == 0,
            f"--rotary-percent {c.rotary_percent} rotates int({head_dim} x "
            f"{c.rotary_percent}) = {rotary} channels of each head; expected an even number "
            ">= 2 (rotary embeddings rotate pairs)",
        )
    if c.sequence_parallel:
        _require(
            c.seq_length % (2 * cp * tp) == 0,
            f"--seq-length {c.seq_length} is not divisible by --tp {tp} x 2 x --cp {cp} = "
            f"{2 * cp * tp} (sequence parallelism splits each of the 2C chunks over TP)",
        )


LORA_FIELDS = (
    "lora_alpha",
    "lora_target_modules",
    "lora_exclude_modules",
    "lora_dropout",
    "lora_dropout_position",
    "lora_a_init_method",
    "lora_b_init_method",
    "save_trainable_params_only",
    "pretrained_checkpoint",
    "merge_lora",
    "hf_adapter",
)


def _check_objective(c: Config, given: _Given) -> None:
    """The --dpo flags (``dpo_checks``) and the optimizer's (``_check_optimizer``)."""
    check_dpo(c)
    _check_optimizer(c, given)


def _check_optimizer(c: Config, given: _Given) -> None:
    """Adam's flags need --optimizer adam, --sgd-momentum needs --optimizer sgd."""
    unused = ("sgd_momentum",) if c.optimizer == "adam" else ADAM_FIELDS
    for name in unused:
        _require(
            not given(name),
            f"{_flag(c, name)} {getattr(c, name)} with --optimizer {c.optimizer}: it sets "
            f"{'SGD' if name == 'sgd_momentum' else 'Adam'}'s state, which "
            f"--optimizer {c.optimizer} does not have",
        )


ADAM_FIELDS = ("adam_beta1", "adam_beta2", "adam_eps")


def _check_lora(c: Config) -> None:
    """The --lora-* flags need --lora-dim; adapters on column-parallel layers split their
    rank over TP; a base comes from one place; adapter-only saves need --save."""
    if c.lora_dim is None:
        for name in LORA_FIELDS:
            value = getattr(c, name)
            _require(
                value == _default(c, name),
                f"{_flag(c, name)} {_shown(value)} needs --lora-dim R (LoRA is off without it)",
            )
        return
    column = {"linear_qkv", "linear_fc1", "linear_q_up_proj", "linear_q_proj", "linear_kv_up_proj"}
    column_targets = any(
        t in column or any(ch in t for ch in "*?[.") for t in c.lora_target_modules
    )
    _require(
        not column_targets or c.lora_dim % c.tensor_model_parallel_size == 0,
        f"--lora-dim {c.lora_dim} is not divisible by --tp {c.tensor_model_parallel_size} "
        "(the adapters of column-parallel layers split their rank over TP)",
    )
    for target in [*c.lora_target_modules, *c.lora_exclude_modules]:
        _require(
            target in config_rules.LORA_ALL_TARGETS or any(ch in target for ch in "*?[."),
            f"--lora-target-modules / --lora-exclude-modules {target!r}: expected one of "
            f"{', '.join(config_rules.LORA_ALL_TARGETS)} or a wildcard pattern",
        )
    _check_lora_targets(c)
    _check_lora_excludes(c)
    _require(
        not (c.pretrained_checkpoint and c.hf_model),
        f"--pretrained-checkpoint {c.pretrained_checkpoint} and --hf-model {c.hf_model} both "
        "give the base weights; pass one",
    )
    _require(
        not c.save_trainable_params_only or c.save is not None,
        "--save-trainable-params-only needs --save DIR",
    )
    _require(not c.merge_lora or c.export_hf, "--merge-lora needs --export-hf DIR")
    _check_lora_expert_bias(c)
    _require(
        not c.hf_adapter or c.hf_model,
        f"--hf-adapter {c.hf_adapter} needs --hf-model (the base the adapter was trained on)",
    )
    _require(
        not (c.merge_lora and c.save_trainable_params_only and c.save_interval),
        "--merge-lora with --save-trainable-params-only and --save-interval: the interval "
        "exports merge from the saved checkpoints, which hold no base; drop one of them",
    )


def _check_lora_expert_bias(c: Config) -> None:
    """The expert bias (``--moe-router-enable-expert-bias``, set by a DeepSeek-V3
    ``--hf-model``) moves during LoRA training though it is no adapter: what keeps only the
    adapters would drop its trained value."""
    if not (c.num_experts and c.moe_router_enable_expert_bias):
        return
    _require(
        not (c.export_hf and not c.merge_lora),
        f"--export-hf {c.export_hf} with --lora-dim writes a PEFT adapter, which cannot carry "
        "the expert bias that --moe-router-enable-expert-bias moves during training; add "
        "--merge-lora (the merged model, trained bias included)",
    )
    _require(
        not c.save_trainable_params_only,
        "--save-trainable-params-only keeps the LoRA adapters only, not the expert bias that "
        "--moe-router-enable-expert-bias moves during training (a resume would restart it "
        "from the base model's); save full checkpoints",
    )


def _check_lora_targets(c: Config) -> None:
    """Before any worker starts: every --lora-target-modules pattern names some linear layer
    of the model, and a layer's routed experts are adapted all or none per projection."""
    names = _lora_names(c)

    def named(name: str, patterns) -> bool:
        return any(config_rules.lora_pattern_matches(name, p) for p in patterns)

    for target in c.lora_target_modules:
        _require(
            any(config_rules.lora_pattern_matches(n, target) for n in names),
            f"--lora-target-modules {target!r} matches no layer of the model (its linear "
            f"layers are named like {names[0]}, {names[-1]})",
        )
    experts: Dict[str, List[bool]] = {}  # "<layer>.mlp.experts.<proj>" -> chosen per expert
    for name in names:
        if ".mlp.experts.local_experts." in name:
            layer, rest = name.split(".mlp.experts.local_experts.")
            chosen = named(name, c.lora_target_modules) and not named(name, c.lora_exclude_modules)
            experts.setdefault(f"{layer}.mlp.experts.{rest.split('.')[1]}", []).append(chosen)
    for where, chosen in experts.items():
        picked = [g for g, yes in enumerate(chosen) if yes]
        _require(
            len(picked) in (0, len(chosen)),
            f"--lora-target-modules {' '.join(c.lora_target_modules)} (less "
            f"--lora-exclude-modules {' '.join(c.lora_exclude_modules) or '(none)'}) adapts "
            f"routed experts {picked} of {where} but not the others: expert adapters go on "
            "every expert of a layer's projection or on none",
        )
        etp = c.expert_tensor_parallel_size or c.tensor_model_parallel_size
        _require(
            not picked or not where.endswith("linear_fc1") or c.lora_dim % etp == 0,
            f"--lora-dim {c.lora_dim} is not divisible by the expert-tensor-parallel size "
            f"{etp} (--etp; the adapters of {where} split their rank over it)",
        )
        _require(
            not picked or c.fp8_format is None,
            f"--lora-target-modules {' '.join(c.lora_target_modules)} adapts the routed "
            f"experts of {where}, which do not take adapters with --fp8-format {c.fp8_format} "
            "(FP8 expert GEMMs); add --lora-exclude-modules '*.experts.*'",
        )


def _lora_names(c: Config) -> List[str]:
    """The global names of the model's linear layers a LoRA pattern can name."""
    moe = c.num_experts is not None
    return config_rules.lora_module_names(
        c.num_layers,
        config_rules.moe_layer_pattern(c.moe_layer_freq, c.num_layers) if moe else None,
        c.num_experts or 0,
        moe and c.moe_shared_expert_intermediate_size is not None,
        config_rules.lora_attention_names(c.multi_latent_attention, c.q_lora_rank is not None),
    )


def _check_lora_excludes(c: Config) -> None:
    """Every --lora-exclude-modules pattern names some adaptable layer of the model (a
    pattern matching nothing is a typo, not an exclusion): else an error naming the pattern
    and the layers there are."""
    names = _lora_names(c)
    for pattern in c.lora_exclude_modules:
        _require(
            any(config_rules.lora_pattern_matches(n, pattern) for n in names),
            f"--lora-exclude-modules {pattern!r} matches no layer of the model; its adaptable "
            f"layers are {_layer_summary(names, c.num_layers, c.num_experts)}",
        )


def _layer_summary(names: Sequence[str], num_layers: int, num_experts: Optional[int]) -> str:
    """``names`` with the layer and expert indices folded: decoder.layers.<0..L-1>.{...}."""
    kinds = []
    for name in names:
        kind = name.split(".", 3)[3]
        if num_experts:
            kind = re.sub(r"local_experts\.\d+\.", f"local_experts.<0..{num_experts - 1}>.", kind)
        if kind not in kinds:
            kinds.append(kind)
    return f"decoder.layers.<0..{num_layers - 1}>.{{{', '.join(kinds)}}}"


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) or "(empty)"
    return str(value)
