"""MTP weights in DeepSeek-V3's HuggingFace layout (``megatron/training/hf/mtp_weights.py``'s
tables, for the DeepSeek family), through the export's and the import's own functions: depth
k is decoder layer num_hidden_layers + k with ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, copies of ``embed_tokens`` and ``shared_head.head``, and the family's
decoder-layer tensors; what the export writes reads back as every ``mtp.layers.*``
parameter. (A head copy that differs is refused by the checkpoint check:
test_hf_deepseek_mtp.py.)"""

import pytest
import torch

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.training.hf.checkpoint import mtp_units, unit_hf_tensors
from megatron.training.hf.family import HFArchitecture
from megatron.training.hf.weights import (
    SafetensorsReader,
    mtp_parameter_sources,
    our_full_shapes,
    read_rows,
)
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
    mtp_num_layers=2,
)


def _ours():
    model = _model(_config(), ProcessGroupCollection())
    return {name: param.detach().clone() for name, param in reference_names(model)}


def _exported(ours, directory):
    """The HuggingFace tensors the export writes for the MTP depths (``unit_hf_tensors``, as
    ``_export_into`` writes them), saved as ``model.safetensors`` in ``directory`` and read
    back with the import's reader."""
    from safetensors.torch import save_file

    hf = {}
    for unit in mtp_units(ARCH):
        mine = {name: ours[name] for name in unit}
        written = unit_hf_tensors(ARCH, unit, mine, ours, our_full_shapes(ARCH))
        hf.update({key: tensor.contiguous().clone() for key, tensor in written.items()})
    save_file(hf, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return SafetensorsReader(directory)


def _read(reader, key):
    return reader.read(key, (slice(None),) * len(reader.shape(key)))


def test_mtp_export_has_deepseek_v3_names_and_imports_back(tmp_path):
    """Every key of depths 0 and 1 (layers 2 and 3), eh_proj's [e; h] columns as ours, the
    copies equal to the shared tensors, and what the import reads back exact."""
    ours = _ours()
    reader = _exported(ours, tmp_path)
    per_layer = [
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
        "embed_tokens.weight", "shared_head.head.weight", "input_layernorm.weight",
        "post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
        "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight", "mlp.down_proj.weight",
    ]  # fmt: skip
    assert set(reader.keys()) == {
        f"model.layers.{layer}.{name}" for layer in (2, 3) for name in per_layer
    }
    assert torch.equal(
        _read(reader, "model.layers.3.eh_proj.weight"), ours["mtp.layers.1.eh_proj.weight"]
    )
    assert reader.shape("model.layers.2.eh_proj.weight") == (HIDDEN, 2 * HIDDEN)
    assert torch.equal(
        _read(reader, "model.layers.2.shared_head.norm.weight"),
        ours["mtp.layers.0.final_layernorm.weight"],
    )
    assert torch.equal(
        _read(reader, "model.layers.2.shared_head.head.weight"), ours["output_layer.weight"]
    )
    assert torch.equal(
        _read(reader, "model.layers.3.embed_tokens.weight"),
        ours["embedding.word_embeddings.weight"],
    )
    sources = mtp_parameter_sources(ARCH)
    mtp = {name for name in ours if name.startswith("mtp.")}
    assert set(sources) == mtp
    for name in mtp:
        back = read_rows(reader, sources[name], [(0, ours[name].shape[0])], None)
        assert torch.equal(back, ours[name]), name
