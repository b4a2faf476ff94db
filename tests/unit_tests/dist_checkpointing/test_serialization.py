"""One process: what a checkpoint holds, what loading refuses, and the errors for bad input.

- round trip: tensors (with prepended axes), objects, factories, common and non-persistent
  values come back as saved; the returned dict mirrors the request;
- loading never unpickles arbitrary objects: a common state, ShardedObject or DCP metadata
  that needs more than ``torch.load(weights_only=True)`` is refused, and the payload is not
  run; ``save`` refuses such values before writing;
- an incomplete directory (no ``metadata.json``: a save that did not finish) is refused, and a
  save that fails part-way retires the old checkpoint's marker first;
- bad input: a missing directory, mismatched shapes, unknown keys with each ``strict`` mode,
  unsupported strategies and options, impossible rank offsets.
"""

import io
import os
import pickle
import traceback
import zlib
from pathlib import Path

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import (
    CheckpointingException,
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
)
from megatron.core.dist_checkpointing import storage as ckpt_storage
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import (
    apply_prefix_mapping,
    extract_sharded_tensors,
    replace_prefix_for_sharding,
)
from megatron.core.dist_checkpointing.validation import StrictHandling

pytestmark = [pytest.mark.world(1), pytest.mark.timeout(60)]

WEIGHT = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7


def _halves_factory(key: str, tensor: torch.Tensor) -> ShardedTensorFactory:
    """Rows [0, 2) and [2, 4) stored as two tensors ``key.top`` and ``key.bottom``."""

    def build(key, data, replica_id, flattened_range):
        top, bottom = data.chunk(2)
        return {
            "top": ShardedTensor.from_rank_offsets(f"{key}.top", top, replica_id=replica_id),
            "bottom": ShardedTensor.from_rank_offsets(f"{key}.bottom", bottom),
        }

    return ShardedTensorFactory(key, tensor, build, lambda d: torch.cat([d["top"], d["bottom"]]))


def _state(weight=WEIGHT, stack=None):
    stack = torch.ones(2, 3) if stack is None else stack
    return {
        "model": {
            "w": ShardedTensor.from_rank_offsets("w", weight),
            "layers": [
                ShardedTensor.from_rank_offsets(
                    "stack", stack[i].clone(), (0, i, 2), prepend_axis_num=1
                )
                for i in range(2)
            ],
            "fused": _halves_factory("fused", weight * 2),
            "extra": ShardedObject("extra", {"step": torch.tensor(3)}, (1,), (0,)),
        },
        "iteration": 11,
        "args": {"lr": 0.5, "name": "run"},
        "local": LocalNonpersistentObject("not saved"),
    }


def test_round_trip_returns_the_request_structure_with_saved_values(tmp_path):
    stack = torch.randn(2, 3)
    dist_checkpointing.save(_state(stack=stack), str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [
        ".metadata",
        "__0_0.distcp",
        "checksums.json",
        "common.pt",
        "metadata.json",
    ]
    loaded = dist_checkpointing.load(
        _state(weight=torch.zeros(4, 6), stack=torch.zeros(2, 3)), str(tmp_path)
    )
    assert torch.equal(loaded["model"]["w"], WEIGHT)
    assert torch.equal(torch.stack(loaded["model"]["layers"]), stack)
    assert torch.equal(loaded["model"]["fused"], WEIGHT * 2)
    assert torch.equal(loaded["model"]["extra"]["step"], torch.tensor(3))
    assert loaded["iteration"] == 11 and loaded["args"] == {"lr": 0.5, "name": "run"}
    assert loaded["local"] == "not saved"
    assert dist_checkpointing.load_common_state_dict(str(tmp_path)) == {
        "iteration": 11,
        "args": {"lr": 0.5, "name": "run"},
    }
    assert dist_checkpointing.check_is_distributed_checkpoint(str(tmp_path))
    plain = dist_checkpointing.load_plain_tensors(str(tmp_path))
    assert torch.equal(plain["stack"], stack)
    assert torch.equal(plain["fused.top"], WEIGHT[:2] * 2)


def test_loaded_tensors_take_the_requested_dtype(tmp_path):
    weight = torch.randn(4, 6, dtype=torch.bfloat16)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight)}, str(tmp_path))
    loaded = dist_checkpointing.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6))}, str(tmp_path)
    )
    assert loaded["w"].dtype == torch.float32 and torch.equal(loaded["w"], weight.float())


