"""MTP weights in DeepSeek-V3's HuggingFace layout (``megatron/training/hf/mtp_weights.py``,
for the DeepSeek family): depth k is decoder layer num_hidden_layers + k with ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm``, copies of ``embed_tokens`` and
``shared_head.head``, and the family's decoder-layer tensors; export then import gives every
``mtp.layers.*`` parameter back; a head copy that differs is refused by name."""

import pytest
import torch

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.training.hf.families import REGISTRY
from megatron.training.hf.family import HFArchitecture
from megatron.training.hf.mtp_weights import export_mtp, import_mtp, mtp_sources
from tests.unit_tests.models.naming import reference_names
from tests.unit_tests.models.test_multi_token_prediction import (
    HEADS,
    HIDDEN,
    LAYERS,
    VOCAB,
    _config,
    _model,
)

pytestmark = pytest.mark.world(1)

ARCH = HFArchitecture(
    family="llama",
    num_layers=LAYERS,
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    num_query_groups=HEADS,
    kv_channels=HIDDEN // HEADS,
    ffn_hidden_size=24,
    vocab_size=VOCAB,
    normalization="RMSNorm",
    norm_epsilon=1e-6,
    swiglu=True,
    activation="silu",
    position_embedding_type="rope",
    max_position_embeddings=8,
    rotary_base=10000.0,
    rope_scaling_factor=None,
    add_bias_linear=False,
    add_qkv_bias=False,
    tied=False,
)


def _layer_sources(layer: int):
    return REGISTRY["llama"].layer_sources(ARCH, layer, None)


def _ours():
    model = _model(_config(), ProcessGroupCollection())
    return {name: param.detach().clone() for name, param in reference_names(model)}


def test_mtp_export_has_deepseek_v3_names_and_imports_back():
    """Every key of depths 0 and 1 (layers 2 and 3), eh_proj's [e; h] columns as ours, the
    copies equal to the shared tensors, and the round trip exact."""
    ours = _ours()
    hf = export_mtp(ours, ARCH, 2, _layer_sources)
    per_layer = [
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
        "embed_tokens.weight", "shared_head.head.weight", "input_layernorm.weight",
        "post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
        "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight", "mlp.down_proj.weight",
    ]  # fmt: skip
    assert set(hf) == {f"model.layers.{layer}.{name}" for layer in (2, 3) for name in per_layer}
    assert torch.equal(hf["model.layers.3.eh_proj.weight"], ours["mtp.layers.1.eh_proj.weight"])
    assert hf["model.layers.2.eh_proj.weight"].shape == (HIDDEN, 2 * HIDDEN)
    assert torch.equal(
        hf["model.layers.2.shared_head.norm.weight"], ours["mtp.layers.0.final_layernorm.weight"]
    )
    assert torch.equal(hf["model.layers.2.shared_head.head.weight"], ours["output_layer.weight"])
    assert torch.equal(
        hf["model.layers.3.embed_tokens.weight"], ours["embedding.word_embeddings.weight"]
    )
    back = import_mtp(hf, ours, ARCH, 2, _layer_sources)
    mtp = {name for name in ours if name.startswith("mtp.")}
    assert set(back) == mtp == set(mtp_sources(ARCH, 2, _layer_sources))
    for name in mtp:
        assert torch.equal(back[name], ours[name]), name


def test_mtp_import_refuses_a_head_of_its_own():
    """A shared_head.head that is not the model's output layer is refused by name."""
    ours = _ours()
    hf = export_mtp(ours, ARCH, 1, _layer_sources)
    hf["model.layers.2.shared_head.head.weight"] += 1.0
    with pytest.raises(ValueError, match=r"model.layers.2.shared_head.head.weight differs"):
        import_mtp(hf, ours, ARCH, 1, _layer_sources)
    del hf["model.layers.2.enorm.weight"]
    hf["model.layers.2.shared_head.head.weight"] -= 1.0
    with pytest.raises(ValueError, match=r"no model.layers.2.enorm.weight"):
        import_mtp(hf, ours, ARCH, 1, _layer_sources)
