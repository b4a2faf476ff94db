"""The sharded pieces on disk, through ``torch.distributed.checkpoint`` (DCP).

Every main replica of a ``ShardedTensor`` is one DCP chunk (offsets = ``global_offset``,
sizes = ``local_shape``) of the DCP tensor ``key`` of size ``global_shape``; every main
replica of a ``ShardedObject`` is one DCP byte entry ``unique_key`` holding ``torch.save`` of
``[data]`` (megatron-core's torch_dist form, so that megatron-core reads it; ``checksums.json``
says so with ``"object_form": "list"``; a checkpoint of this package without it holds
``torch.save`` of the bare data, read as such). DCP writes one ``__<rank>_0.distcp`` file per
rank and a ``.metadata`` file; resharding is DCP's: a rank asks for its box and DCP reads the
overlapping parts of whatever chunks were saved.

What is ours (DCP's default planners take whole tensors, DTensors or torch ShardedTensors,
none of which expresses "this box of that global tensor, possibly several boxes of one key
per rank"): two small planners that speak in boxes, and safe reading. DCP pickles its
``.metadata``; we read it with an unpickler that admits only DCP's metadata classes (and the
save-plan classes that megatron-core's planner stores there), torch dtypes/sizes/layouts and
paths. DCP reads tensor data with ``torch.load(weights_only=True)`` already; byte entries we
load with ``weights_only=True`` as well. Nothing else is unpickled.

Integrity: after writing, each rank reads back the items of its own file (from the page
cache) and records a CRC-32 of each item's stored bytes; ``save`` keeps them, with the CRC-32
of ``common.pt`` and ``.metadata``, in ``checksums.json``. Our reader reads each item's bytes
itself, checks the CRC before unpickling anything, and names the file on a mismatch.
"""

import argparse
import contextlib
import dataclasses
import inspect
import io
import json
import os
import pickle
import warnings
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from megatron.core.dist_checkpointing.core import CheckpointingException, _fsync_dir

DCP_METADATA_FNAME = ".metadata"
CHECKSUMS_FNAME = "checksums.json"
CHECKSUM_ALGORITHM = "crc32"
# How a ShardedObject's data is stored (module docstring): in a one-element list, as
# megatron-core does; recorded in checksums.json (absent: this package's older bare form).
OBJECT_FORM = "list"

# {file name: {str(offset): [length, crc32]}}: the stored bytes of each DCP item
ItemChecksums = Dict[str, Dict[str, List[int]]]


@dataclasses.dataclass
class TensorBox:
    """One box of the global tensor ``fqn``: ``tensor`` has the box's full shape (prepended
    axes included); ``offset`` is its corner in the global tensor of ``global_shape``."""

    fqn: str
    tensor: torch.Tensor
    global_shape: Tuple[int, ...]
    offset: Tuple[int, ...]


def write_pieces(
    checkpoint_dir: Path, boxes: Sequence[TensorBox], objects: Dict[str, bytes]
) -> ItemChecksums:
    """Collective: DCP-save this rank's main-replica ``boxes`` and serialized ``objects``;
    returns the CRC-32 of the stored bytes of each item this rank wrote (read back)."""
    planner = _BoxSavePlanner(boxes, objects)
    options = {"single_file_per_rank": True, "sync_files": True}
    if "overwrite" in inspect.signature(FileSystemWriter.__init__).parameters:
        options["overwrite"] = True  # save() has already retired the old checkpoint's marker
    writer = _RecordingWriter(str(checkpoint_dir), **options)
    with _quiet_single_process(), _plain_errors("save"):
        dcp.save({}, storage_writer=writer, planner=planner, no_dist=not _distributed())
    written = [result.storage_data for result in writer.results]
    return item_checksums(checkpoint_dir, written)


class _RecordingWriter(FileSystemWriter):
    """``FileSystemWriter`` keeping this rank's write results (where each item it wrote
    lies; every rank writes its own plan): the metadata ``dcp.save`` returns carries them
    only in some torch versions (2.11 returned it without ``storage_data`` on one CUDA
    process)."""

    results: Sequence[Any] = ()

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        future.add_done_callback(lambda done: setattr(self, "results", done.value()))
        return future


def item_checksums(checkpoint_dir: Path, infos: Sequence[Any]) -> ItemChecksums:
    """CRC-32 of the bytes ``[offset, offset + length)`` of each DCP storage item ``infos``
    (``relative_path``, ``offset``, ``length``), read in file order."""
    out: ItemChecksums = {}
    by_file: Dict[str, list] = {}
    for info in infos:
        by_file.setdefault(info.relative_path, []).append(info)
    for name, entries in by_file.items():
        sums = out.setdefault(name, {})
        with open(Path(checkpoint_dir) / name, "rb") as f:
            for info in sorted(entries, key=lambda i: i.offset):
                f.seek(info.offset)
                sums[str(info.offset)] = [info.length, zlib.crc32(f.read(info.length))]
    return out


