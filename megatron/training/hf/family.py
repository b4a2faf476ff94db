"""What a HuggingFace family is, to the converter: the shared vocabulary of the families.

``HFArchitecture`` is a decoder in our GPT's terms; ``Segment`` / ``Source`` say how one of
our parameters is made of HuggingFace tensors; ``ConfigReader`` reads ``config.json`` keys,
remembering which were looked at, so anything a family did not read is refused; ``Family``
is the interface one family implements (one module under ``families/``, one line in
``families/__init__.py``). No torch here: reading a config needs none.
"""

import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, Optional, Tuple, Union

from megatron.core.config_rules import is_window_layer

# Keys that do not change what the weights compute, for every family: bookkeeping,
# generation defaults, token ids (the tokenizer's business), initialization and dropout
# (training-time choices; our trainer trains without dropout).
IGNORED_KEYS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype",
    "torch_dtype", "use_cache", "initializer_range", "id2label", "label2id", "problem_type",
    "return_dict", "output_attentions", "output_hidden_states", "chunk_size_feed_forward",
    "is_encoder_decoder", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "tokenizer_class", "prefix", "task_specific_params",
    "finetuning_task", "torchscript", "use_bfloat16", "tf_legacy_loss", "bad_words_ids",
    "begin_suppress_tokens", "suppress_tokens", "diversity_penalty", "do_sample",
    "early_stopping", "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty",
    "forced_bos_token_id", "forced_eos_token_id", "length_penalty", "max_length",
    "min_length", "no_repeat_ngram_size", "num_beam_groups", "num_beams",
    "num_return_sequences", "output_scores", "remove_invalid_values", "repetition_penalty",
    "return_dict_in_generate", "temperature", "top_k", "top_p", "typical_p",
    "cross_attention_hidden_size", "tie_encoder_decoder", "attention_dropout",
    "attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_activation", "summary_first_dropout",
    "summary_proj_to_labels", "summary_type", "summary_use_proj", "n_ctx",
})  # fmt: skip
# Keys refused for every family when set: models we cannot express.
REFUSED_KEYS = ("quantization_config", "pruned_heads", "is_decoder")
DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class HFArchitecture:
    """What a HuggingFace decoder is, in our GPT's terms.

    ``activation``: "silu" (gated: SwiGLU), "gelu" (erf), "gelu_tanh" (OpenAI's tanh
    approximation, GPT-2's ``gelu_new``) or "quick_gelu" (gated, ``--quick-geglu``).
    ``rope_scaling_factor``: Llama 3.x frequency scaling (None: none). ``dtype``: the dtype
    the checkpoint declares (a torch name).
    """

    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int
    normalization: str
    norm_epsilon: float
    swiglu: bool
    activation: str
    position_embedding_type: str
    max_position_embeddings: int
    rotary_base: float
    rope_scaling_factor: Optional[float]
    add_bias_linear: bool
    add_qkv_bias: bool
    tied: bool
    dtype: str = "float32"
    window_size: Optional[Tuple[int, int]] = None  # (left, 0): sliding-window attention
    # the fraction of each head's channels RoPE rotates (Phi-3's partial_rotary_factor)
    rotary_percent: float = 1.0
    qk_layernorm: bool = False  # per-head q/k norm (``normalization``) before rotary
    # with qk_layernorm: one RMSNorm over all heads of q and of k (OLMoE), not per head
    qk_layernorm_whole_projection: bool = False
    # Mixture of experts (None: a dense model). ``moe_layer_freq``: one 0/1 per layer (1: a
    # MoE layer; dense layers have the ``ffn_hidden_size`` MLP). Routing: softmax over the
    # router logits, top ``moe_router_topk``; ``moe_router_pre_softmax`` False renormalizes
    # the k probabilities (a softmax over the selected logits), True keeps them unnormalized.
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_pre_softmax: bool = False
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False
    moe_layer_freq: Optional[Tuple[int, ...]] = None
    # GPT-OSS (megatron-core's names, as the trainer's options): attention sinks; the gated
    # unit's offset and clamp (``activation`` "quick_gelu": x sigmoid(1.702 x)); YaRN rotary
    # embeddings (``position_embedding_type`` "yarn"; ``rotary_scaling_factor`` below)
    softmax_type: str = "vanilla"
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: Optional[float] = None
    yarn_original_max_position_embeddings: Optional[int] = None
    yarn_beta_fast: Optional[float] = None
    yarn_beta_slow: Optional[float] = None
    no_yarn_correction_range_round_to_int: bool = False
    # DeepSeek routing (megatron's names; ``hf/families/deepseek.py``): sigmoid scores, an
    # expert bias on the selection (a buffer), group-limited top-k, a routed scaling factor.
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    # Multi-latent attention (megatron's names and defaults; DeepSeek-V2/V3). With it the
    # attention fields above (``num_query_groups``, ``kv_channels``) are unused.
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: Optional[str] = None
    # the YaRN factor of multi-latent attention's rope_type yarn and of GPT-OSS's yarn
    # positions (None: MLA's default 1)
    rotary_scaling_factor: Optional[float] = None
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # Gemma 2 / 3 (named as the trainer's options): a gated GELU MLP (``activation``'s GELU),
    # zero-centred norms (1 + w), norms after attention and the MLP too, embeddings times
    # sqrt(hidden), the attention scale (None: 1 / sqrt(kv_channels)), logit soft-caps,
    # the sliding-window layers' RoPE base. Which layers keep ``window_size`` (Gemma's and
    # GPT-OSS's, megatron-core's type): None, every layer; N, all but every N-th (1-based)
    # layer; one 1 = sliding / 0 = full per layer (``config_rules.is_window_layer``).
    geglu: bool = False
    apply_layernorm_1p: bool = False
    sandwich_layernorm: bool = False
    embedding_scale_sqrt_hidden: bool = False
    softmax_scale: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    window_attn_skip_freq: Union[None, int, Tuple[int, ...]] = None
    local_rotary_base: Optional[float] = None
    # linear RoPE scaling (positions / factor) of the full-attention layers (Gemma 3)
    rotary_seq_len_interpolation_factor: Optional[float] = None
    # Multi-token prediction depths (DeepSeek-V3's layers after ``num_layers``; None: none).
    # Set from the checkpoint's tensors (``Family.mtp_layers``), not from config.json alone.
    mtp_num_layers: Optional[int] = None

    @property
    def gated(self) -> bool:
        """Whether the MLP's fc1 is [gate; up] (SwiGLU, GeGLU or GPT-OSS's quick GELU)."""
        return self.swiglu or self.geglu or self.activation == "quick_gelu"

    def sliding_layers(self) -> Tuple[bool, ...]:
        """Whether each layer (in order) has ``window_size``'s sliding window."""
        return tuple(
            is_window_layer(self.window_size, self.window_attn_skip_freq, layer)
            for layer in range(1, self.num_layers + 1)
        )

    def qk_norm_sizes(self) -> Tuple[int, int]:
        """The q and k norm weights' sizes: ``kv_channels`` each (per head), or all heads of
        each projection with ``qk_layernorm_whole_projection``."""
        d = self.kv_channels
        if self.qk_layernorm_whole_projection:
            return self.num_attention_heads * d, self.num_query_groups * d
        return d, d

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) is a MoE layer; an MTP depth's layer
        (``layer >= num_layers``) is of the last layer's kind (megatron-core's MTP spec)."""
        if self.num_moe_experts is None:
            return False
        return bool(self.moe_layer_freq[min(layer, self.num_layers - 1)])

    def to_dict(self) -> Dict[str, Any]:
        """Plain values (kept in checkpoints)."""
        return asdict(self)


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of HuggingFace tensor ``key`` (columns when ``transposed``), every
    ``step``-th one (GPT-OSS's interleaved gate/up columns: step 2); ``index``: of the
    sub-tensor ``key[index]`` of a stacked tensor (GPT-OSS's [experts, ...] parameters)."""

    key: str
    start: int
    stop: int
    transposed: bool = False
    step: int = 1
    index: Optional[int] = None

    @property
    def length(self) -> int:
        return len(range(self.start, self.stop, self.step))

    def hf_rows(self, first: int, last: int) -> slice:
        """The HuggingFace rows of our rows [first, last) of this segment (0-based)."""
        return slice(self.start + first * self.step, self.start + last * self.step, self.step)


