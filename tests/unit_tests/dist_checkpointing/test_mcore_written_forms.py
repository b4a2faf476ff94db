"""The forms of a checkpoint written by megatron-core 0.16.1 that loading here accepts, each
checked without megatron-core (the whole checkpoint, written by megatron-core itself:
``test_mcore_checkpoint.py``, slow):

- its ``.metadata`` keeps every rank's save plan (``all_local_plans``: DCP's ``SavePlan``,
  ``WriteItem``, ...), admitted by the metadata unpickler (before: refused);
- an unstacked ``_extra_state`` object at shape (1,), offset (0,)
  (``make_sharded_object_for_checkpoint``, now here too), and the old form of this package
  (shape ()) still loads;
- the pre-MLP norm under the other name (``mlp.linear_fc1.layer_norm_weight``: where this
  package stored an MLA layer's before it used megatron-core's ``pre_mlp_layernorm.weight``)
  loads;
- no ``output_layer._extra_state`` (megatron-core's GPTModel drops it);
- the trainer does not count unrequested ``_extra_state`` objects as dropped weights.
"""

import json
import pickle
import zlib

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing import storage as ckpt_storage
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
from tests.unit_tests.dist_checkpointing.test_te_aliases import _model

pytestmark = pytest.mark.world(1)


def _weights(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}


def test_metadata_with_megatron_core_save_plans_loads(tmp_path):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    weight = torch.arange(6.0).reshape(2, 3)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight)}, str(tmp_path))
    path = tmp_path / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    item = WriteItem(index=MetadataIndex("w", torch.Size([0, 0])), type=WriteItemType.SHARD)
    metadata.all_local_plans = [SavePlan(items=[item], planner_data={"w": ("w",)})]
    path.write_bytes(pickle.dumps(metadata))
    (tmp_path / ckpt_storage.CHECKSUMS_FNAME).unlink()  # as megatron-core writes none
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}
    assert torch.equal(dist_checkpointing.load(request, str(tmp_path))["w"], weight)


def test_an_unstacked_object_has_megatron_cores_grid_and_both_forms_load(tmp_path):
    piece = make_sharded_object_for_checkpoint(None, "layer.linear._extra_state")
    assert piece.unique_key == "layer.linear._extra_state/shard_0_1"  # megatron-core's
    for shape, offset in (((1,), (0,)), ((), ())):
        where = tmp_path / f"form{len(shape)}"
        where.mkdir()
        stored = ShardedObject("x._extra_state", {"v": 3}, shape, offset, replica_id=0)
        dist_checkpointing.save({"x": stored}, str(where))
        for asked_shape, asked_offset in (((1,), (0,)), ((), ())):
            asked = ShardedObject("x._extra_state", None, asked_shape, asked_offset)
            assert dist_checkpointing.load({"x": asked}, str(where))["x"] == {"v": 3}
    with pytest.raises(CheckpointingException, match="no 'y._extra_state/shard_0_1'"):
        asked = ShardedObject("y._extra_state", None, (1,), (0,))
        dist_checkpointing.load({"y": asked}, str(tmp_path / "form1"))


def _stored_payload(directory, key: str):
    """What the DCP byte entry ``key`` holds (``torch.save``'d), as written."""
    import torch.distributed.checkpoint as dcp

    planner = ckpt_storage._BoxLoadPlanner([], [key])
    reader = ckpt_storage.SafeFileSystemReader(str(directory))
    dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
    return planner.loaded_objects[key]


def _bare_object_writer(monkeypatch):
    """Save as this package did before: a ShardedObject's bare data, no ``object_form``."""
    checked, write = ckpt_storage.serialize_checked, ckpt_storage.write_checksums

    def bare(obj, what):
        listed = what.startswith("ShardedObject") and isinstance(obj, list)
        return checked(obj[0] if listed else obj, what)

    def old_checksums(directory, items, files):
        write(directory, items, files)
        path = directory / ckpt_storage.CHECKSUMS_FNAME
        record = json.loads(path.read_text())
        body = {k: record[k] for k in ("algorithm", "files", "items")}
        path.write_text(
            json.dumps(dict(body, self_crc32=zlib.crc32(ckpt_storage._canonical(body))))
        )

    monkeypatch.setattr(ckpt_storage, "serialize_checked", bare)
    monkeypatch.setattr(ckpt_storage, "write_checksums", old_checksums)