def write_checksums(checkpoint_dir: Path, items: ItemChecksums, files: Dict[str, int]) -> None:
    """Write ``checksums.json`` atomically: the CRC-32 of whole ``files`` and of every DCP
    item, and a CRC-32 of that content itself (so a damaged entry is not taken for a
    damaged shard)."""
    body = {
        "algorithm": CHECKSUM_ALGORITHM,
        "files": files,
        "items": items,
        "object_form": OBJECT_FORM,
    }
    record = dict(body, self_crc32=zlib.crc32(_canonical(body)))
    path = Path(checkpoint_dir) / CHECKSUMS_FNAME
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_checksums(checkpoint_dir: Path) -> Optional[dict]:
    """The checkpoint's ``checksums.json`` (None when it has none: another writer's
    checkpoint); a clear error naming the file when it is damaged. The self CRC-32 covers
    every field but itself, whichever the writer had (``object_form`` came later; a later
    version's fields verify too). An ``object_form`` this version does not know (a later
    version's) is refused by name rather than read as another form."""
    path = Path(checkpoint_dir) / CHECKSUMS_FNAME
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_bytes())
        body = {k: v for k, v in record.items() if k != "self_crc32"}
        missing = [k for k in ("algorithm", "files", "items", "self_crc32") if k not in record]
        if missing:
            raise KeyError(", ".join(missing))
        intact = record["self_crc32"] == zlib.crc32(_canonical(body))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointingException(
            f"{path}: damaged ({type(err).__name__}: {err}); expected the JSON object with "
            "'algorithm', 'files', 'items', 'self_crc32' that save writes"
        ) from None
    if not intact:
        raise CheckpointingException(
            f"{path}: its content does not match its own CRC-32 (self_crc32); the file is "
            "damaged, so the checkpoint cannot be verified"
        )
    if body["algorithm"] != CHECKSUM_ALGORITHM:
        raise CheckpointingException(
            f"{path}: algorithm {body['algorithm']!r}; expected {CHECKSUM_ALGORITHM!r}"
        )
    if body.get("object_form", OBJECT_FORM) != OBJECT_FORM:
        raise CheckpointingException(
            f"{path}: object_form {body['object_form']!r}, written by a later version of "
            f"this package; this one reads {OBJECT_FORM!r} (or none: its older checkpoints): "
            "load it with the version that saved it"
        )
    return body


def verify_bytes(
    checkpoint_dir: Path, name: str, payload: bytes, checksums: Optional[dict]
) -> None:
    """Check a whole file's bytes against its recorded CRC-32 (no-op without checksums)."""
    if checksums is None:
        return
    expected = checksums["files"].get(name)
    if expected is None:
        raise CheckpointingException(
            f"{Path(checkpoint_dir) / name}: {CHECKSUMS_FNAME} records no checksum for it"
        )
    actual = zlib.crc32(payload)
    if actual != expected:
        raise CheckpointingException(
            f"{Path(checkpoint_dir) / name}: checksum mismatch (CRC-32 {actual:#010x}, "
            f"{expected:#010x} when saved): the file was damaged or changed after the save"
        )


def read_metadata(checkpoint_dir: Path) -> Metadata:
    """DCP's metadata of the checkpoint (checksum verified), read without unpickling
    anything but its own types."""
    return SafeFileSystemReader(str(checkpoint_dir)).read_metadata()


def read_pieces(
    checkpoint_dir: Path, boxes: Sequence[TensorBox], object_keys: Sequence[str]
) -> Dict[str, Any]:
    """Collective: fill ``boxes`` (the overlap with what was saved) and return the objects
    stored under ``object_keys``, each loaded with ``torch.load(weights_only=True)`` (its
    data: ``objects_listed``)."""
    planner = _BoxLoadPlanner(boxes, object_keys)
    reader = SafeFileSystemReader(str(checkpoint_dir))
    with _quiet_single_process(), _plain_errors("load"):
        dcp.load({}, storage_reader=reader, planner=planner, no_dist=not _distributed())
    if not objects_listed(reader.checksums):
        return planner.loaded_objects
    return {k: _unlisted(checkpoint_dir, k, v) for k, v in planner.loaded_objects.items()}


