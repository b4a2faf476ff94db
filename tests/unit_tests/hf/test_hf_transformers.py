"""HuggingFace conversion against ``transformers`` itself, one process.

For each family (Llama 3 with GQA and llama3 rope scaling, Mistral with head_dim != hidden /
heads, Qwen2 with q/k/v biases and tied embeddings, Qwen3 with per-head q/k norms (tied with
head_dim != hidden / heads, and untied), GPT-2 with Conv1D weights and learned
positions, and the mixtures of experts Mixtral, Qwen2-MoE (a dense and a MoE layer, gated
shared expert) and Qwen3-MoE; some saved sharded): our logits from ``model_from_hf`` equal
transformers' within 1e-5 relative (float32), with ``SequentialMLP`` and ``GroupedMLP``
experts; ``import`` then ``export`` gives back exactly the original tensors; the exported
directory loads in transformers with the same logits. Negative controls show the logit check
catches a wrong q/k/v layout, swapped q/k norms, swapped expert gate/up halves and the other
top-k normalization.
"""

import json

import pytest
import torch

from megatron.core.transformer.torch_norm import WholeProjectionRMSNorm
from megatron.training.hf import model_from_hf
from megatron.training.hf.__main__ import main as hf_cli
from megatron.training.hf.weights import SafetensorsReader
from tests.unit_tests.dist_utils import rel_error
from tests.unit_tests.hf.hf_models import (
    FAMILIES,
    HAVE_TRANSFORMERS,
    LLAMA_SHAPED_SETTINGS,
    MOE_FAMILIES,
    MOE_TRAINER_SETTINGS,
    SKIP_REASON,
    SLOW_FAMILIES,
    shared_hf_models,
    token_ids,
    transformers_logits,
)

pytestmark = pytest.mark.world(1)


@pytest.fixture(scope="module")
def hf_models():
    models = shared_hf_models()
    yield models
    import shutil

    shutil.rmtree(models.directory, ignore_errors=True)


def _our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    model.eval()
    with torch.no_grad():
        return model(ids, positions)


def _some_slow(families, slow):
    """``families`` as parameters, those in ``slow`` marked slow (default-suite time)."""
    return [pytest.param(f, marks=pytest.mark.slow) if f in slow else f for f in families]


@pytest.mark.parametrize("family", _some_slow(FAMILIES, SLOW_FAMILIES))
def test_logits_equal_transformers(hf_models, family):
    model, config = model_from_hf(hf_models.paths[family])
    assert config.num_layers == 2 and config.params_dtype == torch.float32
    err = rel_error(_our_logits(model, token_ids()), hf_models.logits[family])
    assert err <= 1e-5, f"{family}: relative error {err:.2e}"


def test_negative_control_a_wrong_qkv_layout_is_caught(hf_models):
    """Swap layer 0's key and value rows of query group 0: the check above fails."""
    model, config = model_from_hf(hf_models.paths["llama"])
    d, per_group = config.kv_channels, config.num_attention_heads // config.num_query_groups
    weight = model.decoder.layers[0].self_attention.linear_qkv.weight
    with torch.no_grad():
        k = weight[per_group * d : (per_group + 1) * d].clone()
        weight[per_group * d : (per_group + 1) * d] = weight[
            (per_group + 1) * d : (per_group + 2) * d
        ]
        weight[(per_group + 1) * d : (per_group + 2) * d] = k
    err = rel_error(_our_logits(model, token_ids()), hf_models.logits["llama"])
    assert err > 1e-3, f"a swapped k/v went unnoticed (relative error {err:.2e})"


def test_negative_control_swapped_q_and_k_norms_are_caught(hf_models):
    """Qwen3: swap layer 0's q_norm and k_norm weights: the logit check fails."""
    model, config = model_from_hf(hf_models.paths["qwen3"])
    assert config.qk_layernorm
    attention = model.decoder.layers[0].self_attention
    q, k = attention.q_layernorm.weight, attention.k_layernorm.weight
    assert not torch.equal(q, k)
    with torch.no_grad():
        saved = q.clone()
        q.copy_(k)
        k.copy_(saved)
    err = rel_error(_our_logits(model, token_ids()), hf_models.logits["qwen3"])
    assert err > 1e-3, f"swapped q/k norms went unnoticed (relative error {err:.2e})"


