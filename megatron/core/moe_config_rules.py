"""``TransformerConfig``'s mixture-of-experts checks (megatron-core 0.16.1's, plus the
refusals of this core): the one home of the MoE config rules, torch-free and on the rules
floor, below ``transformer_config`` (which calls ``check_moe_config``) and the MoE layers.

Only dropless routing is implemented, and every setting whose result would depend on how
the tokens are split over ranks (capacity factors, running averages, per-rank noise,
device-limited routing, ...) is refused by name: this core's contract is that gradients do
not depend on the layout.
"""

import warnings

from megatron.core import config_rules

_LAYOUT = "so the result would depend on the parallel layout"


def check_moe_config(config) -> None:
    """Raise (``ValueError`` for invalid values, ``NotImplementedError`` for settings this
    core refuses) naming the field; fill ``moe_ffn_hidden_size`` (default
    ``ffn_hidden_size``, with megatron-core's warning)."""
    experts = config.num_moe_experts
    if config.expert_model_parallel_size > 1 and experts is None:
        raise ValueError(
            "num_moe_experts must be non None to use expert-parallel "
            f"(expert_model_parallel_size={config.expert_model_parallel_size})"
        )
    if experts is None:
        if config.moe_ffn_hidden_size is not None:
            raise ValueError(
                f"moe_ffn_hidden_size={config.moe_ffn_hidden_size!r} must be None when "
                "num_moe_experts is not set"
            )
        return
    if not isinstance(experts, int) or isinstance(experts, bool) or experts <= 0:
        raise ValueError(f"num_moe_experts must be a positive int, got {experts!r}")
    if config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
        warnings.warn(
            "moe_ffn_hidden_size is not set, using ffn_hidden_size instead.", stacklevel=3
        )
    if config.moe_expert_capacity_factor is not None and config.moe_expert_capacity_factor < 0:
        config.moe_expert_capacity_factor = None  # megatron-core: negative means dropless
    _refuse_layout_dependent(config)
    _refuse_unimplemented(config)
    _check_router(config)
    _check_sizes(config)


def _refuse_layout_dependent(config) -> None:
    """Settings whose routing or losses would depend on the layout."""
    refusals = [
        (
            "moe_expert_capacity_factor",
            config.moe_expert_capacity_factor is not None,
            "token dropping by capacity decides per sequence-parallel / context-parallel "
            f"shard and expert-parallel rank, {_LAYOUT}; only dropless routing is supported "
            "(expected None)",
        ),
        (
            "moe_pad_expert_input_to_capacity",
            config.moe_pad_expert_input_to_capacity,
            f"padding to capacity needs a capacity factor, which is refused ({_LAYOUT}); "
            "expected False",
        ),
        (
            "moe_token_drop_policy",
            config.moe_token_drop_policy != "probs",
            f"a drop policy needs a capacity factor, which is refused ({_LAYOUT}); "
            "expected 'probs'",
        ),
        (
            "moe_token_dropping",
            config.moe_token_dropping,
            f"token dropping decides per shard, {_LAYOUT}; expected False",
        ),
        (
            "moe_router_topk_limited_devices",
            config.moe_router_topk_limited_devices is not None,
            "device-limited routing ties the routing to the expert-parallel size, "
            f"{_LAYOUT}; use moe_router_num_groups / moe_router_group_topk (expected None)",
        ),
        (
            "moe_input_jitter_eps",
            config.moe_input_jitter_eps is not None,
            f"input jitter draws noise per rank, {_LAYOUT}; expected None",
        ),
        (
            "moe_router_force_load_balancing",
            config.moe_router_force_load_balancing,
            f"forced balancing replaces the logits by per-rank random ones, {_LAYOUT}; "
            "expected False",
        ),
        (
            "moe_enable_routing_replay",
            config.moe_enable_routing_replay,
            "routing replay is not implemented; expected False",
        ),
    ]
    for name, refused, why in refusals:
        if refused:
            raise NotImplementedError(f"{name}={getattr(config, name)!r}: {why}")
    kinds = config.moe_router_load_balancing_type
    for kind in kinds if isinstance(kinds, (list, tuple)) else [kinds]:
        if kind in config_rules.MOE_LOAD_BALANCING_REFUSED:
            raise NotImplementedError(
                f"moe_router_load_balancing_type={kind!r}: "
                f"{config_rules.MOE_LOAD_BALANCING_REFUSED[kind]}, {_LAYOUT}; expected one "
                f"of {config_rules.MOE_LOAD_BALANCING_TYPES}"
            )
        if kind not in config_rules.MOE_LOAD_BALANCING_TYPES:
            raise ValueError(
                f"moe_router_load_balancing_type={kind!r}; expected one of "
                f"{config_rules.MOE_LOAD_BALANCING_TYPES}"
            )
    if config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        raise NotImplementedError(
            f"num_moe_experts={config.num_moe_experts} with tensor_model_parallel_size="
            f"{config.tensor_model_parallel_size} needs sequence_parallel=True: without it "
            "every TP rank routes the same tokens and the router losses would be counted "
            f"TP times, {_LAYOUT}"
        )


