"""Tiny random HuggingFace models for the conversion tests, built locally with
``transformers`` (a test-only dependency; no hub access): one per family, 2 layers, hidden 32,
vocabulary 128, saved with ``save_pretrained`` (some sharded through a small
``max_shard_size``, exercising ``model.safetensors.index.json``).

Under torchrun rank 0 builds them in a shared temporary directory and computes the
transformers logits; the other ranks receive the path and the logits (one transformers
import per launch).
"""

import importlib.util
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Optional

import pytest
import torch
import torch.distributed as dist

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
SKIP_REASON = (
    "transformers is not installed (pip install -e .[dev]); it builds the reference models"
)
VOCAB, SEQ = 128, 16
COMMON = dict(vocab_size=VOCAB, initializer_range=0.1)
ROPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
MOE = dict(num_experts_per_tok=2)
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# families whose cases run in the slow step only (test_hf_gemma.py checks them in float64)
SLOW_FAMILIES = ("gemma2", "gemma3_text")
# Trainer settings of a Llama-shaped model without biases, and of a MoE model the HF
# families write (the bases of the from-scratch runs)
LLAMA_SHAPED_SETTINGS = dict(
    normalization="RMSNorm", swiglu=True, position_embedding_type="rope", disable_bias_linear=True
)
MOE_TRAINER_SETTINGS = dict(LLAMA_SHAPED_SETTINGS, num_experts=4, moe_ffn_hidden_size=24)

# family -> (transformers class name, config class name, config kwargs, max_shard_size or None)
FAMILIES = {
    # Llama 3: grouped-query attention, untied, rope_theta and llama3 frequency scaling
    "llama": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            **ROPE,
            num_key_value_heads=2,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
        ),
        "12KB",
    ),
    # Mistral without sliding window; head_dim (16) differs from hidden / heads (8)
    "mistral": (
        "MistralForCausalLM",
        "MistralConfig",
        dict(**ROPE, num_key_value_heads=2, head_dim=16, sliding_window=None),
        None,
    ),
    # Mistral with a sliding window of 5 positions (shorter than the 16-token sequences)
    "mistral_window": (
        "MistralForCausalLM",
        "MistralConfig",
        dict(**ROPE, num_key_value_heads=2, sliding_window=5),
        None,
    ),
    # Qwen2: q/k/v biases, tied embeddings
    "qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(**ROPE, num_key_value_heads=2, tie_word_embeddings=True),
        None,
    ),
    # Qwen3: per-head q/k RMSNorm (random weights), GQA, head_dim (16) != hidden / heads (8),
    # tied embeddings
    "qwen3": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(**ROPE, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
        None,
    ),
    # Qwen3 untied, head_dim = hidden / heads, saved sharded
    "qwen3_untied": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(**ROPE, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False),
        "12KB",
    ),
    # Mixtral: a MoE block in every layer (4 experts, top-2, renormalized), GQA
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(**ROPE, **MOE, num_key_value_heads=2, num_local_experts=4, sliding_window=None),
        "12KB",
    ),
    # Qwen2-MoE: q/k/v biases, layer 0 dense (mlp_only_layers), layer 1 MoE with a gated
    # shared expert, top-2 probabilities not renormalized
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            **ROPE,
            **MOE,
            num_key_value_heads=2,
            num_experts=4,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        ),
        None,
    ),
    # Qwen3-MoE: per-head q/k norms, head_dim 16, top-2 renormalized, tied embeddings
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            **ROPE,
            **MOE,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
        None,
    ),
    # OLMoE: q/k RMSNorms over the whole projections (random weights), GQA, every layer MoE,
    # top-2 probabilities not renormalized, saved sharded
    "olmoe": (
        "OlmoeForCausalLM",
        "OlmoeConfig",
        dict(**ROPE, **MOE, num_key_value_heads=2, num_experts=4, norm_topk_prob=False),
        "12KB",
    ),
    # Gemma 2: zero-centred sandwich norms, scaled embeddings, gated tanh-GELU, soft-caps that
    # bite, a window of 4 keys on layer 1 (layer 2 full)
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(
            **ROPE,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=24,
            attn_implementation="eager",
        ),
        None,
    ),
    # Gemma 3 text: as Gemma 2 with q/k norms, a local RoPE base, the full layers' linear
    # RoPE scaling, untied, saved sharded
    "gemma3_text": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(
            **ROPE,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=5,
            sliding_window_pattern=2,
            rope_theta=1e4,
            rope_local_base_freq=100.0,
            rope_scaling=dict(rope_type="linear", factor=4.0),
            tie_word_embeddings=False,
            attn_implementation="eager",
        ),
        "12KB",
    ),
    # GPT-2: learned positions, LayerNorm, biases, tied, Conv1D weights, gelu_new
    "gpt2": (
        "GPT2LMHeadModel",
        "GPT2Config",
        dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=1),
        "20KB",
    ),
}