def test_objects_are_stored_in_megatron_cores_form_and_the_old_form_still_loads(
    tmp_path, monkeypatch
):
    """A ShardedObject is stored as ``torch.save([data])``, megatron-core's torch_dist form
    (before: the bare data, which megatron-core's loader cannot read: every GPT checkpoint
    has ``_extra_state`` objects); a checkpoint of the old form (its checksums.json without
    ``object_form``) and megatron-core's (no checksums.json) load; a payload not of the
    recorded form is refused by name."""
    piece = {"x": ShardedObject("x", {"v": 3}, (1,), (0,), replica_id=0)}
    new, old, theirs = (tmp_path / name for name in ("new", "old", "theirs"))
    for where in (new, old, theirs):
        where.mkdir()
    dist_checkpointing.save(piece, str(new))
    dist_checkpointing.save(piece, str(theirs))
    (theirs / ckpt_storage.CHECKSUMS_FNAME).unlink()
    with monkeypatch.context() as patch:
        _bare_object_writer(patch)
        dist_checkpointing.save(piece, str(old))
    assert _stored_payload(new, "x/shard_0_1") == [{"v": 3}]
    assert _stored_payload(old, "x/shard_0_1") == {"v": 3}
    for where in (new, old, theirs):
        asked = {"x": ShardedObject("x", None, (1,), (0,))}
        assert dist_checkpointing.load(asked, str(where))["x"] == {"v": 3}, where
    # the old payload without checksums.json (so read as megatron-core's form): refused
    (new / "__0_0.distcp").write_bytes((old / "__0_0.distcp").read_bytes())
    (new / ckpt_storage.CHECKSUMS_FNAME).unlink()
    with pytest.raises(CheckpointingException, match="a list of one object; got dict"):
        dist_checkpointing.load({"x": ShardedObject("x", None, (1,), (0,))}, str(new))


def test_the_pre_mlp_norm_loads_from_either_name(tmp_path):
    saved = _model(0)
    state = saved.sharded_state_dict()
    assert "output_layer._extra_state" not in state  # megatron-core's GPTModel drops it
    ours = "decoder.layers.pre_mlp_layernorm.weight"  # megatron-core's MLA layer's
    assert state["decoder.layers.0.pre_mlp_layernorm.weight"].key == ours
    for layer in (0, 1):  # as this package wrote it before
        state[f"decoder.layers.{layer}.pre_mlp_layernorm.weight"].key = (
            "decoder.layers.mlp.linear_fc1.layer_norm_weight"
        )
    dist_checkpointing.save(state, str(tmp_path))
    assert ours not in dist_checkpointing.load_tensors_metadata(str(tmp_path))
    fresh = _model(1)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path)))
    for name, value in _weights(saved).items():
        assert torch.equal(_weights(fresh)[name], value), name


def test_the_trainer_does_not_count_extra_states_as_dropped_weights(tmp_path):
    from megatron.training.checkpointing import _check_keys

    _check_keys(tmp_path, {"mtp.layers.0.eh_proj._extra_state/shard_0_1"}, set(), ())
    with pytest.raises(CheckpointingException, match="holds mtp.layers.0.eh_proj.weight"):
        _check_keys(tmp_path, {"mtp.layers.0.eh_proj.weight"}, set(), ())
    with pytest.raises(CheckpointingException, match="asks for x._extra_state/shard_0_1"):
        _check_keys(tmp_path, set(), {"x._extra_state/shard_0_1"}, ())


def test_the_trainer_refuses_to_resume_optimizer_state_a_foreign_checkpoint_lacks(tmp_path):
    """A checkpoint not written by the trainer (no run record) without optimizer state, e.g.
    megatron-core's save of a model: resuming it is refused naming --finetune (before: the
    load failed inside the optimizer's merge); a trainer's checkpoint is not affected."""
    from megatron.training.checkpointing import _check_resume

    weight = ShardedTensor.from_rank_offsets("w", torch.ones(2))
    dist_checkpointing.save({"w": weight}, str(tmp_path))

    def check(common, finetune=False, load_optim=True):
        return _check_resume(common, None, tmp_path, "--load x", finetune, load_optim, None, (0, 0))

    with pytest.raises(ValueError, match="holds no optimizer state .* pass --finetune"):
        check({})
    assert check({}, finetune=True) == [] and check({}, load_optim=False) == []
    assert check({"run_settings": {}}) == []  # ours (an SGD run may store no state)