def _refuse_unimplemented(config) -> None:
    """Kernels, fusions and overlaps this core does not have."""
    dispatcher = config.moe_token_dispatcher_type
    if dispatcher == "flex":
        raise NotImplementedError(
            "moe_token_dispatcher_type='flex' (DeepEP / HybridEP) is not supported; expected "
            f"one of {config_rules.MOE_TOKEN_DISPATCHERS}"
        )
    if dispatcher not in config_rules.MOE_TOKEN_DISPATCHERS:
        raise ValueError(
            f"moe_token_dispatcher_type={dispatcher!r}; expected one of "
            f"{config_rules.MOE_TOKEN_DISPATCHERS}"
        )
    defaults = {
        "moe_enable_deepep": False,
        "moe_flex_dispatcher_backend": "deepep",
        "moe_deepep_num_sms": 20,
        "moe_hybridep_num_sms": 16,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "moe_router_padding_for_quantization": False,
        "moe_router_padding_for_fp8": False,
        "moe_layer_recompute": False,
        "moe_latent_size": None,
        "moe_extended_tp": False,
        "overlap_moe_expert_parallel_comm": False,
    }
    why = {
        "moe_enable_deepep": "the flex dispatcher (DeepEP) is not supported",
        "moe_flex_dispatcher_backend": "the flex dispatcher is not supported",
        "moe_deepep_num_sms": "the flex dispatcher (DeepEP) is not supported",
        "moe_hybridep_num_sms": "the flex dispatcher (HybridEP) is not supported",
        "moe_permute_fusion": "Transformer Engine's permute fusion is not available",
        "moe_router_fusion": "Transformer Engine's router fusion is not available",
        "moe_router_padding_for_quantization": "FP8 experts need no padding (each expert is "
        "its own FP8 GEMM) and FP4 is not supported",
        "moe_router_padding_for_fp8": "FP8 experts need no padding (each expert is its own "
        "FP8 GEMM)",
        "moe_layer_recompute": "MoE-layer recomputation is not implemented (use "
        "recompute_granularity='full')",
        "moe_latent_size": "latent MoE is not implemented",
        "moe_extended_tp": "extended tensor parallelism is not implemented (use "
        "expert_tensor_parallel_size)",
        "overlap_moe_expert_parallel_comm": "overlapping the expert-parallel exchange needs "
        "CUDA streams, which this core does not use",
    }
    for name, default in defaults.items():
        if getattr(config, name) != default:
            raise NotImplementedError(
                f"{name}={getattr(config, name)!r}: {why[name]}; expected {default!r}"
            )
    if config.variable_seq_lengths and dispatcher == "allgather":
        raise ValueError(
            "moe_token_dispatcher_type='allgather' does not support variable_seq_lengths=True; "
            "use 'alltoall'"
        )
    if config.moe_shared_expert_overlap and dispatcher != "alltoall":
        raise ValueError(
            "moe_shared_expert_overlap=True only works with moe_token_dispatcher_type="
            f"'alltoall' (got {dispatcher!r})"
        )