def _unlisted(checkpoint_dir: Path, key: str, stored: Any) -> Any:
    """The data of a ShardedObject stored in megatron-core's form, ``[data]``."""
    if not isinstance(stored, list) or len(stored) != 1:
        size = f" of {len(stored)}" if isinstance(stored, list) else ""
        raise CheckpointingException(
            f"{checkpoint_dir}: checkpoint object {key!r}: expected megatron-core's form, a "
            f"list of one object; got {type(stored).__name__}{size}"
        )
    return stored[0]


def safe_load_bytes(buffer: io.BytesIO, what: str) -> Any:
    """``torch.load(weights_only=True)``; a clear refusal when the payload needs more.

    The refusal keeps only the unpickler's reason (the refused global); torch's advice to
    retry with ``weights_only=False``, which would run the payload, is not passed on."""
    try:
        return torch.load(buffer, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise _refusal(what, _unpickler_reason(err)) from None
    except (RuntimeError, EOFError, ValueError) as err:
        raise CheckpointingException(
            f"{what}: not a readable torch.save payload ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''})"
        ) from None


def load_common_bytes(payload: bytes, what: str) -> Any:
    """``common.pt``'s state (``safe_load_bytes``), also when written by Megatron-LM's
    trainer, whose common state holds ``args``: an ``argparse.Namespace`` with megatron
    enums (``AttnBackend``, ``ModelType``, ...) in it. Those are admitted, and only those: the
    namespace as itself (a plain record of attributes), each ``megatron.*`` global as a
    ``SavedValue`` naming it (nothing of megatron is imported or run). Any other global is
    refused as ``safe_load_bytes`` refuses it."""
    try:
        return safe_load_bytes(io.BytesIO(payload), what)
    except CheckpointingException:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(payload))
        refused = [name for name in names if not _admitted_in_args(name)]
        if not names:
            raise
        if refused:
            raise _refusal(what, "globals " + ", ".join(refused)) from None
    admitted = [argparse.Namespace] + [
        (_saved_value_class(name), name) for name in names if name.startswith("megatron.")
    ]
    with torch.serialization.safe_globals(admitted):
        return safe_load_bytes(io.BytesIO(payload), what)


class SavedValue:
    """A value of a megatron class in a Megatron-LM trainer's ``args`` (an enum member,
    mostly), kept as its class's name and the arguments it was pickled with."""

    qualified_name = "megatron"

    def __init__(self, *arguments: Any) -> None:
        self.arguments = arguments

    def __repr__(self) -> str:
        return f"{self.qualified_name}{self.arguments!r}"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, SavedValue) and (self.qualified_name, self.arguments) == (
            other.qualified_name,
            other.arguments,
        )


def _saved_value_class(name: str) -> type:
    return type(name.rsplit(".", 1)[-1], (SavedValue,), {"qualified_name": name})


def _admitted_in_args(name: str) -> bool:
    return name == "argparse.Namespace" or name.startswith("megatron.")


def _refusal(what: str, reason: str) -> CheckpointingException:
    return CheckpointingException(
        f"{what}: refused, it holds a pickled object that loading would have to run "
        f"({reason}). This loader never unpickles arbitrary objects "
        "(torch.load(weights_only=True) only); save tensors, numbers, strings, and "
        "lists/tuples/dicts of these instead"
    )


def _unpickler_reason(err: Exception) -> str:
    """The sentence of torch's weights-only error that says what was refused, without its
    advice to load with ``weights_only`` False or to allowlist the refused global (either
    would run the payload)."""
    for line in str(err).splitlines():
        line = line.strip()
        if line.startswith("WeightsUnpickler error:"):
            reason = line[len("WeightsUnpickler error:") :].strip()
            return reason.split(". ")[0].rstrip(".")
    return "a type outside the tensors, numbers, strings and containers it admits"


def objects_listed(checksums: Optional[dict]) -> bool:
    """Whether the checkpoint of these ``checksums`` stores each ShardedObject's data in a
    one-element list (megatron-core's form: its checkpoints, which have no checksums, and
    ours since ``OBJECT_FORM``), not bare (this package's older checkpoints)."""
    return checksums is None or checksums.get("object_form") == OBJECT_FORM


