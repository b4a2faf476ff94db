"""Our ``GPTModel.sharded_state_dict`` stores every tensor under megatron-core 0.16.1's key,
with its global shape and offset, for each local layer kind: dense, MoE, MLA dense, MLA MoE
and the MTP depth (before: the pre-MLP norm of a MoE layer was ``pre_mlp_layernorm.*`` here,
``mlp.linear_fc1.layer_norm_*`` there, and the other way round in an MLA dense layer, so
megatron-core could not load those layers from a checkpoint written here).

Recorded from the real megatron-core by ``tests/tools/record_gpt_sharded_keys_facts.py``
into ``tests/unit_tests/data/mcore_gpt_sharded_keys.json``; each case is built here with the
same config (megatron-core loading a whole checkpoint of ours: ``test_mcore_checkpoint.py``,
slow).
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

pytestmark = pytest.mark.world(1)
FACTS = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "mcore_gpt_sharded_keys.json").read_text()
)


def build(fields: dict) -> GPTModel:
    """Our model of a recorded case (megatron-core's local decoder and MTP block specs)."""
    fields = dict(fields)
    vocab, seq = fields.pop("vocab_size"), fields.pop("seq_length")
    if "params_dtype" in fields:
        fields["params_dtype"] = getattr(torch, fields["params_dtype"])
    kind = MLATransformerConfig if "q_lora_rank" in fields else TransformerConfig
    config = kind(**fields, activation_func=F.silu)
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm"
    )
    mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False)
    return GPTModel(
        config, block, vocab, seq, position_embedding_type="rope", mtp_block_spec=mtp,
        pg_collection=ProcessGroupCollection(),
    )  # fmt: skip


