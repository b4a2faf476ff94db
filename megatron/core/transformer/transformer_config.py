"""Transformer shape, architecture and loss settings on top of the parallel configuration."""

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import torch.nn.functional as F

from megatron.core import config_rules
from megatron.core.config_rules import CP_COMM_TYPES
from megatron.core.fp8.config import check_fp8_config
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.moe_config_rules import check_moe_config
from megatron.core.transformer.enums import AttnBackend
from megatron.core.utils import init_method_normal, scaled_init_method_normal


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Model sizes, architecture options and the loss-normalization mode (megatron-core
    0.16.1's field names and defaults).

    ``calculate_per_token_loss=True`` trains ``sum(loss) / sum(tokens)`` over the global
    batch; the default trains the mean over microbatches of each microbatch's token mean.
    Architecture: ``normalization`` "LayerNorm" | "RMSNorm"; ``gated_linear_unit`` with
    ``activation_func`` (SwiGLU: ``F.silu``); ``num_query_groups`` (grouped-query attention,
    default: one group per head); ``add_bias_linear`` / ``add_qkv_bias``. ``label_smoothing``
    is an extra of this core (megatron-core 0.16.1 has no such field): the GPT's per-token
    loss is the label-smoothed cross-entropy over the whole vocabulary.

    Activation recomputation (megatron-core's fields and defaults): ``recompute_granularity``
    "full" recomputes whole layers (``recompute_method`` "uniform": every group of
    ``recompute_num_layers`` layers of a chunk is one checkpoint; "block": the first
    ``recompute_num_layers`` layers of each chunk are checkpointed one by one), "selective"
    the ``recompute_modules`` of every layer ("core_attn", "mlp", "layernorm"; default
    ["core_attn"]). Dropout masks are replayed from the RNG states, so gradients are those of
    the run without recomputation. ``distribute_saved_activations`` is not supported.

    FP8 (``fp8`` "e4m3" | "hybrid" with ``fp8_recipe="tensorwise"``, ``fp8_margin``,
    ``fp8_wgrad``): the attention and MLP linears' GEMMs in FP8, every scale from the tensor's
    global amax (``megatron.core.fp8``); the other FP8/FP4 fields must keep their defaults.
    """

    # megatron-core's fields, one declaration each: runs of them share a shape by design.
    num_layers: int = 0
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: Optional[float] = 0.1
    hidden_size: int = 0
    num_attention_heads: int = 0
    softmax_scale: Optional[float] = None
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    fp32_residual_connection: bool = False
    apply_residual_connection_post_layernorm: bool = False
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    gated_linear_unit: bool = False
    activation_func: Callable = F.gelu
    num_moe_experts: Optional[int] = None
    rotary_interleaved: bool = False
    window_size: Optional[tuple] = None
    # megatron-core's GPT-OSS fields: which layers keep the window (int N: every N-th layer
    # is full attention; list: 1 = sliding window, 0 = full, per layer), attention sinks
    # ("learnable": a per-head logit in the softmax denominator; "off-by-one": a sink of 0),
    # the gated unit's act(gate) * (up + offset) and the clamp of gate (above) and up (both)
    window_attn_skip_freq: Optional[Union[int, List[int]]] = None
    softmax_type: str = "vanilla"
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: Optional[float] = None
    # YaRN rotary embeddings of GPTModel(position_embedding_type="yarn") (megatron-core's names)
    yarn_rotary_scaling_factor: Optional[float] = None
    yarn_original_max_position_embeddings: Optional[int] = None
    yarn_beta_fast: Optional[float] = None
    yarn_beta_slow: Optional[float] = None
    yarn_mscale: Optional[float] = None
    yarn_mscale_all_dim: Optional[float] = None
    yarn_correction_range_round_to_int: bool = True
    normalization: str = "LayerNorm"
    qk_layernorm: bool = False
    # An extra of this core: the q/k norms over all heads of each projection together
    # (OLMoE), not per head; needs qk_layernorm and RMSNorm (``WholeProjectionRMSNorm``).
    qk_layernorm_whole_projection: bool = False
    # Extras of this core for Gemma 2 / 3 (megatron-core 0.16.1 has no such fields):
    # ``sandwich_layernorm``: a norm after attention and after the MLP too, before each
    # residual add (``post_self_attn_layernorm``, ``post_mlp_layernorm``);
    # ``embedding_scale_sqrt_hidden``: the word embeddings times sqrt(hidden_size) (the
    # factor rounded to the embeddings' dtype); ``attn_logit_softcapping``: attention scores
    # c * tanh(s / c); ``final_logit_softcapping``: the output logits likewise;
    # ``local_rotary_base``: the RoPE base of the sliding-window layers (None: the model's).
    sandwich_layernorm: bool = False
    embedding_scale_sqrt_hidden: bool = False
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    local_rotary_base: Optional[float] = None
    test_mode: bool = False
    calculate_per_token_loss: bool = False
    multi_latent_attention: bool = False
    init_method: Optional[Callable] = None
    output_layer_init_method: Optional[Callable] = None
    init_method_std: float = 0.02
    embedding_init_method: Optional[Callable] = None
    embedding_init_method_std: Optional[float] = None
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True
    bias_activation_fusion: bool = False
    masked_softmax_fusion: bool = False
    persist_layer_norm: bool = False
    memory_efficient_layer_norm: bool = False
    bias_dropout_fusion: bool = False
    apply_rope_fusion: bool = False
    cross_entropy_loss_fusion: bool = False
    cp_comm_type: Optional[Union[str, List[str]]] = None
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    distribute_saved_activations: Optional[bool] = False
    recompute_modules: Optional[List[str]] = None
    label_smoothing: float = 0.0
    attention_backend: AttnBackend = AttnBackend.auto
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False
    moe_shared_expert_overlap: bool = False
    moe_layer_freq: Union[int, List[int]] = 1
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_load_balancing_type: Union[str, List[str]] = "aux_loss"
    moe_router_topk: int = 2
    moe_enable_routing_replay: bool = False
    moe_router_topk_limited_devices: Optional[int] = None
    moe_router_padding_for_quantization: Optional[bool] = False
    moe_router_padding_for_fp8: Optional[bool] = False
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_score_function: str = "softmax"
    moe_router_dtype: Optional[str] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_force_load_balancing: bool = False
    moe_grouped_gemm: bool = False
    moe_use_legacy_grouped_gemm: bool = False
    moe_aux_loss_coeff: Union[float, List[float]] = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_input_jitter_eps: Optional[float] = None
    moe_token_dropping: bool = False
    moe_token_dispatcher_type: str = "allgather"
    moe_enable_deepep: bool = False
    moe_flex_dispatcher_backend: str = "deepep"
    moe_per_layer_logging: bool = False
    moe_expert_capacity_factor: Optional[float] = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    moe_layer_recompute: bool = False
    moe_permute_fusion: bool = False
    moe_router_fusion: bool = False
    moe_apply_probs_on_input: bool = False
    moe_latent_size: Optional[int] = None
    moe_deepep_num_sms: int = 20
    moe_hybridep_num_sms: int = 16
    moe_extended_tp: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    # FP8 (megatron.core.fp8.config says what is implemented; the rest is refused by name)
    activation_func_fp8_input_store: bool = False
    fp8: Optional[str] = None
    fp8_recipe: Optional[str] = "delayed"
    fp8_param: bool = False
    fp8_quantizer_factory: Optional[str] = None
    fp8_margin: int = 0
    fp8_interval: int = 1
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True
    fp8_dot_product_attention: bool = False
    fp8_multi_head_attention: bool = False
    tp_only_amax_red: bool = False
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    use_kitchen: bool = False
    use_kitchen_attention: bool = False
    kitchen_attention_backend: str = "sdpa"
    fp4: Optional[str] = None
    fp4_recipe: Optional[str] = "nvfp4"
    fp4_param: bool = False
    fp4_quantizer_factory: Optional[str] = None

    def __post_init__(self) -> None:
        """Derive ffn, kv and query-group sizes; check every TP split is even."""
        super().__post_init__()
        if self.fp16 and self.bf16:
            raise ValueError(
                f"TransformerConfig: fp16={self.fp16} and bf16={self.bf16}; expected at most one "
                "of them True"
            )
        _check_mtp(self.mtp_num_layers, self.mtp_loss_scaling_factor)
        if self.multi_latent_attention and not isinstance(self, MLATransformerConfig):
            raise NotImplementedError(
                "multi_latent_attention=True needs an MLATransformerConfig (its q/kv LoRA ranks "
                "and head dims), not a plain TransformerConfig"
            )
        if self.test_mode:
            raise NotImplementedError("test_mode=True is not supported by this core")
        if self.normalization not in config_rules.NORMALIZATIONS:
            expected = " or ".join(repr(n) for n in config_rules.NORMALIZATIONS)
            raise ValueError(f"normalization must be {expected}, got {self.normalization!r}")
        if self.qk_layernorm_whole_projection and not (
            self.qk_layernorm and self.normalization == "RMSNorm"
        ):
            raise ValueError(
                "qk_layernorm_whole_projection=True needs qk_layernorm=True and "
                f"normalization='RMSNorm'; got qk_layernorm={self.qk_layernorm!r}, "
                f"normalization={self.normalization!r}"
            )
        if not config_rules.label_smoothing_allowed(self.label_smoothing):
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing!r}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        _check_cp_comm_type(self.cp_comm_type, self.num_layers)
        check_moe_config(self)
        check_fp8_config(self)
        self._check_recompute()
        self.attention_backend = _attention_backend(self.attention_backend)
        _check_window_size(self.window_size)
        self._check_gpt_oss_fields()
        self._check_gemma_fields()
        self._fill_init_methods()
        if not self.num_attention_heads:
            return
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        _check_multiple(
            "num_attention_heads",
            self.num_attention_heads,
            "num_query_groups",
            self.num_query_groups,
        )
        tp = self.tensor_model_parallel_size
        splits = {
            name: getattr(self, name)
            for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size")
        }
        for name, value in config_rules.tensor_parallel_misfits(tp, splits):
            raise ValueError(
                f"{name} ({value!r}) must be a positive multiple of tensor_model_parallel_size "
                f"({tp})"
            )

    def _check_gpt_oss_fields(self) -> None:
        """softmax_type, glu_linear_offset and activation_func_clamp_value
        (``config_rules``: shared with the trainer's flags)."""
        for problem in config_rules.gpt_oss_problems(
            self.softmax_type,
            self.glu_linear_offset,
            self.activation_func_clamp_value,
            self.gated_linear_unit,
        ):
            raise ValueError(problem)

    def _check_gemma_fields(self) -> None:
        """The window pattern, the soft-caps and the local RoPE base (Gemma 2 / 3)."""
        for problem in config_rules.window_attn_skip_freq_problems(
            self.window_attn_skip_freq, self.window_size, self.num_layers
        ):
            raise ValueError(problem)
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if not config_rules.softcap_valid(getattr(self, name)):
                raise ValueError(
                    f"{name} must be None or a finite number > 0, got {getattr(self, name)!r}"
                )
        base = self.local_rotary_base
        if base is not None and not (isinstance(base, (int, float)) and base > 0):
            raise ValueError(f"local_rotary_base must be None or a number > 0, got {base!r}")
        if base is not None and self.multi_latent_attention:
            raise ValueError(
                f"local_rotary_base={base!r} is not supported with multi_latent_attention=True "
                "(multi-latent attention rotates with its own rope_type); expected None"
            )
        if self.layernorm_zero_centered_gamma and self.qk_layernorm_whole_projection:
            raise ValueError(
                "layernorm_zero_centered_gamma=True with qk_layernorm_whole_projection=True is "
                "not supported (the whole-projection q/k norm has no zero-centred weight); "
                "expected one of them False"
            )
        if base is not None and config_rules.window_left(self.window_size) is None:
            raise ValueError(
                f"local_rotary_base={base!r} is the RoPE base of the sliding-window layers, but "
                f"window_size={self.window_size!r} gives no layer a window"
            )

    def _check_recompute(self) -> None:
        """megatron-core 0.16.1's recompute checks, with the fields named."""
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]
        layers_per_stage = self.num_layers // max(self.pipeline_model_parallel_size, 1)
        for problem in config_rules.recompute_problems(
            self.recompute_granularity,
            self.recompute_method,
            self.recompute_num_layers,
            self.recompute_modules,
            layers_per_stage,
        ):
            raise ValueError(f"TransformerConfig: {problem}")
        if self.distribute_saved_activations:
            if self.sequence_parallel:
                raise ValueError(
                    f"distribute_saved_activations: {self.distribute_saved_activations} must be "
                    f"false when sequence parallel is enabled: {self.sequence_parallel}"
                )
            raise NotImplementedError(
                "TransformerConfig: distribute_saved_activations=True (saved inputs split over "
                "TP) is not supported; expected False"
            )
        if (
            self.recompute_granularity == "selective"
            and "layernorm" in self.recompute_modules
            and self.apply_residual_connection_post_layernorm
        ):
            raise ValueError(
                "TransformerConfig: recompute_modules with 'layernorm' cannot be combined with "
                "apply_residual_connection_post_layernorm=True (the residual reads the norm's "
                "output after it is discarded); expected False"
            )

    def _fill_init_methods(self) -> None:
        """megatron-core's defaults: ``embedding_init_method_std`` = ``init_method_std``;
        ``embedding_init_method`` = Normal(0, embedding_init_method_std), or ``init_method``
        when one is given and the two stds agree; ``init_method`` = Normal(0,
        init_method_std); ``output_layer_init_method`` (attention projection and MLP fc2) =
        Normal(0, init_method_std / sqrt(2 num_layers)). Each is applied to the FULL
        (unsharded) tensor (``GPTModel``), so every layout gets the same weights."""
        for name in ("init_method", "output_layer_init_method", "embedding_init_method"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(
                    f"{name} must be a callable that fills a tensor in place, got {value!r}"
                )
        if self.embedding_init_method_std is None:
            self.embedding_init_method_std = self.init_method_std
        if self.embedding_init_method is None:
            if self.init_method is None or self.embedding_init_method_std != self.init_method_std:
                self.embedding_init_method = init_method_normal(self.embedding_init_method_std)
            else:
                self.embedding_init_method = self.init_method
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(
                self.init_method_std, max(self.num_layers, 1)
            )


def _check_cp_comm_type(cp_comm_type, num_layers: int) -> None:
    """None, one of ``CP_COMM_TYPES``, or a list of them with one entry per layer."""
    if not config_rules.cp_comm_type_length_ok(cp_comm_type, num_layers):
        raise ValueError(
            f"cp_comm_type has {len(cp_comm_type)} entries; a per-layer list needs one per "
            f"layer (num_layers = {num_layers})"
        )
    for kind in config_rules.unknown_cp_comm_types(cp_comm_type):
        raise ValueError(f"cp_comm_type entries must be one of {CP_COMM_TYPES}, got {kind!r}")


def _check_mtp(mtp_num_layers, mtp_loss_scaling_factor) -> None:
    """Multi-token prediction: None or a positive number of depths, a finite loss weight."""
    if mtp_num_layers is None:
        return
    if (
        isinstance(mtp_num_layers, bool)
        or not isinstance(mtp_num_layers, int)
        or mtp_num_layers < 1
    ):
        raise ValueError(f"mtp_num_layers must be None or an int >= 1, got {mtp_num_layers!r}")
    factor = mtp_loss_scaling_factor
    number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
    if not number or not math.isfinite(factor):
        raise ValueError(
            f"mtp_loss_scaling_factor must be a finite number (the weight of the MTP loss), "
            f"got {factor!r}"
        )


def _check_multiple(name: str, value: int, of_name: str, of_value: int) -> None:
    """Raise naming both fields unless ``value`` is a positive multiple of ``of_value``."""
    if not config_rules.is_positive_multiple(value, of_value):
        raise ValueError(
            f"{name} ({value!r}) must be a positive multiple of {of_name} ({of_value})"
        )


def _attention_backend(backend) -> AttnBackend:
    """``attention_backend`` as an ``AttnBackend`` (its name is accepted too)."""
    if isinstance(backend, AttnBackend):
        return backend
    if isinstance(backend, str) and backend in AttnBackend.__members__:
        return AttnBackend[backend]
    raise ValueError(
        f"attention_backend must be an AttnBackend or one of {tuple(AttnBackend.__members__)}, "
        f"got {backend!r}"
    )


def _check_window_size(window_size) -> None:
    """None, or (left, right) as ``config_rules.window_size_valid`` says."""
    if not config_rules.window_size_valid(window_size):
        raise ValueError(
            "window_size must be None or (left, right) with left >= 0 (or -1: no limit) and "
            f"right 0 or -1 (causal attention sees no later key), got {window_size!r}"
        )


@dataclass
class MLATransformerConfig(TransformerConfig):
    """Multi-latent attention's fields (megatron-core 0.16.1's names and defaults):
    q/kv LoRA ranks (``q_lora_rank=None``: one q projection), the per-head dims of the
    non-rotated query/key part, the rotated part shared by all heads, and the values; rope
    "rope" or "yarn" (``rotary_scaling_factor``, ``original_max_position_embeddings``,
    ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``)."""

    multi_latent_attention: bool = True
    q_lora_rank: Optional[int] = 512
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    normalization: str = "RMSNorm"
    rope_type: str = "yarn"
    rotary_base: float = 10000
    rotary_percent: float = 1.0
    rotary_scaling_factor: float = 40
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    cache_mla_latents: bool = False

    def __post_init__(self) -> None:
        """Check the MLA fields (the rest as TransformerConfig)."""
        super().__post_init__()
        if self.rope_type not in ("rope", "yarn"):
            raise ValueError(f"rope_type must be 'rope' or 'yarn', got {self.rope_type!r}")
        if self.rotary_percent != 1.0:
            raise NotImplementedError(
                f"MLATransformerConfig: rotary_percent={self.rotary_percent} is not supported; "
                "expected 1.0 (the whole qk_pos_emb_head_dim part is rotated)"
            )
        if self.cache_mla_latents:
            raise NotImplementedError(
                "MLATransformerConfig: cache_mla_latents=True is not supported"
            )
        dims = dict(
            kv_lora_rank=self.kv_lora_rank,
            qk_head_dim=self.qk_head_dim,
            qk_pos_emb_head_dim=self.qk_pos_emb_head_dim,
            v_head_dim=self.v_head_dim,
        )
        if self.q_lora_rank is not None:
            dims["q_lora_rank"] = self.q_lora_rank
        for name, value in dims.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(
                f"qk_pos_emb_head_dim ({self.qk_pos_emb_head_dim}) must be even (rope pairs)"
            )