def serialize_checked(obj: Any, what: str) -> bytes:
    """``torch.save`` bytes of ``obj``, after checking that ``safe_load_bytes`` can read them
    back (so that ``save`` never writes what ``load`` would refuse)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = buffer.getvalue()
    try:
        torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointingException(
            f"{what}: cannot be saved, loading it would need objects that "
            f"torch.load(weights_only=True) refuses ({reason}); got {_type_name(obj)}. "
            "Save tensors, numbers, strings, and lists/tuples/dicts of these"
        ) from err
    return payload


def _type_name(obj: Any) -> str:
    """``obj``'s type; a one-element list (a ShardedObject's stored form) with its item's."""
    if isinstance(obj, list) and len(obj) == 1:
        return f"list of {type(obj[0]).__name__}"
    return type(obj).__name__


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read by ``_MetadataUnpickler`` and item data read
    by ``read_data`` below: each item's bytes checked against ``checksums.json`` (when the
    checkpoint has one) before ``torch.load(weights_only=True)``."""

    def __init__(self, path: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.checksums = read_checksums(Path(str(path)))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(str(self.path)) / DCP_METADATA_FNAME
        if not path.exists():
            raise CheckpointingException(
                f"{path.parent}: DCP metadata file {DCP_METADATA_FNAME!r} is missing; the "
                "checkpoint is incomplete or not a torch.distributed.checkpoint checkpoint"
            )
        payload = path.read_bytes()
        verify_bytes(path.parent, DCP_METADATA_FNAME, payload, self.checksums)
        try:
            metadata = _MetadataUnpickler(io.BytesIO(payload), path).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
            raise CheckpointingException(
                f"{path}: not readable DCP metadata ({type(err).__name__}: {err})"
            ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointingException(
                f"{path}: expected DCP Metadata, found {type(metadata).__name__}"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        if hasattr(self, "load_id"):
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: Any) -> Future:
        """Read each planned item's stored bytes, check their CRC-32, then load them with
        ``torch.load(weights_only=True)`` into the planner's destination (DCP's reader
        does the same without the check)."""
        root = Path(str(self.path))
        per_file: Dict[str, List[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for name, items in per_file.items():
            path = root / name
            if not path.exists():
                raise CheckpointingException(f"{path}: missing; the DCP metadata names it")
            with open(path, "rb") as f:
                verified: Dict[int, bytes] = {}
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    info = self.storage_data[item.storage_index]
                    if info.offset not in verified:
                        verified = {info.offset: self._item_bytes(f, path, info, item)}
                    self._deliver(item, verified[info.offset], path, planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _item_bytes(self, f, path: Path, info: Any, item: ReadItem) -> bytes:
        what = f"{path}: item {item.storage_index.fqn!r} at bytes {info.offset}"
        if getattr(info, "transform_descriptors", None):
            raise CheckpointingException(
                f"{what}: stored with transforms {list(info.transform_descriptors)}, which "
                "this loader does not apply"
            )
        f.seek(info.offset)
        payload = f.read(info.length)
        if len(payload) != info.length:
            raise CheckpointingException(
                f"{what}: the file ends after {len(payload)} of the item's {info.length} bytes "
                "(truncated)"
            )
        if self.checksums is not None:
            expected = self.checksums["items"].get(path.name, {}).get(str(info.offset))
            if expected is None or expected[0] != info.length:
                raise CheckpointingException(
                    f"{what}: {CHECKSUMS_FNAME} records no checksum for this item; it does not "
                    "belong to this checkpoint's files"
                )
            actual = zlib.crc32(payload)
            if actual != expected[1]:
                raise CheckpointingException(
                    f"{what}: checksum mismatch (CRC-32 {actual:#010x}, {expected[1]:#010x} "
                    "when saved): the shard file was damaged or changed after the save"
                )
        return payload

    @staticmethod
    def _deliver(item: ReadItem, payload: bytes, path: Path, planner: Any) -> None:
        if item.type == LoadItemType.BYTE_IO:
            try:
                planner.load_bytes(item, io.BytesIO(payload))
            except CheckpointingException as err:
                raise CheckpointingException(f"{path}: {err}") from None
            return
        what = f"{path}: tensor {item.storage_index.fqn!r}"
        tensor = safe_load_bytes(io.BytesIO(payload), what)
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointingException(
                f"{what}: the stored item holds a {type(tensor).__name__}, not a tensor"
            )
        tensor = _narrow_exact(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointingException(
                f"{what}: read {tuple(tensor.size())} for a destination of "
                f"{tuple(target.size())}; the DCP metadata does not match the data"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)


_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
# megatron-core's planner keeps every rank's save plan in the metadata (all_local_plans)
_METADATA_CLASSES |= {
    ("torch.distributed.checkpoint.planner", name)
    for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch dtypes and the few helpers they pickle with."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointingException(
            f"{self._path}: the DCP metadata refers to {module}.{name}, which is not one of "
            "the metadata types this loader admits; refusing to unpickle it"
        )

    def persistent_load(self, pid):
        raise CheckpointingException(f"{self._path}: unexpected persistent id in DCP metadata")


class _BoxSavePlanner(DefaultSavePlanner):
    """Writes given boxes and byte entries; the global plan, its validation (no overlaps,
    chunks inside the tensor) and the metadata are DCP's."""

    def __init__(self, boxes: Sequence[TensorBox], objects: Dict[str, bytes]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._boxes = {(b.fqn, tuple(b.offset)): b for b in boxes}
        self._objects = objects

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False):
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for (fqn, offset), box in self._boxes.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=box.tensor.size())
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offset)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk,
                        properties=TensorProperties.create_from_tensor(box.tensor),
                        size=torch.Size(box.global_shape),
                    ),
                )
            )
        for fqn in self._objects:
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        fqn = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._objects[fqn])
        return self._boxes[(fqn, tuple(write_item.index.offset))].tensor.detach()