Source = Tuple[Segment, ...]


class Family:
    """One HuggingFace family: ``config.json`` <-> ``HFArchitecture`` both ways, and the
    weight table (which HuggingFace rows make each of our parameters).

    A subclass sets ``model_type`` and ``architecture`` (the ``architectures`` entry of a
    causal LM) and implements the four abstract methods; ``key_prefix`` has a default.
    Refusals live in ``read``: every key it does not look at is refused. A trained model is
    written as the first family whose ``read(write(arch))`` gives the same model back
    (``config.architecture_from_model_settings``): ``write`` may simply drop what the family
    has no key for, the round trip refuses it.
    """

    model_type: str = ""
    architecture: str = ""
    # For the export error listing what our trained models can be written as (None: this
    # family is only ever written from an imported config.json).
    settings_hint: Optional[str] = None

    def read(self, c: "ConfigReader") -> HFArchitecture:
        """The architecture ``config.json`` describes (``c.fail`` for what we cannot express)."""
        raise NotImplementedError

    def write(self, arch: HFArchitecture) -> Dict[str, Any]:
        """A fresh ``config.json`` for ``arch`` (without ``dtype``)."""
        raise NotImplementedError

    def global_sources(self, arch: HFArchitecture, prefix: Optional[str]) -> Dict[str, Source]:
        """Embeddings, final norm and (untied) output layer (``prefix``: the HuggingFace
        key prefix, None: the family's usual one)."""
        raise NotImplementedError

    def layer_sources(
        self, arch: HFArchitecture, layer: int, prefix: Optional[str]
    ) -> Dict[str, Source]:
        """The parameters of global layer ``layer``, by their full one-chunk names."""
        raise NotImplementedError

    def key_prefix(self, keys: Iterable[str]) -> Optional[str]:
        """The prefix of this checkpoint's tensor names when it is not the usual one."""
        return None

    def check_keys(self, arch: HFArchitecture, keys: Iterable[str], where: str) -> None:
        """Refuse, by name, tensors the family knows but we do not convert (before the
        generic unused-tensor refusal)."""

    # Whether the family's checkpoints carry multi-token prediction layers (DeepSeek-V3).
    carries_mtp: bool = False

    def mtp_layers(
        self, arch: HFArchitecture, raw: Dict[str, Any], keys: Iterable[str], where: str
    ) -> Optional[int]:
        """The MTP depths the checkpoint holds (``keys``: its tensor names; None: none),
        checked against ``config.json`` (ValueError naming the key otherwise)."""
        return None

    def declared_mtp_layers(self, raw: Dict[str, Any]) -> Optional[int]:
        """The MTP depths a ``config.json`` this family wrote declares (None: none)."""
        return None


