"""Transformer Engine's fused names accepted when loading: megatron-core's TE layer spec
stores the MLA q / kv down-projection norms as ``linear_q_up_proj.layer_norm_weight`` /
``linear_kv_up_proj.layer_norm_weight``; a checkpoint saved under those names loads into our
``q_layernorm`` / ``kv_layernorm`` (``load_aliases.LOAD_ALIASES``)."""

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.transformer.test_mla_parity import _config

pytestmark = pytest.mark.world(1)
TE_NAMES = {
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}


def _model(seed: int) -> GPTModel:
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
    model = GPTModel(
        _config("rope", 12), spec, 32, 8, position_embedding_type="rope",
        pg_collection=ProcessGroupCollection(),
    )  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def _save_under_te_names(model: GPTModel, directory) -> set:
    """Save ``model`` with the q / kv norms under TE's names; the renamed storage keys."""
    state = model.sharded_state_dict()
    renamed = set()
    for piece in state.values():
        for ours, theirs in TE_NAMES.items():
            if getattr(piece, "key", "").endswith(ours):
                piece.key = piece.key[: -len(ours)] + theirs
                renamed.add(piece.key)
    dist_checkpointing.save(state, str(directory))
    return renamed


def test_a_checkpoint_under_te_names_loads_into_the_mla_norms(tmp_path):
    saved = _model(0)
    renamed = _save_under_te_names(saved, tmp_path)
    assert renamed == {
        "decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight",
        "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight",
    }
    stored = set(dist_checkpointing.load_tensors_metadata(str(tmp_path)))
    assert not any(k.endswith(("q_layernorm.weight", "kv_layernorm.weight")) for k in stored)
    fresh = _model(1)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path)))
    for (name, a), b in zip(saved.state_dict().items(), fresh.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    assert any("q_layernorm" in n for n, _ in saved.named_parameters())


def test_an_alias_is_used_only_when_the_own_name_is_missing(tmp_path):
    """A checkpoint with neither name: the error names our key."""
    state = _model(0).sharded_state_dict()
    del state["decoder.layers.0.self_attention.kv_layernorm.weight"]
    del state["decoder.layers.1.self_attention.kv_layernorm.weight"]
    dist_checkpointing.save(state, str(tmp_path))
    with pytest.raises(
        CheckpointingException, match=r"no 'decoder.layers.self_attention.kv_layernorm"
    ):
        dist_checkpointing.load(_model(1).sharded_state_dict(), str(tmp_path))