def test_a_model_only_checkpoint_is_refused_by_one_rule(tmp_path, monkeypatch):
    """``hf import``'s model-only mark and a foreign checkpoint without optimizer state are
    one refusal, one message; with the mark (or a run record) the stored keys are not read."""
    from megatron.training import checkpointing

    weight = ShardedTensor.from_rank_offsets("w", torch.ones(2))
    dist_checkpointing.save({"w": weight}, str(tmp_path))
    reads, read = [], ckpt_storage.read_metadata
    monkeypatch.setattr(ckpt_storage, "read_metadata", lambda d: reads.append(d) or read(d))

    def message(common):
        with pytest.raises(ValueError) as info:
            checkpointing._check_resume(common, None, tmp_path, "W", False, True, None, (0, 0))
        return str(info.value)

    marked = message({"model_only": True})
    assert not reads and marked == message({}) and reads == [tmp_path]
    assert "holds no optimizer state" in marked and "hf import" in marked


def _rewrite_checksums(directory, change, reseal: bool = True) -> None:
    """Apply ``change`` to the checkpoint's checksums.json record, its self CRC-32 recomputed
    over every other field (as a writer of that record would), or left (``reseal`` False)."""
    path = directory / ckpt_storage.CHECKSUMS_FNAME
    record = json.loads(path.read_text())
    change(record)
    if reseal:
        body = {k: v for k, v in record.items() if k != "self_crc32"}
        record["self_crc32"] = zlib.crc32(ckpt_storage._canonical(body))
    path.write_text(json.dumps(record))


def test_a_later_versions_checksums_fields_verify_and_an_unknown_object_form_is_refused(
    tmp_path,
):
    """A field a later version adds to checksums.json (covered by its self CRC-32) loads: the
    CRC covers every field (before: only the fields this version knew, so such a checkpoint
    read as damaged); the field changed after the save is still damage; an object form this
    version does not know is refused by name, not read as the bare form."""
    piece = {"x": ShardedObject("x", {"v": 3}, (1,), (0,), replica_id=0)}
    dist_checkpointing.save(piece, str(tmp_path))
    asked = {"x": ShardedObject("x", None, (1,), (0,))}
    _rewrite_checksums(tmp_path, lambda r: r.update(layout_format=2))
    assert dist_checkpointing.load(asked, str(tmp_path))["x"] == {"v": 3}
    _rewrite_checksums(tmp_path, lambda r: r.update(layout_format=3), reseal=False)
    with pytest.raises(CheckpointingException, match="does not match its own CRC-32"):
        dist_checkpointing.load(asked, str(tmp_path))
    _rewrite_checksums(tmp_path, lambda r: r.update(layout_format=2, object_form="dict"))
    match = r"object_form 'dict', written by a later version of this package; this one reads"
    with pytest.raises(CheckpointingException, match=match):
        dist_checkpointing.load(asked, str(tmp_path))


def test_a_megatron_lm_trainers_args_read_and_other_pickled_objects_are_refused(tmp_path):
    """common.pt as Megatron-LM's trainer writes it: its ``args`` namespace reads, each
    megatron enum in it as a ``SavedValue`` naming its class and value (nothing of megatron
    imported or run; the enums here are this package's, pickled under megatron-core's names);
    a payload with any other global (``os.system`` beside the args) is refused naming it."""
    import argparse
    import os

    from megatron.core.dist_checkpointing.storage import SavedValue
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path)
    (tmp_path / ckpt_storage.CHECKSUMS_FNAME).unlink()  # Megatron-LM writes none
    args = argparse.Namespace(hidden_size=16, params_dtype=torch.bfloat16,
                              model_type=ModelType.encoder_or_decoder,
                              attention_backend=AttnBackend.auto)  # fmt: skip
    torch.save({"args": args, "iteration": 10}, tmp_path / "common.pt")
    common = dist_checkpointing.load_common_state_dict(str(tmp_path))
    loaded = common["args"]
    assert common["iteration"] == 10 and isinstance(loaded, argparse.Namespace)
    assert loaded.hidden_size == 16 and loaded.params_dtype == torch.bfloat16
    backend = loaded.attention_backend
    assert isinstance(backend, SavedValue) and not isinstance(backend, AttnBackend)
    assert backend.qualified_name == "megatron.core.transformer.enums.AttnBackend"
    assert backend.arguments == (AttnBackend.auto.value,)
    torch.save({"args": args, "hook": os.system}, tmp_path / "common.pt")
    with pytest.raises(
        CheckpointingException, match=r"common.pt: refused, .*\(globals \w+\.system\)"
    ):
        dist_checkpointing.load_common_state_dict(str(tmp_path))