def _refusal(value: Any) -> str:
    """What a refused key's message expects (MXFP4: how to dequantize first)."""
    if isinstance(value, dict) and value.get("quant_method") == "mxfp4":
        return (
            "absent: MXFP4 weights are not read; dequantize the checkpoint first "
            "(transformers: from_pretrained(..., quantization_config=Mxfp4Config("
            "dequantize=True)), then save_pretrained)"
        )
    return "absent (quantized / pruned / decoder-with-cross-attention models are not supported)"


class ConfigReader:
    """Reads keys of a config dict, remembering which were looked at; every failure is a
    ValueError naming the file, the key, its value and what was expected."""

    def __init__(self, raw: Dict[str, Any], where: str, family: str):
        self.raw, self.where, self.family = raw, where, family
        self._seen = set(IGNORED_KEYS)
        for key in REFUSED_KEYS:
            value = raw.get(key)
            if value:
                self.fail(key, value, _refusal(value))
            self._seen.add(key)

    def fail(self, key: str, value: Any, expected: str) -> None:
        raise ValueError(
            f"{self.where}: {key}={json.dumps(value)} is not supported for model_type "
            f"{self.family!r}; expected {expected}"
        )

    def require(self, condition: bool, key: str, value: Any, expected: str) -> None:
        if not condition:
            self.fail(key, value, expected)

    def seen(self, *keys: str) -> None:
        self._seen.update(keys)

    def optional(self, key: str, default: Any) -> Any:
        self._seen.add(key)
        return self.raw.get(key, default) if self.raw.get(key) is not None else default

    def expect(self, key: str, value: Any, expected: str, default: Any = None, allow=None) -> None:
        got = self.optional(key, default)
        ok = allow(got) if allow is not None else got == value
        self.require(ok, key, got, expected)

    def positive_int(self, key: str, default: Optional[int] = None) -> int:
        value = self.optional(key, default)
        self.require(isinstance(value, int) and value >= 1, key, value, "a positive integer")
        return value

    def positive_float(self, key: str, default: Optional[float] = None) -> float:
        value = self.optional(key, default)
        ok = isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
        self.require(ok, key, value, "a number > 0")
        return float(value)

    def dtype(self) -> str:
        """The checkpoint's declared dtype (``dtype``, or transformers 4's ``torch_dtype``)."""
        value = self.raw.get("dtype", self.raw.get("torch_dtype")) or "float32"
        self.require(value in DTYPE_NAMES, "dtype", value, "float32, bfloat16 or float16")
        return value

    def refuse_unknown(self) -> None:
        unknown = sorted(set(self.raw) - self._seen)
        if unknown:
            key = unknown[0]
            raise ValueError(
                f"{self.where}: {key}={json.dumps(self.raw[key])} is an option the converter "
                f"does not know for model_type {self.family!r} (unknown: {', '.join(unknown)}); "
                "refusing rather than building a possibly different model"
            )