def test_prefix_helpers_rename_storage_keys_only():
    state = _state()
    replace_prefix_for_sharding(state["model"]["layers"], "stack", "decoder.stack")
    assert [t.key for t in state["model"]["layers"]] == ["decoder.stack"] * 2
    apply_prefix_mapping(state, {"w": "model.w", "nope": "x"})
    assert state["model"]["w"].key == "model.w"
    with pytest.raises(ValueError, match="does not start with old_prefix 'zzz'"):
        replace_prefix_for_sharding(state, "zzz", "a")
    tensors, rest = extract_sharded_tensors(state)
    assert "w" in tensors["model"] and rest["iteration"] == 11


class _Payload:
    """Unpickling this would create a marker file: proof that a loader ran pickled code."""

    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _printed(error: BaseException) -> str:
    """What a user sees: the error with its whole chain of causes, as a traceback prints it."""
    return "".join(traceback.format_exception(error))


# torch's advice in a weights-only refusal; following it would run the payload.
UNSAFE_ADVICE = ("weights_only=False", "set to `False`", "safe_globals", "trust")


def _assert_no_unsafe_advice(error: BaseException) -> None:
    printed = _printed(error)
    assert not [a for a in UNSAFE_ADVICE if a in printed], printed


def _reseal(directory: Path) -> None:
    """Record the checksums of the files as they are now (what a writer that changed them
    on purpose would do), so that the refusal tested is the unpickler's, not the CRC's."""
    (directory / "checksums.json").unlink()
    metadata = ckpt_storage.read_metadata(directory)
    items = ckpt_storage.item_checksums(directory, list(metadata.storage_data.values()))
    files = {
        name: zlib.crc32((directory / name).read_bytes()) for name in ("common.pt", ".metadata")
    }
    ckpt_storage.write_checksums(directory, items, files)


def test_common_state_that_needs_unpickling_is_refused_without_running_it(tmp_path):
    dist_checkpointing.save(_state(), str(tmp_path))
    marker = tmp_path / "pwned"
    _Payload.marker = str(marker)
    torch.save({"iteration": 11, "evil": _Payload()}, tmp_path / "common.pt")
    with pytest.raises(CheckpointingException, match="common.pt: checksum mismatch"):
        dist_checkpointing.load(_state(), str(tmp_path))
    _reseal(tmp_path)
    with pytest.raises(CheckpointingException, match="holds a pickled object") as refused:
        dist_checkpointing.load(_state(), str(tmp_path))
    _assert_no_unsafe_advice(refused.value)
    with pytest.raises(CheckpointingException, match="never unpickles arbitrary objects") as err:
        dist_checkpointing.load_common_state_dict(str(tmp_path))
    _assert_no_unsafe_advice(err.value)
    assert not marker.exists()


def test_dcp_metadata_with_foreign_classes_is_refused_without_running_it(tmp_path):
    dist_checkpointing.save(_state(), str(tmp_path))
    marker = tmp_path / "pwned"
    _Payload.marker = str(marker)
    metadata = ckpt_storage.read_metadata(tmp_path)
    metadata.planner_data = _Payload()
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CheckpointingException, match=r"\.metadata: checksum mismatch"):
        dist_checkpointing.load(_state(), str(tmp_path))
    (tmp_path / "checksums.json").unlink()  # as another writer's checkpoint: no checksums
    with pytest.raises(CheckpointingException, match="refusing to unpickle it"):
        dist_checkpointing.load(_state(), str(tmp_path))
    assert not marker.exists()