@pytest.mark.parametrize("case", sorted(FACTS))
def test_storage_keys_are_megatron_cores(case):
    """The same state-dict keys with the same storage keys; where both are a ShardedTensor,
    the same global shape and offset (a factory: the gated fc1, the routed experts)."""
    facts = FACTS[case]
    torch.manual_seed(0)
    state = build(facts["config"]).sharded_state_dict()
    ours = {k: v for k, v in state.items() if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
    theirs = {k: v[0] for k, v in facts["tensors"].items()} | facts["factories"]
    assert {k: v.key for k, v in ours.items()} == theirs
    for name, (_, shape, offset) in facts["tensors"].items():
        if isinstance(ours[name], ShardedTensor):
            assert list(ours[name].global_shape) == shape, name
            assert list(ours[name].global_offset) == offset, name
    objects = {v.unique_key for v in nested_values(state) if isinstance(v, ShardedObject)}
    assert objects <= set(facts["objects"])  # theirs: also modules ours has not
    norms = [k for k in theirs.values() if "pre_mlp_layernorm" in k or "fc1.layer_norm" in k]
    assert len(norms) == 3  # the dense layer's, the MoE layer's, the MTP depth's


OLD_NAMES = {  # where this package stored the pre-MLP norm before: MoE and MLA dense layers
    "moe": {"decoder.layers.1.", "mtp.layers.0.transformer_layer."},
    "mla-moe": {"decoder.layers.0."},
}


def _old_name(key: str, case: str) -> str:
    for head in OLD_NAMES[case]:
        for new, old in (
            ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
            ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
        ):
            if key == head + new:
                return head + old
    return key


@pytest.mark.parametrize("case", sorted(FACTS))
def test_the_hf_export_reads_the_norms_under_either_name(case):
    """The export's lookup (``storage_location``) of each layer parameter is megatron-core's
    key; in a checkpoint written before (the pre-MLP norm of a MoE or MLA dense layer under
    the other name), the name that checkpoint has."""
    from dataclasses import replace

    from megatron.training.hf.checkpoint import storage_location
    from tests.unit_tests.hf.test_hf_mtp_weights import ARCH

    fields = FACTS[case]["config"]
    arch = replace(
        ARCH, num_layers=2, mtp_num_layers=1, num_moe_experts=4, moe_layer_freq=(0, 1),
        multi_latent_attention="q_lora_rank" in fields,
    )  # fmt: skip
    names = {k: v[0] for k, v in FACTS[case]["tensors"].items() if ".layers." in k}
    names = {k: v for k, v in names.items() if "local_experts" not in k}
    old = {k: _old_name(v, case) for k, v in names.items()}
    assert sum(a != b for a, b in zip(names.values(), old.values())) == len(OLD_NAMES[case])
    for stored in (names, old):
        found = {k: storage_location(k, arch, set(stored.values()))[0] for k in stored}
        assert found == stored


@pytest.mark.parametrize("case", sorted(FACTS))
def test_a_checkpoint_with_the_old_names_still_loads(case, tmp_path):
    """A checkpoint written before (the pre-MLP norms of the MoE / MLA dense layers under
    the other name) loads every tensor (``load_aliases.LOAD_ALIASES``)."""
    from megatron.core import dist_checkpointing

    torch.manual_seed(0)
    saved = build(FACTS[case]["config"])
    with torch.no_grad():
        for p in saved.parameters():
            p.uniform_(0.5, 1.5)
    state = saved.sharded_state_dict()
    for piece in nested_values(state):
        if isinstance(piece, ShardedTensor):
            piece.key = _old_name(piece.key, case)
    dist_checkpointing.save(state, str(tmp_path))
    stored = set(dist_checkpointing.load_tensors_metadata(str(tmp_path)))
    recorded = {v[0] for v in FACTS[case]["tensors"].values()} | set(
        FACTS[case]["factories"].values()
    )
    assert len(stored - recorded) == len(OLD_NAMES[case])  # the old names
    torch.manual_seed(1)
    fresh = build(FACTS[case]["config"])
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path)))
    for (name, a), b in zip(saved.state_dict().items(), fresh.state_dict().values()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name


def _old_layer_keys(original):
    """``TransformerLayer.sharded_state_dict`` storing the pre-MLP norm as this package did
    before: ``pre_mlp_layernorm.*`` in MoE layers, ``mlp.linear_fc1.layer_norm_*`` in MLA
    dense layers."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    def sharded_state_dict(self, prefix="", *args, **kwargs):
        out = original(self, prefix, *args, **kwargs)
        fused, own = "mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."
        mla = isinstance(self.self_attention, MLASelfAttention)
        renames = {fused: own} if self.is_moe_layer else {own: fused} if mla else {}
        for piece in nested_values(out):  # (within a layer these names are its norm's only)
            for new, old in renames.items():
                piece.key = piece.key.replace(new, old, 1)
        return out

    return sharded_state_dict


@pytest.mark.slow
def test_the_trainer_resumes_a_moe_checkpoint_written_with_the_old_names(tmp_path):
    """A MoE run's checkpoint written before (the pre-MLP norms as ``pre_mlp_layernorm.*``,
    optimizer state included) resumes: the losses equal the uninterrupted run's bitwise."""
    from unittest import mock

    from megatron.core import dist_checkpointing
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.training import TrainingConfig
    from megatron.training.training import pretrain
    from tests.unit_tests.dist_utils import fresh_layout

    moe = dict(num_experts=4, disable_bias_linear=True, num_layers=2, hidden_size=16)
    moe.update(seq_length=16, global_batch_size=4, progress=False)

    def run(**changes):
        with fresh_layout():
            return [r["loss"] for r in pretrain(TrainingConfig(**moe, **changes)).records]

    straight = run(train_iters=4)
    old = _old_layer_keys(TransformerLayer.sharded_state_dict)
    with mock.patch.object(TransformerLayer, "sharded_state_dict", old):
        assert run(train_iters=2, save=str(tmp_path), save_interval=2) == straight[:2]
    stored = dist_checkpointing.load_tensors_metadata(str(tmp_path / "iter_0000002"))
    assert "decoder.layers.pre_mlp_layernorm.weight" in stored
    assert not any("linear_fc1.layer_norm" in k for k in stored)
    assert run(train_iters=4, load=str(tmp_path)) == straight[2:]