def _randomize_norms(model, std: float = 0.3, mean: float = 1.0) -> None:
    """Every norm weight of ``model`` drawn around ``mean`` (transformers initializes them
    to 1, Gemma's zero-centred ones to 0)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(mean, std)


def _randomize_routers(model, std: float = 0.5) -> None:
    """Every router (``gate``) weight drawn with a larger spread than the other weights, so
    the top-k choice of a token has clear margins (rounding never flips an expert)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".gate.weight"):
                param.normal_(0.0, std)


def token_ids(seed: int = 0, batch: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=generator)


def build_models(directory: Path) -> Dict[str, Path]:
    """Save every family's tiny random model under ``directory``; {family: path}."""
    import transformers

    paths = {}
    for index, (family, (model_cls, config_cls, kwargs, shard)) in enumerate(FAMILIES.items()):
        torch.manual_seed(100 + index)
        config = getattr(transformers, config_cls)(**COMMON, **kwargs)
        model = getattr(transformers, model_cls)(config).eval()
        if family.startswith("qwen3") or family == "olmoe":  # norms start at 1: make a wrong
            # q/k norm visible
            _randomize_norms(model)
        if family.startswith("gemma"):  # zero-centred norms start at 0: make (1 + w) visible
            _randomize_norms(model, mean=0.0)
        if family in MOE_FAMILIES:  # routers with clear margins between the experts
            _randomize_routers(model)
        path = directory / family
        extra = {} if shard is None else {"max_shard_size": shard}
        model.save_pretrained(path, **extra)
        paths[family] = path
    return paths


def transformers_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """float32 logits [b, s, V] of the HuggingFace model at ``path`` on ``ids``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits.float()


class HFModels:
    """The built models and, per family, transformers' logits on ``token_ids()``."""

    def __init__(self, directory: Path, paths: Dict[str, Path], logits: Dict[str, torch.Tensor]):
        self.directory, self.paths, self.logits = directory, paths, logits


def shared_hf_models(with_logits: bool = True) -> HFModels:
    """Build (rank 0) and share (every rank) the models and reference logits."""
    if not HAVE_TRANSFORMERS:
        pytest.skip(SKIP_REASON)
    distributed = dist.is_initialized()
    payload: Optional[list] = None
    if not distributed or dist.get_rank() == 0:
        directory = Path(tempfile.mkdtemp(prefix="hf-models-"))
        paths = build_models(directory)
        ids = token_ids()
        logits = {f: transformers_logits(p, ids) for f, p in paths.items()} if with_logits else {}
        payload = [directory, paths, logits]
    if distributed:
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        payload = box[0]
    return HFModels(*payload)


def remove(models: HFModels) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        if dist.is_initialized():
            pass
        shutil.rmtree(models.directory, ignore_errors=True)


def write_random_hf_model(directory: Path, config: dict, seed: int = 0, std: float = 0.1) -> Path:
    """A HuggingFace-format directory (config.json + model.safetensors) of random weights,
    written without transformers (norm weights near 1): for trainer tests that need weights,
    not transformers' reference."""
    import json

    from safetensors.torch import save_file

    from megatron.training.hf.config import architecture_from_config
    from megatron.training.hf.weights import hf_shapes, our_full_shapes, parameter_sources

    arch = architecture_from_config(config)
    shapes = hf_shapes(arch, parameter_sources(arch), our_full_shapes(arch))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, shape in sorted(shapes.items()):
        value = torch.randn(shape, generator=generator) * std
        if "norm" in key or "ln_" in key:
            value = value + (1.0 if key.endswith("weight") else 0.0)
        tensors[key] = value
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


LLAMA_CONFIG = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
)
GPT2_CONFIG = dict(
    model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB
)
# Qwen2-MoE: layer 0 dense, layer 1 MoE (4 experts, top-2) with a gated shared expert
QWEN2_MOE_CONFIG = dict(
    LLAMA_CONFIG,
    model_type="qwen2_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    mlp_only_layers=[0],
)
# DeepSeek-V3: multi-latent attention (q LoRA, yarn), layer 0 dense, layer 1 MoE (sigmoid
# routing, expert bias, 2 groups of 2, top-2 of the best group, a shared expert)
DEEPSEEK_V3_CONFIG = dict(
    model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
    moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_routed_experts=4,
    num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    routed_scaling_factor=2.5, max_position_embeddings=64, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16,
                      beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
)  # fmt: skip
# Gemma 2: a window of 3 keys on layer 1 (shorter than the prompts), both soft-caps
GEMMA2_CONFIG = dict(
    LLAMA_CONFIG, model_type="gemma2", head_dim=16, sliding_window=3, query_pre_attn_scalar=24,
    attn_logit_softcapping=5.0, final_logit_softcapping=10.0, rope_theta=10000.0,
)  # fmt: skip
# Gemma 3 text: q/k norms, the window on layer 1 with its own RoPE base, untied
GEMMA3_CONFIG = dict(
    LLAMA_CONFIG, model_type="gemma3_text", head_dim=16, sliding_window=3,
    sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=100.0,
    tie_word_embeddings=False,
)  # fmt: skip
