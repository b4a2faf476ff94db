"""One cache of rotary angles: ``RotaryEmbedding.cached_angles`` (``core/rope.py``) keeps the
last length's angles on the device; GPTModel (training and cached-inference forwards) and
``MLASelfAttention`` read their embedding's instead of keeping caches of their own (MLA's:
``test_mla_parity.py``, ``test_mla_rotates_with_megatron_cores_rotary_embedding``)."""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.rope import RotaryEmbedding, YarnRotaryEmbedding
from megatron.core.transformer.transformer_config import TransformerConfig

pytestmark = pytest.mark.world(1)

CPU = torch.device("cpu")


def _counting(embedding: RotaryEmbedding) -> list:
    """The lengths ``embedding``'s forward is called with, from now on."""
    calls, forward = [], embedding.forward

    def counted(max_seq_len, *args, **kwargs):
        calls.append(max_seq_len)
        return forward(max_seq_len, *args, **kwargs)

    embedding.forward = counted
    return calls


@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_cached_angles_are_forwards_built_once_per_key(yarn):
    if yarn:
        embedding = YarnRotaryEmbedding(8, scaling_factor=4.0, mscale=0.7, mscale_all_dim=0.3)
    else:
        embedding = RotaryEmbedding(8, 1.0)
    expected = embedding(6)
    expected = expected if yarn else (expected, 1.0)
    calls = _counting(embedding)
    angles, scale = embedding.cached_angles(6, CPU)
    assert torch.equal(angles, expected[0]) and scale == expected[1]
    assert embedding.cached_angles(6, CPU)[0] is angles and calls == [6]
    assert embedding.cached_angles(5, CPU)[0].shape[0] == 5 and calls == [6, 5]
    assert embedding.cached_angles(5, torch.device("meta"))[0].is_meta and calls == [6, 5, 5]
    embedding.clear_cache()
    assert torch.equal(embedding.cached_angles(5, CPU)[0], expected[0][:5])
    assert calls == [6, 5, 5, 5]


def _gpt() -> GPTModel:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=32,
        attention_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec()
    pgs = ProcessGroupCollection()
    return GPTModel(config, spec, 32, 16, position_embedding_type="rope", pg_collection=pgs)


def test_gpt_model_reads_its_embeddings_cache():
    """Two forwards build the angles once, in the embedding's cache (the model holds none of
    its own); a cached-inference forward takes its positions of the same table."""
    model = _gpt()
    expected = model.rotary_pos_emb(8)
    calls = _counting(model.rotary_pos_emb)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, None)
        model(ids, None)
    assert calls == [8]
    key, (angles, _) = model.rotary_pos_emb._angles_cache
    assert key == (8, 1, 0, CPU) and torch.equal(angles, expected)
    assert not [name for name in vars(model) if "cache" in name or "inference_rotary" in name]
    context = SimpleNamespace(max_sequence_length=8, sequence_len_offset=3)
    got = model._rotary_angles_from(context, torch.zeros(2, 1, 16))
    assert torch.equal(got, angles[3:5]) and calls == [8]


def test_packed_rows_index_the_same_cache():
    """Packed (THD) rows take each document's positions of the cached table: built once over
    forwards (and the slot an unpacked forward of that length reads), not per forward."""
    from megatron.core.packed_seq_params import PackedSeqParams

    model = _gpt()
    table = model.rotary_pos_emb(8)
    calls = _counting(model.rotary_pos_emb)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    hidden = torch.zeros(8, 1, 16)
    first = model._rotary_angles(None, hidden, packed)
    second = model._rotary_angles(None, hidden, packed)
    expected = table[torch.tensor([0, 1, 2, 0, 1, 2, 3, 4])]
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert (
        calls == [8]
        and model._rotary_angles(None, hidden, None) is model.rotary_pos_emb._angles_cache[1][0]
    )