def test_a_tensor_item_holding_a_pickle_is_refused_without_running_it(tmp_path):
    """A tensor's stored bytes replaced by torch.save of an object whose unpickling runs
    code: refused, naming the file and the refused global, without torch's advice to load
    with weights_only=False."""
    weight = {"w": ShardedTensor.from_rank_offsets("w", WEIGHT.clone())}
    dist_checkpointing.save(weight, str(tmp_path))
    marker = tmp_path / "pwned"
    _Payload.marker = str(marker)
    evil = io.BytesIO()
    torch.save(_Payload(), evil)
    shard = tmp_path / "__0_0.distcp"
    shard.write_bytes(evil.getvalue())
    metadata = ckpt_storage.read_metadata(tmp_path)
    info = next(iter(metadata.storage_data.values()))
    info.offset, info.length = 0, len(evil.getvalue())
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    _reseal(tmp_path)
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6))}
    with pytest.raises(CheckpointingException, match="__0_0.distcp: tensor 'w'.*pickled") as err:
        dist_checkpointing.load(request, str(tmp_path))
    _assert_no_unsafe_advice(err.value)
    assert "_Payload" in str(err.value) or "open" in str(err.value), err.value
    assert not marker.exists()


def test_sharded_object_that_needs_unpickling_is_refused_on_save_and_on_load(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    _Payload.marker = str(marker)
    evil = {"extra": ShardedObject("extra", {"step": _Payload()}, (1,), (0,))}
    with pytest.raises(CheckpointingException, match="ShardedObject 'extra/shard_0_1'"):
        dist_checkpointing.save(evil, str(tmp_path))
    refused = tmp_path / "refused"
    refused.mkdir()
    with pytest.raises(CheckpointingException, match="common \\(non-sharded\\) state"):
        dist_checkpointing.save({"args": _Payload()}, str(refused))
    assert list(refused.iterdir()) == [], "a refused save wrote files"

    # a checkpoint written by a writer without that check (plain torch.save of the object)
    def unchecked(obj, what):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()

    monkeypatch.setattr(ckpt_storage, "serialize_checked", unchecked)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    dist_checkpointing.save(evil, str(foreign))
    request = {"extra": ShardedObject("extra", None, (1,), (0,))}
    with pytest.raises(
        CheckpointingException, match=r"__0_0.distcp: checkpoint object 'extra/shard_0_1'"
    ) as err:
        dist_checkpointing.load(request, str(foreign))
    _assert_no_unsafe_advice(err.value)
    assert not marker.exists()


def test_an_incomplete_directory_is_refused(tmp_path):
    with pytest.raises(CheckpointingException, match="metadata.json is missing .*empty"):
        dist_checkpointing.load(_state(), str(tmp_path))
    dist_checkpointing.save(_state(), str(tmp_path))
    (tmp_path / "metadata.json").unlink()
    with pytest.raises(CheckpointingException, match="not a complete distributed checkpoint"):
        dist_checkpointing.load(_state(), str(tmp_path))
    with pytest.raises(CheckpointingException, match="not a complete distributed checkpoint"):
        dist_checkpointing.load_common_state_dict(str(tmp_path))
    assert not dist_checkpointing.check_is_distributed_checkpoint(str(tmp_path))


def test_a_save_failing_part_way_leaves_no_loadable_checkpoint(tmp_path, monkeypatch):
    """Overwriting a complete checkpoint: the old marker goes before anything is written,
    so a save that dies while writing is refused instead of mixing old and new files."""
    dist_checkpointing.save(_state(), str(tmp_path))

    def dies_while_writing(checkpoint_dir, boxes, objects):
        (Path(checkpoint_dir) / "__0_0.distcp").write_bytes(b"half a file")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(ckpt_storage, "write_pieces", dies_while_writing)
    with pytest.raises(KeyboardInterrupt):
        dist_checkpointing.save(_state(weight=WEIGHT + 1), str(tmp_path))
    with pytest.raises(CheckpointingException, match="interrupted"):
        dist_checkpointing.load(_state(), str(tmp_path))


def test_a_missing_directory_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointingException, match=f"checkpoint_dir='{missing}'.*not an exist"):
        dist_checkpointing.save(_state(), str(missing))
    with pytest.raises(CheckpointingException, match=f"checkpoint_dir='{missing}'.*not an exist"):
        dist_checkpointing.load(_state(), str(missing))


