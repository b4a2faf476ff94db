"""HuggingFace conversion against ``transformers`` itself, one process.

For each family (Llama 3 with GQA and llama3 rope scaling, Mistral with head_dim != hidden /
heads, Qwen2 with q/k/v biases and tied embeddings, Qwen3 with per-head q/k norms (tied with
head_dim != hidden / heads, and untied), GPT-2 with Conv1D weights and learned
positions; some saved sharded): our logits from ``model_from_hf`` equal transformers' within
1e-5 relative (float32); ``import`` then ``export`` gives back exactly the original tensors;
the exported directory loads in transformers with the same logits. Negative controls show
the logit check catches a wrong q/k/v layout and swapped q/k norms.
"""

import json

import pytest
import torch

from megatron.training.hf import model_from_hf
from megatron.training.hf.__main__ import main as hf_cli
from megatron.training.hf.weights import SafetensorsReader
from tests.unit_tests.dist_utils import rel_error
from tests.unit_tests.hf.hf_models import (
    FAMILIES,
    HAVE_TRANSFORMERS,
    SKIP_REASON,
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


@pytest.mark.parametrize("family", list(FAMILIES))
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


@pytest.mark.parametrize("family", list(FAMILIES))
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
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True,
        num_query_groups=2,
        rotary_base=500000.0,
    ),
    "qwen2": dict(
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        disable_bias_linear=True,
        add_qkv_bias=True,
    ),
    "qwen3": dict(
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        disable_bias_linear=True,
        qk_layernorm=True,
        num_query_groups=2,
        kv_channels=16,
    ),
    "gpt2": dict(openai_gelu=True),
}


@pytest.mark.parametrize("family", list(FROM_SCRATCH))
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