def _check_router(config) -> None:
    """megatron-core's router checks, with the fields named."""
    experts, topk = config.num_moe_experts, config.moe_router_topk
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= experts:
        raise ValueError(
            f"moe_router_topk={topk!r} must be an int between 1 and num_moe_experts ({experts})"
        )
    score = config.moe_router_score_function
    if score not in config_rules.MOE_SCORE_FUNCTIONS:
        raise ValueError(
            f"moe_router_score_function={score!r}; expected one of "
            f"{config_rules.MOE_SCORE_FUNCTIONS}"
        )
    if config.moe_router_dtype not in config_rules.MOE_ROUTER_DTYPES:
        raise ValueError(
            f"moe_router_dtype={config.moe_router_dtype!r}; expected one of "
            f"{config_rules.MOE_ROUTER_DTYPES}"
        )
    if config.moe_router_enable_expert_bias and score != "sigmoid":
        raise ValueError(
            "moe_router_enable_expert_bias=True (aux-loss-free routing) only supports "
            f"moe_router_score_function='sigmoid' (got {score!r})"
        )
    if topk == 1 and score == "softmax" and not config.moe_router_pre_softmax:
        raise ValueError(
            "moe_router_topk=1 with moe_router_score_function='softmax' needs "
            "moe_router_pre_softmax=True (a softmax over one selected logit has zero gradient)"
        )
    if config.moe_apply_probs_on_input and topk != 1:
        raise ValueError(f"moe_apply_probs_on_input=True needs moe_router_topk=1 (got {topk})")
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if group_topk:
        if not groups:
            raise ValueError(
                f"moe_router_group_topk={group_topk} (group-limited routing) needs "
                "moe_router_num_groups"
            )
        if experts % groups != 0:
            raise ValueError(
                f"num_moe_experts ({experts}) must be divisible by moe_router_num_groups "
                f"({groups})"
            )
        if group_topk > groups:
            raise ValueError(
                f"moe_router_group_topk ({group_topk}) must be at most moe_router_num_groups "
                f"({groups})"
            )
        if topk % group_topk != 0:
            raise ValueError(
                f"moe_router_topk ({topk}) must be divisible by moe_router_group_topk "
                f"({group_topk})"
            )
    elif groups is not None:
        raise ValueError(
            f"moe_router_num_groups={groups} needs moe_router_group_topk (group-limited "
            "routing); expected None without it"
        )
    kinds = config.moe_router_load_balancing_type
    coeffs = config.moe_aux_loss_coeff
    if isinstance(kinds, (list, tuple)) and (
        not isinstance(coeffs, (list, tuple)) or len(coeffs) != len(kinds)
    ):
        raise ValueError(
            f"moe_aux_loss_coeff ({coeffs!r}) must be a list of the same length as "
            f"moe_router_load_balancing_type ({list(kinds)!r})"
        )


def _check_sizes(config) -> None:
    """Splits that must be even, and the MoE layer pattern."""
    experts, ep = config.num_moe_experts, config.expert_model_parallel_size
    if experts % ep != 0:
        raise ValueError(
            f"num_moe_experts ({experts}) must be a multiple of expert_model_parallel_size ({ep})"
        )
    etp = config.expert_tensor_parallel_size
    if not config_rules.is_positive_multiple(config.moe_ffn_hidden_size, etp):
        raise ValueError(
            f"moe_ffn_hidden_size ({config.moe_ffn_hidden_size!r}) must be a positive multiple "
            f"of expert_tensor_parallel_size ({etp})"
        )
    shared = config.moe_shared_expert_intermediate_size
    if shared is not None:
        if not isinstance(shared, int) or shared <= 0:
            raise ValueError(
                "moe_shared_expert_intermediate_size must be num_shared_experts * "
                f"ffn_size_of_each_shared_expert (> 0), but got {shared!r}"
            )
        tp = config.tensor_model_parallel_size
        if shared % tp != 0:
            raise ValueError(
                f"moe_shared_expert_intermediate_size ({shared}) must be a multiple of "
                f"tensor_model_parallel_size ({tp})"
            )
    elif config.moe_shared_expert_gate:
        raise ValueError(
            "moe_shared_expert_gate=True needs a shared expert "
            "(moe_shared_expert_intermediate_size); got None"
        )
    if config_rules.moe_layer_pattern(config.moe_layer_freq, config.num_layers) is None:
        raise ValueError(
            f"moe_layer_freq={config.moe_layer_freq!r}: expected an int >= 1 (every N-th "
            f"layer is a MoE layer) or a list of num_layers ({config.num_layers}) 0/1 entries"
        )