def test_mismatched_global_shape_is_named_with_both_shapes(tmp_path):
    dist_checkpointing.save(_state(), str(tmp_path))
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(5, 6))}
    with pytest.raises(CheckpointingException, match=r"'w'.*\(4, 6\).*\(5, 6\)"):
        dist_checkpointing.load(request, str(tmp_path))
    padded = ShardedTensor.from_rank_offsets(
        "w", torch.full((5, 6), -1.0), allow_shape_mismatch=True
    )
    loaded = dist_checkpointing.load({"w": padded}, str(tmp_path))["w"]
    assert torch.equal(loaded[:4], WEIGHT) and torch.equal(loaded[4], torch.full((6,), -1.0))


def test_unknown_keys_follow_the_strict_mode(tmp_path):
    dist_checkpointing.save(_state(), str(tmp_path))
    extra = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6))}
    extra["ghost"] = ShardedTensor.from_rank_offsets("ghost", torch.zeros(2))
    with pytest.raises(CheckpointingException, match="the checkpoint has no 'ghost'"):
        dist_checkpointing.load(dict(extra), str(tmp_path))
    with pytest.raises(CheckpointingException, match="unexpected keys .*'ghost'"):
        dist_checkpointing.load(dict(extra), str(tmp_path), strict="raise_unexpected")
    with pytest.raises(CheckpointingException, match="missing .*'stack'.*unexpected.*'ghost'"):
        dist_checkpointing.load(dict(extra), str(tmp_path), strict=StrictHandling.RAISE_ALL)
    loaded, missing, unexpected = dist_checkpointing.load(
        dict(extra), str(tmp_path), strict="return_all"
    )
    assert "ghost" not in loaded and torch.equal(loaded["w"], WEIGHT)
    assert unexpected == {"ghost"} and {"stack", "fused.top", "extra/shard_0_1"} <= missing
    assert "ghost" not in dist_checkpointing.load(dict(extra), str(tmp_path), strict="ignore_all")
    with pytest.raises(CheckpointingException, match="strict='sometimes'.*expected one of"):
        dist_checkpointing.load(dict(extra), str(tmp_path), strict="sometimes")


def test_a_factory_missing_a_piece_is_skipped_whole(tmp_path):
    """With a lenient ``strict``, a factory whose pieces the checkpoint lacks (all, or one:
    ``ghost.bottom``) is left out of the result and its keys returned as unexpected (before:
    its merge raised a KeyError on the missing piece)."""
    state = _state()
    state["ghost"] = ShardedTensor.from_rank_offsets("ghost.top", torch.ones(2, 6))
    dist_checkpointing.save(state, str(tmp_path))
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6))}
    request["ghost"] = _halves_factory("ghost", torch.zeros(4, 6))
    request["absent"] = _halves_factory("absent", torch.zeros(4, 6))
    loaded, _, unexpected = dist_checkpointing.load(request, str(tmp_path), strict="return_all")
    assert not {"ghost", "absent"} & set(loaded) and torch.equal(loaded["w"], WEIGHT)
    assert unexpected == {"ghost.bottom", "absent.top", "absent.bottom"}


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda d: dist_checkpointing.save({}, d, sharded_strategy=("zarr", 1)), "zarr"),
        (lambda d: dist_checkpointing.save({}, d, common_strategy=object()), "common_strategy="),
        (lambda d: dist_checkpointing.save({}, d, async_sharded_save=True), "async_sharded_save"),
        (lambda d: dist_checkpointing.load({}, d, sharded_strategy="x"), "sharded_strategy='x'"),
    ],
    ids=["zarr-strategy", "common-strategy-object", "async-save", "load-strategy-string"],
)
def test_unsupported_options_are_refused(tmp_path, call, message):
    with pytest.raises(CheckpointingException, match=message):
        call(str(tmp_path))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ShardedTensor.from_rank_offsets("k", torch.zeros(2), (0, 2, 2)), "0 <= axis_rank"),
        (lambda: ShardedTensor.from_rank_offsets("k", torch.zeros(2), (1, 0, 2)), "axis 1"),
        (lambda: ShardedTensor.from_rank_offsets("k", [1, 2]), "must be a torch.Tensor, got list"),
        (
            lambda: ShardedTensor.from_rank_offsets("k", torch.zeros(2), flattened_range=slice(1)),
            "flattened_range",
        ),
        (
            lambda: ShardedTensor("k", torch.zeros(3), torch.float32, (3,), (4,), (2,), None),
            "does not fit",
        ),
        (lambda: ShardedObject("k", 1, (2,), (2,)), "outside global_shape"),
    ],
    ids=["rank-beyond-count", "axis-out-of-range", "not-a-tensor", "flattened", "box", "object"],
)
def test_impossible_pieces_are_rejected_when_built(make, message):
    with pytest.raises(CheckpointingException, match=message):
        make()


