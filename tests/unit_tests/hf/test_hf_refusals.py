"""What the HuggingFace converter refuses, by name (no transformers needed): per family an
option we cannot express, unknown options, and checkpoints whose tensors do not fit the
configuration. Each error names the option (or tensor) and its value."""

import dataclasses
import json

import pytest
import torch

from megatron.training.hf import architecture_from_config, model_from_hf
from megatron.training.hf.config import training_settings
from megatron.training.hf.families import REGISTRY
from megatron.training.hf.weights import hf_shapes, our_full_shapes, parameter_sources
from tests.unit_tests.hf.hf_models import MOE_TRAINER_SETTINGS

pytestmark = pytest.mark.world(1)

LLAMA = dict(
    model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=128, rms_norm_eps=1e-5,
)  # fmt: skip
BASE = {
    "llama": LLAMA,
    "mistral": {**LLAMA, "model_type": "mistral", "sliding_window": None},
    "qwen2": {**LLAMA, "model_type": "qwen2"},
    "qwen3": {
        **LLAMA,
        "model_type": "qwen3",
        "head_dim": 16,
        "sliding_window": None,
        "max_window_layers": 28,
        "layer_types": ["full_attention"] * 2,
    },
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=128),
    "mixtral": {**LLAMA, "model_type": "mixtral", "num_local_experts": 4,
                "num_experts_per_tok": 2, "router_jitter_noise": 0.0,
                "router_aux_loss_coef": 0.02, "output_router_logits": False},
    "qwen2_moe": {**LLAMA, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
                  "qkv_bias": True, "use_sliding_window": False, "sliding_window": 0,
                  "max_window_layers": 28},
    "qwen3_moe": {**LLAMA, "model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                  "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "olmoe": {**LLAMA, "model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 2,
              "norm_topk_prob": False, "clip_qkv": None, "attention_bias": False,
              "router_aux_loss_coef": 0.01, "output_router_logits": False},
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=32, intermediate_size=24,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    vocab_size=128, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                    rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, rope_theta=150000.0,
                                         original_max_position_embeddings=4096)),
    # Phi-3 as transformers 5 saves it: partial_rotary_factor also inside rope_parameters
    "phi3": {**LLAMA, "model_type": "phi3", "sliding_window": 5, "partial_rotary_factor": 0.75,
             "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default",
                                 "partial_rotary_factor": 0.75},
             "original_max_position_embeddings": 4096, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
    # DeepSeek-V3 as transformers writes it: q LoRA, yarn, one dense layer, grouped sigmoid
    # routing with expert bias and shared experts (the MTP key without MTP layers)
    "deepseek_v3": {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_shared_experts": 2, "n_routed_experts": 8,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 8, "q_lora_rank": 12,
        "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "qk_head_dim": 12, "head_dim": 4,
        "v_head_dim": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "hidden_act": "silu",
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "pretraining_tp": 1,
        "tie_word_embeddings": False, "rope_interleave": True, "attention_bias": False,
        "num_nextn_predict_layers": 1, "output_router_logits": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 16, "beta_fast": 32,
                            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    # DeepSeek-V2-Lite's shape: no q LoRA, greedy softmax routing, rope
    "deepseek_v2": {
        "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
        "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_shared_experts": 2, "n_routed_experts": 8,
        "routed_scaling_factor": 1.0, "kv_lora_rank": 8, "q_lora_rank": None,
        "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "qk_head_dim": 12, "head_dim": 4,
        "v_head_dim": 8, "n_group": None, "topk_group": None, "num_experts_per_tok": 2,
        "topk_method": "greedy", "first_k_dense_replace": 1, "norm_topk_prob": False,
        "hidden_act": "silu", "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "mlp_bias": False, "attention_bias": False, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "gemma2": {**LLAMA, "model_type": "gemma2", "head_dim": 16, "sliding_window": 4,
               "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "layer_types": ["sliding_attention", "full_attention"],
               "cache_implementation": "hybrid", "hidden_act": "gelu_pytorch_tanh"},
    "gemma3_text": {**LLAMA, "model_type": "gemma3_text", "head_dim": 16, "sliding_window": 4,
                    "query_pre_attn_scalar": 16, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                    "sliding_window_pattern": 2, "attn_logit_softcapping": None,
                    "final_logit_softcapping": None, "cache_implementation": "hybrid",
                    "rope_scaling": None},
}  # fmt: skip
LONGROPE = {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3}
GPT_OSS_YARN = BASE["gpt_oss"]["rope_parameters"]