class _BoxLoadPlanner(DefaultLoadPlanner):
    """Reads the overlap of each requested box with the saved chunks, and byte entries."""

    def __init__(self, boxes: Sequence[TensorBox], object_keys: Sequence[str]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._boxes = list(boxes)
        self._object_keys = list(object_keys)
        self.loaded_objects: Dict[str, Any] = {}

    def set_up_planner(self, state_dict, metadata: Optional[Metadata] = None, is_coordinator=False):
        self.state_dict = {}
        self.original_state_dict = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        requests: List[ReadItem] = []
        for i, box in enumerate(self._boxes):
            chunk = ChunkStorageMetadata(offsets=torch.Size(box.offset), sizes=box.tensor.size())
            for item in create_read_items_for_chunk_list(box.fqn, stored[box.fqn], [chunk]):
                # the box's position in our list identifies the destination uniquely
                dest = MetadataIndex(box.fqn, item.dest_index.offset, i)
                requests.append(dataclasses.replace(item, dest_index=dest))
        for fqn in self._object_keys:
            requests.append(
                ReadItem(
                    type=LoadItemType.BYTE_IO,
                    dest_index=MetadataIndex(fqn),
                    dest_offsets=torch.Size((0,)),
                    storage_index=MetadataIndex(fqn),
                    storage_offsets=torch.Size((0,)),
                    lengths=torch.Size((0,)),
                )
            )
        return LoadPlan(requests)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        self.loaded_objects[fqn] = safe_load_bytes(value, f"checkpoint object {fqn!r}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        box = self._boxes[read_item.dest_index.index]
        return _narrow(box.tensor, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def stored_tensor_shapes(metadata: Metadata) -> Dict[str, Tuple[int, ...]]:
    """{key: global shape} of the tensors in a checkpoint."""
    return {
        k: tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


def stored_object_keys(metadata: Metadata) -> List[str]:
    """The byte entries (ShardedObjects) of a checkpoint."""
    return [
        k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
    ]


def stored_dtype(metadata: Metadata, key: str) -> torch.dtype:
    """The dtype a tensor was saved in."""
    return metadata.state_dict_metadata[key].properties.dtype


@contextlib.contextmanager
def _quiet_single_process():
    """Without torch.distributed DCP warns on every call that it assumes one process; that
    is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def _plain_errors(what: str):
    """DCP gathers every rank's exception into one ``CheckpointException`` (a
    BaseException); turn it into a ``CheckpointingException`` carrying each rank's message,
    on every rank."""
    try:
        yield
    except CheckpointException as err:
        ranks_by_message: Dict[str, List[int]] = {}
        for rank, (exc, _) in sorted(err.failures.items()):
            ranks_by_message.setdefault(str(exc), []).append(rank)
        messages = [
            f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {message}"
            for message, ranks in ranks_by_message.items()
        ]
        raise CheckpointingException(f"{what} failed " + "; ".join(messages)) from err


def _canonical(body: dict) -> bytes:
    """``body`` as JSON with sorted keys and no spaces (what ``self_crc32`` is taken of)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _narrow_exact(
    tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]
) -> torch.Tensor:
    """``tensor[offsets : offsets + sizes]`` per dimension; an error when it does not fit."""
    if tensor.dim() != len(offsets) or any(
        o + n > s for o, n, s in zip(offsets, sizes, tensor.shape)
    ):
        raise CheckpointingException(
            f"stored tensor of shape {tuple(tensor.shape)} has no box at offsets "
            f"{tuple(offsets)} of size {tuple(sizes)}"
        )
    return _narrow(tensor, offsets, sizes)


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The view ``tensor[offsets : offsets + sizes]`` (per dimension)."""
    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
        if size < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, size)
    return tensor
