"""The sharded pieces on disk, through ``torch.distributed.checkpoint`` (DCP).

Every main replica of a ``ShardedTensor`` is one DCP chunk (offsets = ``global_offset``,
sizes = ``local_shape``) of the DCP tensor ``key`` of size ``global_shape``; every main
replica of a ``ShardedObject`` is one DCP byte entry ``unique_key`` holding ``torch.save`` of
its data. DCP writes one ``__<rank>_0.distcp`` file per rank and a ``.metadata`` file;
resharding is DCP's: a rank asks for its box and DCP reads the overlapping parts of whatever
chunks were saved.

What is ours (DCP's default planners take whole tensors, DTensors or torch ShardedTensors,
none of which expresses "this box of that global tensor, possibly several boxes of one key
per rank"): two small planners that speak in boxes, and safe reading. DCP pickles its
``.metadata``; we read it with an unpickler that admits only DCP's metadata classes, torch
dtypes/sizes/layouts and paths. DCP reads tensor data with ``torch.load(weights_only=True)``
already; byte entries we load with ``weights_only=True`` as well. Nothing else is
unpickled.
"""

import contextlib
import dataclasses
import inspect
import io
import pickle
import warnings
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

from megatron.core.dist_checkpointing.core import CheckpointingException

DCP_METADATA_FNAME = ".metadata"


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
) -> None:
    """Collective: DCP-save this rank's main-replica ``boxes`` and serialized ``objects``."""
    planner = _BoxSavePlanner(boxes, objects)
    options = {"single_file_per_rank": True, "sync_files": True}
    if "overwrite" in inspect.signature(FileSystemWriter.__init__).parameters:
        options["overwrite"] = True  # save() has already retired the old checkpoint's marker
    writer = FileSystemWriter(str(checkpoint_dir), **options)
    with _quiet_single_process(), _plain_errors("save"):
        dcp.save({}, storage_writer=writer, planner=planner, no_dist=not _distributed())


def read_metadata(checkpoint_dir: Path) -> Metadata:
    """DCP's metadata of the checkpoint, read without unpickling anything but its own types."""
    return SafeFileSystemReader(str(checkpoint_dir)).read_metadata()


def read_pieces(
    checkpoint_dir: Path, boxes: Sequence[TensorBox], object_keys: Sequence[str]
) -> Dict[str, Any]:
    """Collective: fill ``boxes`` (the overlap with what was saved) and return the objects
    stored under ``object_keys``, each loaded with ``torch.load(weights_only=True)``."""
    planner = _BoxLoadPlanner(boxes, object_keys)
    reader = SafeFileSystemReader(str(checkpoint_dir))
    with _quiet_single_process(), _plain_errors("load"):
        dcp.load({}, storage_reader=reader, planner=planner, no_dist=not _distributed())
    return planner.loaded_objects


def safe_load_bytes(buffer: io.BytesIO, what: str) -> Any:
    """``torch.load(weights_only=True)``; a clear refusal when the payload needs more."""
    try:
        return torch.load(buffer, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointingException(
            f"{what}: refusing to load, it needs objects that torch.load(weights_only=True) "
            f"does not allow ({reason}). This loader never unpickles arbitrary objects; save "
            "tensors, numbers, strings, and lists/tuples/dicts of these instead"
        ) from err


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
            f"torch.load(weights_only=True) refuses ({reason}); got {type(obj).__name__}. "
            "Save tensors, numbers, strings, and lists/tuples/dicts of these"
        ) from err
    return payload


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read by ``_MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(str(self.path)) / DCP_METADATA_FNAME
        if not path.exists():
            raise CheckpointingException(
                f"{path.parent}: DCP metadata file {DCP_METADATA_FNAME!r} is missing; the "
                "checkpoint is incomplete or not a torch.distributed.checkpoint checkpoint"
            )
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointingException(
                f"{path}: expected DCP Metadata, found {type(metadata).__name__}"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        if hasattr(self, "load_id"):
            metadata.storage_meta.load_id = self.load_id
        return metadata


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
        messages = [f"rank {rank}: {exc}" for rank, (exc, _) in sorted(err.failures.items())]
        raise CheckpointingException(f"{what} failed: " + "; ".join(messages)) from err


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The view ``tensor[offsets : offsets + sizes]`` (per dimension)."""
    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
        if size < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, size)
    return tensor