REFUSED = [
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     "rope_scaling.low_freq_factor"),  # fmt: skip
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("llama", {"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ("mistral", {"sliding_window": 0}, "sliding_window"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen2", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("qwen2", {"qk_norm": True}, "qk_norm"),  # unknown to the converter
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ("qwen3", {"use_mrope": True}, "use_mrope"),  # unknown to the converter
    ("gpt2", {"activation_function": "relu"}, "activation_function"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention"),
    ("gpt2", {"num_experts": 8}, "num_experts"),  # unknown: MoE
    ("mixtral", {"router_jitter_noise": 0.01}, "router_jitter_noise"),
    ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts"),
    ("mixtral", {"sliding_window": 0}, "sliding_window"),
    ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
    ("olmoe", {"attention_bias": True}, "attention_bias"),
    ("olmoe", {"head_dim": 16}, "head_dim"),
    ("olmoe", {"num_experts": 0}, "num_experts"),
    ("olmoe", {"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ("qwen2_moe", {"mlp_only_layers": [2]}, "mlp_only_layers"),
    ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("qwen2_moe", {"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ("qwen2_moe", {"router_aux_loss_coef": -1}, "router_aux_loss_coef"),
    ("qwen3_moe", {"num_local_experts": 8}, "num_local_experts"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
    ("qwen3_moe", {"moe_intermediate_size": None}, "moe_intermediate_size"),
    ("qwen3_moe", {"n_shared_experts": 1}, "n_shared_experts"),  # unknown to the converter
    ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
    ("gpt_oss", {"swiglu_alpha": 1.5}, "swiglu_alpha"),
    ("gpt_oss", {"attention_bias": False}, "attention_bias"),
    ("gpt_oss", {"hidden_act": "gelu"}, "hidden_act"),
    ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     "rope_parameters.rope_type"),  # fmt: skip
    ("gpt_oss", {"rope_parameters": {**GPT_OSS_YARN, "attention_factor": 2.0}}, "rope_parameters"),
    ("gpt_oss", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
    # Phi-3: LongRoPE (the 128k models, Phi-3.5, Phi-4-mini) in either spelling, or as "su"
    ("phi3", {"rope_scaling": LONGROPE}, "rope_scaling.rope_type"),
    ("phi3", {"rope_scaling": {**LONGROPE, "type": "su"}}, "rope_scaling.rope_type"),
    ("phi3", {"rope_parameters": {**LONGROPE, "rope_type": "longrope"}},
     "rope_parameters.rope_type"),  # fmt: skip
    ("phi3", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     "rope_scaling.rope_type"),  # fmt: skip
    ("phi3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),  # != rope_parameters'
    ("phi3", {"partial_rotary_factor": 0.1, "rope_parameters": None}, "partial_rotary_factor"),
    ("phi3", {"partial_rotary_factor": 1.5, "rope_parameters": None}, "partial_rotary_factor"),
    ("phi3", {"head_dim": 16}, "head_dim"),
    ("phi3", {"sliding_window": 0}, "sliding_window"),
    ("phi3", {"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ("phi3", {"hidden_act": "gelu"}, "hidden_act"),
    ("phi3", {"attention_bias": True}, "attention_bias"),
    ("phi3", {"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}, "auto_map"),
    ("phi3", {"qk_norm": True}, "qk_norm"),  # unknown to the converter
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation"),
    ("gemma2", {"attention_bias": True}, "attention_bias"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
    ("gemma2", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope_scaling"),
    ("gemma3_text", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    (
        "gemma3_text",
        {"rope_scaling": {"rope_type": "linear", "factor": 3.0}},
        "rope_scaling.factor",
    ),  # not a power of two: not bit for bit
    ("gemma3_text", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_scaling"),
    (
        "gemma3_text",
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "yarn", "factor": 8.0},
                "sliding_attention": {"rope_type": "default"},
            }
        },
        "rope_parameters.full_attention",
    ),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "default"},
                                         "sliding_attention": {"rope_type": "linear",
                                                               "factor": 2.0}}},
     "rope_parameters.sliding_attention"),  # fmt: skip
    ("gemma3_text", {"sliding_window": 0}, "sliding_window"),
]


@pytest.mark.parametrize("family", list(BASE))
def test_the_base_configurations_are_accepted(family):
    arch = architecture_from_config(dict(BASE[family]))
    assert arch.family == family and arch.num_layers == 2
    assert training_settings(arch)["num_layers"] == 2


@pytest.mark.parametrize("family, change, named", REFUSED, ids=[f"{f}-{n}" for f, _, n in REFUSED])
def test_an_option_we_cannot_express_is_refused_by_name(family, change, named):
    with pytest.raises(ValueError, match=rf"{named}=") as info:
        architecture_from_config({**BASE[family], **change})
    value = json.dumps(next(iter(change.values())))
    assert named.split(".")[-1] in str(info.value) and (
        value[:20] in str(info.value) or "." in named
    ), str(info.value)


@pytest.mark.parametrize(
    "change",
    [dict(add_qkv_bias=True), dict(qk_layernorm=True), dict(window_size=[4, 2])],
    ids=["qwen2-shaped", "qwen3-shaped", "non-causal-window"],
)
def test_a_windowed_model_no_family_expresses_is_refused_on_export(change):
    """A sliding window only Mistral writes (causal, no biases, no q/k norm): another
    trained model with --window-size matches no family, rather than exporting without it."""
    from megatron.training.hf.config import architecture_from_model_settings

    settings = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        vocab_size=128, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
        disable_bias_linear=True, window_size=[4, 0], seq_length=16,
    )  # fmt: skip
    assert architecture_from_model_settings(settings).window_size == (4, 0)  # Mistral's
    with pytest.raises(ValueError, match="matches no HuggingFace family"):
        architecture_from_model_settings({**settings, **change})


def test_an_unsupported_model_type_is_refused():
    with pytest.raises(ValueError, match="model_type='mamba' is not supported"):
        architecture_from_config({**LLAMA, "model_type": "mamba"})


def test_olmoe_reads_as_whole_projection_qk_norms():
    """OLMoE's q/k norms span all heads of each projection: qk_layernorm with
    qk_layernorm_whole_projection, every layer a MoE layer of intermediate_size."""
    arch = architecture_from_config(BASE["olmoe"])
    assert (arch.qk_layernorm, arch.qk_layernorm_whole_projection) == (True, True)
    assert (arch.num_moe_experts, arch.moe_ffn_hidden_size, arch.moe_layer_freq) == (4, 64, (1, 1))


MOE_ROUTING = [  # family, change, (pre_softmax, shared expert size, layer pattern)
    ("mixtral", {}, (False, None, (1, 1))),
    ("qwen2_moe", {}, (True, 40, (1, 1))),
    ("qwen2_moe", {"norm_topk_prob": True, "mlp_only_layers": [1]}, (False, 40, (1, 0))),
    ("qwen3_moe", {}, (False, None, (1, 1))),
    ("olmoe", {}, (True, None, (1, 1))),
    ("olmoe", {"norm_topk_prob": True}, (False, None, (1, 1))),
    ("qwen3_moe", {"norm_topk_prob": False, "decoder_sparse_step": 2}, (True, None, (0, 1))),
]


@pytest.mark.parametrize("family, change, expected", MOE_ROUTING)
def test_moe_routing_and_layers_map_to_our_settings(family, change, expected):
    """norm_topk_prob true (Mixtral always) renormalizes the top-k: our softmax after the
    selection (moe_router_pre_softmax false); false: the softmax over all experts (true).
    mlp_only_layers / decoder_sparse_step: the moe_layer_freq list. No router loss is set
    (router_aux_loss_coef is another loss)."""
    arch = architecture_from_config({**BASE[family], **change})
    pre_softmax, shared, pattern = expected
    assert arch.num_moe_experts == 4 and arch.moe_router_topk == 2
    assert arch.moe_router_pre_softmax == pre_softmax
    assert arch.moe_shared_expert_intermediate_size == shared
    assert arch.moe_shared_expert_gate == (shared is not None)
    assert arch.moe_layer_freq == pattern
    settings = training_settings(arch)
    assert settings["num_experts"] == 4
    assert settings["moe_layer_freq"] == (1 if all(pattern) else list(pattern))
    assert "moe_aux_loss_coeff" not in settings and "moe_z_loss_coeff" not in settings
    assert settings["disable_bias_linear"] is True


MOE_SETTINGS = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=128,
    seq_length=16, **MOE_TRAINER_SETTINGS,
)  # fmt: skip
WRITTEN_AS = [
    ({}, "mixtral"),
    ({"qk_layernorm": True, "moe_layer_freq": [0, 1]}, "qwen3_moe"),
    ({"qk_layernorm": True, "qk_layernorm_whole_projection": True}, "olmoe"),
    ({"moe_shared_expert_intermediate_size": 40, "moe_shared_expert_gate": True}, "qwen2_moe"),
    ({"moe_router_score_function": "sigmoid"}, None),  # DeepSeek-style: no family
    ({"moe_router_pre_softmax": True}, None),  # Mixtral always renormalizes
    ({"moe_shared_expert_intermediate_size": 40}, None),  # a shared expert without gate
]


@pytest.mark.parametrize("change, family", WRITTEN_AS)
def test_a_moe_trained_from_scratch_is_written_as_the_family_it_matches(change, family):
    """Export of a --num-experts model without an imported config.json: the family whose
    routing and layers it has, or a ValueError listing what we write."""
    from megatron.training.hf.config import architecture_from_model_settings

    settings = {**MOE_SETTINGS, **change}
    if family is None:
        with pytest.raises(ValueError, match="matches no HuggingFace family.*Qwen3-MoE"):
            architecture_from_model_settings(settings)
        return
    arch = architecture_from_model_settings(settings)
    assert arch.family == family and arch.num_moe_experts == 4
    assert arch.moe_layer_freq == tuple(change.get("moe_layer_freq", [1, 1]))
    back = architecture_from_config(REGISTRY[family].write(arch))
    if all(arch.moe_layer_freq):  # no dense layer: the dense FFN size means nothing
        back = dataclasses.replace(back, ffn_hidden_size=arch.ffn_hidden_size)
    assert back == arch


def test_a_qwen_moe_without_sparse_layers_is_the_dense_model():
    arch = architecture_from_config({**BASE["qwen2_moe"], "mlp_only_layers": [0, 1]})
    assert arch.num_moe_experts is None and training_settings(arch)["num_experts"] is None


def _write(directory, config, tensors):
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))


def _random_llama_tensors(config):
    arch = architecture_from_config(config)
    sources = parameter_sources(arch)
    return {k: torch.randn(s) for k, s in hf_shapes(arch, sources, our_full_shapes(arch)).items()}


def test_a_tensor_the_configuration_does_not_use_is_refused(tmp_path):
    """qk-norm weights in a file whose config does not say so: refused, never dropped."""
    tensors = _random_llama_tensors(LLAMA)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    _write(tmp_path / "m", LLAMA, tensors)
    with pytest.raises(ValueError, match="q_norm.weight"):
        model_from_hf(tmp_path / "m")


def test_a_missing_or_misshapen_tensor_is_refused(tmp_path):
    tensors = _random_llama_tensors(LLAMA)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    _write(tmp_path / "missing", LLAMA, tensors)
    with pytest.raises(ValueError, match="up_proj.weight"):
        model_from_hf(tmp_path / "missing")
    tensors = _random_llama_tensors(LLAMA)
    tensors["model.norm.weight"] = torch.ones(31)
    _write(tmp_path / "shape", LLAMA, tensors)
    with pytest.raises(ValueError, match=r"model.norm.weight.*\[31\]"):
        model_from_hf(tmp_path / "shape")


def test_a_missing_misshapen_or_extra_expert_is_refused(tmp_path):
    """Qwen2-MoE: an expert tensor missing, of another shape, or one expert too many
    (a fifth of four) is an error naming the tensor; the consistent folder loads."""
    config = BASE["qwen2_moe"]
    _write(tmp_path / "ok", config, _random_llama_tensors(config))
    model_from_hf(tmp_path / "ok")
    up = "model.layers.1.mlp.experts.3.up_proj.weight"
    tensors = _random_llama_tensors(config)
    del tensors[up]
    _write(tmp_path / "missing", config, tensors)
    with pytest.raises(ValueError, match=rf"missing tensors .*{up}"):
        model_from_hf(tmp_path / "missing")
    tensors = _random_llama_tensors(config)
    tensors[up] = torch.randn(25, 32)
    _write(tmp_path / "shape", config, tensors)
    with pytest.raises(ValueError, match=rf"{up}' has shape \[25, 32\]"):
        model_from_hf(tmp_path / "shape")
    tensors = _random_llama_tensors(config)
    extra = "model.layers.1.mlp.experts.4.up_proj.weight"
    tensors[extra] = torch.randn(24, 32)
    _write(tmp_path / "extra", config, tensors)
    with pytest.raises(ValueError, match=rf"{extra}.*not part of the qwen2_moe architecture"):
        model_from_hf(tmp_path / "extra")


def test_file_problems_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        model_from_hf(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_from_hf(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "llama",\n oops}')
    with pytest.raises(ValueError, match="line 2"):
        model_from_hf(tmp_path / "bad")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(LLAMA))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        model_from_hf(tmp_path / "noweights")


def test_an_override_contradicting_config_json_is_refused(tmp_path):
    _write(tmp_path / "m", LLAMA, _random_llama_tensors(LLAMA))
    with pytest.raises(ValueError, match="num_layers=4 contradicts config.json"):
        model_from_hf(tmp_path / "m", num_layers=4)
    model, config = model_from_hf(tmp_path / "m", params_dtype=torch.bfloat16)
    assert model.embedding.word_embeddings.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["olmoe", "phi3"])
def test_a_head_dim_beside_hidden_over_heads_is_refused_with_both_sizes(family):
    """OLMoE and Phi-3 share one check: the refusal names hidden_size and the head count."""
    config = {**BASE[family], "head_dim": 16}
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    with pytest.raises(ValueError, match=rf"head_dim=16 .*absent or .*\({hidden} / {heads}\)"):
        architecture_from_config(config)


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_the_sliding_window_reads_and_writes_alike(family):
    """Mistral and Phi-3 share one reading of sliding_window (W: itself and W - 1 keys)."""
    arch = architecture_from_config({**BASE[family], "sliding_window": 5})
    assert arch.window_size == (4, 0)
    assert REGISTRY[family].write(arch)["sliding_window"] == 5