def test_negative_control_per_head_qk_norms_are_caught(hf_models, monkeypatch):
    """OLMoE: the same q/k norm weights applied to each head on its own (``qk_layernorm``
    without ``qk_layernorm_whole_projection``) fail the logit check."""

    def per_head(self, x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * self.weight.view(x.shape[-2], x.shape[-1])

    monkeypatch.setattr(WholeProjectionRMSNorm, "forward", per_head)
    model, config = model_from_hf(hf_models.paths["olmoe"])
    assert config.qk_layernorm_whole_projection
    err = rel_error(_our_logits(model, token_ids()), hf_models.logits["olmoe"])
    assert err > 1e-3, f"per-head q/k norms went unnoticed (relative error {err:.2e})"


@pytest.mark.parametrize("family", _some_slow(MOE_FAMILIES, {"mixtral", "qwen3_moe", "olmoe"}))
def test_moe_logits_with_grouped_experts_equal_transformers(hf_models, family):
    """The same weights in ``GroupedMLP``'s stacked, transposed layout."""
    model, config = model_from_hf(hf_models.paths[family], moe_grouped_gemm=True)
    assert config.num_moe_experts == 4
    assert any("experts.weight1" in name for name, _ in model.named_parameters())
    err = rel_error(_our_logits(model, token_ids()), hf_models.logits[family])
    assert err <= 1e-5, f"{family}: relative error {err:.2e}"


def test_negative_control_swapped_expert_gate_and_up_are_caught(hf_models):
    """Mixtral: swap the w1 (gate) and w3 (up) halves of every expert's fc1 in layer 0."""
    model, _ = model_from_hf(hf_models.paths["mixtral"])
    experts = model.decoder.layers[0].mlp.experts.local_experts
    with torch.no_grad():
        for expert in experts:
            gate, up = expert.linear_fc1.weight.chunk(2)
            expert.linear_fc1.weight.copy_(torch.cat([up, gate]))
    err = rel_error(_our_logits(model, token_ids()), hf_models.logits["mixtral"])
    assert err > 1e-3, f"swapped gate/up went unnoticed (relative error {err:.2e})"


@pytest.mark.parametrize("family", _some_slow(["mixtral", "qwen2_moe"], {"qwen2_moe"}))
def test_negative_control_the_other_topk_normalization_is_caught(hf_models, family):
    """Mixtral renormalizes the top-k probabilities, Qwen2-MoE (norm_topk_prob false) does
    not: the other choice (``moe_router_pre_softmax`` flipped) fails the logit check."""
    model, config = model_from_hf(hf_models.paths[family])
    assert config.moe_router_pre_softmax == (family == "qwen2_moe")
    config.moe_router_pre_softmax = not config.moe_router_pre_softmax  # read at each forward
    err = rel_error(_our_logits(model, token_ids()), hf_models.logits[family])
    assert err > 1e-3, f"{family}: the other top-k weights went unnoticed ({err:.2e})"


@pytest.mark.parametrize("family", _some_slow(FAMILIES, {"qwen3_moe", *SLOW_FAMILIES}))
def test_import_export_gives_back_the_original_tensors(hf_models, family, tmp_path, capsys):
    source = hf_models.paths[family]
    assert hf_cli(["import", "--hf", str(source), "--out", str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "hf"
    assert hf_cli(["export", "--load", str(tmp_path / "ckpt"), "--out", str(out),
                   "--max-shard-size", "10KB"]) == 0  # fmt: skip
    original, exported = SafetensorsReader(source), SafetensorsReader(out)
    assert sorted(original.keys()) == sorted(exported.keys())
    for key in original.keys():
        everything = (slice(None),) * len(original.shape(key))
        a, b = original.read(key, everything), exported.read(key, everything)
        assert a.dtype == b.dtype and torch.equal(a, b), key
    assert (out / "model.safetensors.index.json").is_file()  # 10KB shards: several files
    assert json.loads((out / "config.json").read_text())["model_type"] in family
    err = rel_error(transformers_logits(out, token_ids()), hf_models.logits[family])
    assert err == 0.0, f"{family}: exported model's logits differ ({err:.2e})"


FROM_SCRATCH = {
    "llama": dict(
        LLAMA_SHAPED_SETTINGS,
        untie_embeddings_and_output_weights=True,
        num_query_groups=2,
        rotary_base=500000.0,
    ),
    # a causal sliding window of 5 positions (--window-size 4 0): Mistral's sliding_window 5
    "mistral": dict(
        LLAMA_SHAPED_SETTINGS, untie_embeddings_and_output_weights=True, window_size=[4, 0]
    ),
    "qwen2": dict(LLAMA_SHAPED_SETTINGS, add_qkv_bias=True),
    "qwen3": dict(LLAMA_SHAPED_SETTINGS, qk_layernorm=True, num_query_groups=2, kv_channels=16),
    "gpt2": dict(openai_gelu=True),
}
# Gemma 2 / 3: zero-centred sandwich norms, scaled embeddings, gated tanh-GELU, a window of 4
# keys with full attention every other layer; Gemma 2 soft-caps, Gemma 3 q/k norms and a local
# RoPE base
GEMMA = dict(
    normalization="RMSNorm", geglu=True, openai_gelu=True, position_embedding_type="rope",
    disable_bias_linear=True, apply_layernorm_1p=True, sandwich_layernorm=True,
    embedding_scale_sqrt_hidden=True, num_query_groups=2, kv_channels=16, window_size=[3, 0],
    window_attn_skip_freq=2, attention_backend="unfused",
)  # fmt: skip
FROM_SCRATCH.update(
    gemma2=dict(GEMMA, attn_logit_softcapping=20.0, final_logit_softcapping=10.0),
    gemma3_text=dict(
        GEMMA,
        qk_layernorm=True,
        rotary_base=1e6,
        local_rotary_base=1e4,
        softmax_scale=0.2,
        rotary_seq_len_interpolation_factor=4.0,
    ),
)
MOE = MOE_TRAINER_SETTINGS
FROM_SCRATCH.update(
    mixtral=dict(MOE, untie_embeddings_and_output_weights=True, num_query_groups=2),
    # mixed dense / MoE layers, unnormalized top-k, gated shared expert, q/k/v biases
    qwen2_moe=dict(
        MOE,
        add_qkv_bias=True,
        moe_router_pre_softmax=True,
        moe_shared_expert_intermediate_size=40,
        moe_shared_expert_gate=True,
        moe_layer_freq=[0, 1],
    ),
    qwen3_moe=dict(MOE, qk_layernorm=True, kv_channels=16, moe_layer_freq=[1, 1]),
    # whole-projection q/k norms, unnormalized top-k, GQA
    olmoe=dict(
        MOE,
        qk_layernorm=True,
        qk_layernorm_whole_projection=True,
        moe_router_pre_softmax=True,
        num_query_groups=2,
    ),
)


@pytest.mark.parametrize(
    "family", _some_slow(FROM_SCRATCH, {"mixtral", "qwen3_moe", "olmoe", "gemma2", "gemma3_text"})
)
def test_a_model_trained_from_scratch_exports_to_transformers(family, tmp_path):
    """--export-hf of a run that did not start from HuggingFace: the config.json written
    from its options makes transformers compute what our model computes."""
    from megatron.training import TrainingConfig
    from megatron.training.training import pretrain
    from tests.unit_tests.dist_utils import fresh_layout

    if not HAVE_TRANSFORMERS:
        pytest.skip(SKIP_REASON)
    out = tmp_path / "exported"
    config = TrainingConfig(
        num_layers=2, seq_length=16, global_batch_size=4, train_iters=1, progress=False,
        export_hf=str(out), **FROM_SCRATCH[family],
    )  # fmt: skip
    with fresh_layout():
        pretrain(config)
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    ids = token_ids() % config.vocab_size
    model, _ = model_from_hf(out)
    err = rel_error(transformers_logits(out, ids), _our_logits(model, ids))
    assert err <= 1e-5, f"{family}: relative error {err:.2e}"