def _flip_one_byte_of(path: Path, needle: bytes) -> None:
    """Flip the high bit of a byte inside the first occurrence of ``needle`` in ``path``."""
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at >= 0, f"{needle!r} not found in {path}"
    data[at + len(needle) // 2] ^= 0x80
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_shard_data_is_an_error_naming_the_file(tmp_path, monkeypatch):
    """One byte of the stored tensor data flipped: load refuses, naming the shard file. The
    negative control loads the same damaged file with the checksum check switched off and
    gets wrong values silently: the check is what catches it."""
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight)}, str(tmp_path))
    shard = tmp_path / "__0_0.distcp"
    _flip_one_byte_of(shard, weight.numpy().tobytes())
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64, 32))}
    with pytest.raises(CheckpointingException, match=f"{shard}: item 'w'.*checksum mismatch"):
        dist_checkpointing.load(request, str(tmp_path))

    monkeypatch.setattr(ckpt_storage, "read_checksums", lambda directory: None)
    loaded = dist_checkpointing.load(request, str(tmp_path))["w"]
    changed = (loaded != weight).sum().item()
    assert changed == 1, f"without the check one value is silently wrong; {changed} differ"


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.write_text(""), "metadata.json: empty"),
        (lambda p: p.write_text(p.read_text()[:7]), "metadata.json: not valid JSON"),
        (lambda p: p.write_text("[1, 2]"), r"metadata.json: holds \[1, 2\]"),
    ],
    ids=["empty", "truncated", "not-an-object"],
)
def test_a_damaged_metadata_json_is_named(tmp_path, damage, message):
    dist_checkpointing.save(_state(), str(tmp_path))
    damage(tmp_path / "metadata.json")
    for call in (
        lambda: dist_checkpointing.load(_state(), str(tmp_path)),
        lambda: dist_checkpointing.load_common_state_dict(str(tmp_path)),
        lambda: dist_checkpointing.check_is_distributed_checkpoint(str(tmp_path)),
    ):
        with pytest.raises(CheckpointingException, match=message):
            call()


def test_a_damaged_checksums_file_is_named(tmp_path):
    dist_checkpointing.save(_state(), str(tmp_path))
    sums = tmp_path / "checksums.json"
    record = sums.read_text()
    sums.write_text(record[: len(record) // 2])
    with pytest.raises(CheckpointingException, match="checksums.json: damaged"):
        dist_checkpointing.load(_state(), str(tmp_path))
    digit = next(i for i, c in enumerate(record) if c.isdigit() and i > record.find('"items"'))
    sums.write_text(record[:digit] + str((int(record[digit]) + 1) % 10) + record[digit + 1 :])
    with pytest.raises(CheckpointingException, match="checksums.json: its content does not"):
        dist_checkpointing.load(_state(), str(tmp_path))


def test_a_truncated_shard_file_is_named(tmp_path):
    dist_checkpointing.save(_state(), str(tmp_path))
    shard = tmp_path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointingException, match=f"{shard}: item .*truncated"):
        dist_checkpointing.load(_state(), str(tmp_path))
