"""``save`` and ``load`` of sharded state dicts.

A checkpoint directory holds DCP's files (``.metadata``, ``__<rank>_0.distcp``: every
``ShardedTensor`` and ``ShardedObject``), ``common.pt`` (the rest of the state dict, from rank
0, ``torch.save``) and ``metadata.json``, which rank 0 writes last, after every rank has
finished writing. ``save`` first removes an old ``metadata.json`` from the directory, so a save
that dies part-way (a rank killed while writing) leaves a directory that ``load`` refuses
with a clear error instead of a mix of old and new files that loads silently.

Integrity: ``checksums.json`` (written before ``metadata.json``) holds the CRC-32 of
``common.pt``, of ``.metadata`` and of every item's stored bytes in the DCP files; ``load``
checks each before unpickling it and names the file on a mismatch.

Loading never unpickles arbitrary objects: ``common.pt`` and every ShardedObject are read with
``torch.load(weights_only=True)``, DCP's metadata with an unpickler that admits only its own
types (``storage.py``); a checkpoint that needs more is refused with an error naming what.

One module of a little over 600 lines: ``save`` and ``load`` are megatron-core's two entry
points and share every helper below (splitting sharded from common values, the piece
boxes, the agreement and coverage checks); the file format lives in ``storage.py``.
"""

import logging
import os
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.communication import all_gather_object, barrier, gather_object, world_group
from megatron.core.dist_checkpointing import storage
from megatron.core.dist_checkpointing.core import (
    CONFIG_FNAME,
    CheckpointingConfig,
    CheckpointingException,
    _fsync_dir,
    maybe_load_config,
    save_config,
)
from megatron.core.dist_checkpointing.dict_utils import (
    dict_list_map_outplace,
    diff,
    merge,
    nested_values,
)
from megatron.core.dist_checkpointing.load_aliases import read_aliases
from megatron.core.dist_checkpointing.mapping import (
    CommonStateDict,
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from megatron.core.dist_checkpointing.validation import (
    StrictHandling,
    find_coverage_errors,
    parse_strict_flag,
    summarize,
)

logger = logging.getLogger(__name__)

COMMON_FNAME = "common.pt"
SHARDED_BACKEND = "torch_dist"
_CONTENT_METADATA_KEY = "content_metadata"


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: Union[Any, Tuple[str, int], None] = None,
    common_strategy: Union[Any, Tuple[str, int], None] = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[
        Callable[[CommonStateDict], StateDict]
    ] = None,
    content_metadata: Optional[dict] = None,
) -> None:
    """Save ``sharded_state_dict`` into the existing directory ``checkpoint_dir`` (collective:
    every rank of the default group calls it with its own pieces).

    ShardedTensors and ShardedObjects go to DCP (main replicas only); every other value is
    the common state, written by rank 0 to ``common.pt``; ``LocalNonpersistentObject`` s are
    dropped. ``ShardedTensorFactory`` s are built first (in place, as megatron-core does).
    ``validate_access_integrity``: check, over all ranks, that the main replicas of every
    global tensor cover each element exactly once (and ShardedObjects each grid position
    once), and log where ranks' common states differ (after
    ``preprocess_common_before_consistancy_check``). ``sharded_strategy`` may be None or
    ``("torch_dist", version)``; ``common_strategy`` None or ``("torch", version)``;
    ``async_sharded_save`` must be False. Values that ``torch.load(weights_only=True)`` could
    not read back are refused before anything is written.
    """
    _check_strategy(sharded_strategy, "sharded_strategy", SHARDED_BACKEND)
    _check_strategy(common_strategy, "common_strategy", "torch")
    if async_sharded_save:
        raise CheckpointingException(
            "save: async_sharded_save=True is not supported (saves are synchronous); "
            "expected False"
        )
    checkpoint_dir = _existing_dir(checkpoint_dir, "save")
    if content_metadata is not None:
        sharded_state_dict[_CONTENT_METADATA_KEY] = content_metadata

    apply_factories(sharded_state_dict)
    request = _drop_nonpersistent(sharded_state_dict)
    sharded, common = _split_sharded(request)
    pieces = [v for v in nested_values(sharded) if isinstance(v, ShardedBase)]

    # Everything that can fail on one rank alone is found here, then agreed on by all ranks
    # before anything is written (a rank that raised alone would leave the others waiting).
    errors: List[str] = []
    boxes, objects = [], {}
    try:
        boxes, objects = _pieces_to_write(pieces)
        common_payload = storage.serialize_checked(common, "common (non-sharded) state")
    except CheckpointingException as err:
        errors.append(str(err))
        common_payload = b""
    metas = [p.without_data() for p in pieces] if validate_access_integrity else []
    everyone = _all_gather((errors, metas))
    errors = [f"rank {r}: {e}" for r, (errs, _) in enumerate(everyone) for e in errs]
    if validate_access_integrity and not errors:
        errors = _sharding_errors([m for _, m in everyone])
    if errors:
        raise CheckpointingException(f"save to {checkpoint_dir} refused:{summarize(errors)}")
    if validate_access_integrity:
        _log_common_differences(common, preprocess_common_before_consistancy_check)

    if _rank() == 0:
        marker = checkpoint_dir / CONFIG_FNAME
        if marker.exists():
            marker.unlink()
            _fsync_dir(checkpoint_dir)
        elif any(checkpoint_dir.iterdir()):
            logger.warning("save: %s is not empty; overwriting what it holds", checkpoint_dir)
    _barrier()  # nobody writes before the old marker is gone
    if _rank() == 0:
        _write_file(checkpoint_dir / COMMON_FNAME, common_payload)
    item_sums = storage.write_pieces(checkpoint_dir, boxes, objects)
    everyone_sums = _all_gather(item_sums)  # also: every rank's files are written and synced
    if _rank() == 0:
        items: storage.ItemChecksums = {}
        for sums in everyone_sums:
            for name, entries in sums.items():
                items.setdefault(name, {}).update(entries)
        files = {
            COMMON_FNAME: zlib.crc32(common_payload),
            storage.DCP_METADATA_FNAME: zlib.crc32(
                (checkpoint_dir / storage.DCP_METADATA_FNAME).read_bytes()
            ),
        }
        storage.write_checksums(checkpoint_dir, items, files)
        save_config(CheckpointingConfig(SHARDED_BACKEND, 1), checkpoint_dir)
    _barrier()


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: Union[Any, Tuple[str, int], None] = None,
    common_strategy: Union[Any, Tuple[str, int], None] = None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
    """Load the pieces ``sharded_state_dict`` asks for from ``checkpoint_dir`` (collective).

    Returns a state dict of the request's nesting in which each ShardedTensor is replaced by
    a tensor holding its box of the saved global tensor (whatever layout saved it), each
    ShardedObject by its saved object, each factory by its merged tensor, each
    LocalNonpersistentObject by its value, merged with the checkpoint's common state. A
    loaded tensor has the requested dtype and lives on the device of the request's data; it
    is a new tensor, except for a flat piece (``flattened_range``: the distributed
    optimizer's shards), which is read into its own ``data`` (no second copy of the state).

    Keys the request has and the checkpoint lacks ("unexpected") and the reverse ("missing")
    are handled by ``strict`` (``StrictHandling``); with the default an unexpected key is an
    error naming it. With ``return_*`` the result is ``(state_dict, missing_keys,
    unexpected_keys)``. ``validate_access_integrity``: also check that all ranks agree on each
    key's global shape and dtype. A global shape that differs from the saved one is an
    error unless the piece has ``allow_shape_mismatch`` (then only the overlap is read and
    the rest keeps the request's data).
    """
    _check_strategy(sharded_strategy, "sharded_strategy", SHARDED_BACKEND)
    _check_strategy(common_strategy, "common_strategy", "torch")
    strict = parse_strict_flag(strict)
    checkpoint_dir = _complete_checkpoint(checkpoint_dir, "load")
    if storage.read_checksums(checkpoint_dir) is None and _rank() == 0:
        logger.warning(
            "load: %s has no %s (written by another writer or an older version): its "
            "files are not checked for damage",
            checkpoint_dir,
            storage.CHECKSUMS_FNAME,
        )
    common_state = load_common_state_dict(checkpoint_dir)
    metadata = storage.read_metadata(checkpoint_dir)
    stored_shapes = storage.stored_tensor_shapes(metadata)
    stored_objects = set(storage.stored_object_keys(metadata))

    with_factories = dict_list_map_outplace(lambda x: x, sharded_state_dict)
    apply_factories(sharded_state_dict)
    nonpersistent = _nonpersistent_values(sharded_state_dict)
    sharded, _ = _split_sharded(_drop_nonpersistent(sharded_state_dict))
    pieces = read_aliases(nested_values(sharded), stored_shapes, stored_objects)
    unexpected = {
        _storage_key(p)
        for p in pieces
        if (_storage_key(p) not in stored_shapes and isinstance(p, ShardedTensor))
        or (_storage_key(p) not in stored_objects and isinstance(p, ShardedObject))
    }
    errors = _shape_errors(pieces, stored_shapes, unexpected)
    if strict == StrictHandling.ASSUME_OK_UNEXPECTED and unexpected:
        errors.append(
            f"the checkpoint has no {_few(unexpected)} (requested; pass strict="
            "'log_unexpected' or 'ignore_all' to skip keys the checkpoint lacks)"
        )
    if strict == StrictHandling.RAISE_UNEXPECTED and unexpected:
        errors.append(f"unexpected keys (requested, not in the checkpoint): {_few(unexpected)}")
    need_global = validate_access_integrity or StrictHandling.requires_global_app_metadata(strict)
    metas = [p.without_data() for p in pieces] if need_global else []
    everyone = _all_gather((errors, metas))
    errors = [f"rank {r}: {e}" for r, (errs, _) in enumerate(everyone) for e in errs]
    missing: Set[str] = set()
    if need_global:
        all_metas = [m for _, ms in everyone for m in ms]
        if validate_access_integrity:
            errors += _agreement_errors(all_metas)
        requested = {_storage_key(m) for m in all_metas}
        missing = (set(stored_shapes) | stored_objects) - requested
        if strict == StrictHandling.RAISE_ALL and (missing or unexpected):
            errors.append(
                f"strict='raise_all': missing (in the checkpoint, requested by no rank): "
                f"{_few(missing)}; unexpected (requested, not in the checkpoint): "
                f"{_few(unexpected)}"
            )
    if errors:
        raise CheckpointingException(f"load from {checkpoint_dir} refused:{summarize(errors)}")
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and unexpected:
        logger.warning("load: skipping keys the checkpoint lacks: %s", _few(unexpected))
    if strict == StrictHandling.LOG_ALL and missing:
        logger.warning("load: checkpoint keys no rank requested: %s", _few(missing))

    wanted = [p for p in pieces if _storage_key(p) not in unexpected]
    boxes, destinations = _boxes_to_read(wanted, stored_shapes)
    objects = storage.read_pieces(
        checkpoint_dir, boxes, [p.unique_key for p in wanted if isinstance(p, ShardedObject)]
    )

    def loaded_value(x):
        if isinstance(x, ShardedTensor):
            return destinations.get(id(x), _SKIPPED)
        if isinstance(x, ShardedObject):
            return objects.get(x.unique_key, _SKIPPED)
        return x

    loaded = dict_list_map_outplace(loaded_value, sharded)
    result = _drop_skipped(_skip_partial_factories(loaded, with_factories))
    merge(common_state, result)
    merge(common_state, nonpersistent)
    apply_factory_merges(common_state, with_factories)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common_state, missing, unexpected
    return common_state


def load_common_state_dict(checkpoint_dir: Union[str, Path]) -> StateDict:
    """The common (non-sharded) state of a complete checkpoint, read with
    ``torch.load(weights_only=True)`` (no collective)."""
    checkpoint_dir = _complete_checkpoint(checkpoint_dir, "load_common_state_dict")
    path = checkpoint_dir / COMMON_FNAME
    if not path.exists():
        raise CheckpointingException(f"{checkpoint_dir}: {COMMON_FNAME} is missing")
    payload = path.read_bytes()
    storage.verify_bytes(
        checkpoint_dir, COMMON_FNAME, payload, storage.read_checksums(checkpoint_dir)
    )
    return storage.load_common_bytes(payload, str(path))


def load_tensors_metadata(
    checkpoint_dir: str, sharded_strategy: Optional[Any] = None
) -> Dict[str, ShardedTensor]:
    """{key: ShardedTensor without data} describing each saved global tensor whole (global
    shape, saved dtype, offset 0). No collective."""
    _check_strategy(sharded_strategy, "sharded_strategy", SHARDED_BACKEND)
    checkpoint_dir = _complete_checkpoint(checkpoint_dir, "load_tensors_metadata")
    metadata = storage.read_metadata(checkpoint_dir)
    return {
        key: ShardedTensor(
            key, None, storage.stored_dtype(metadata, key), shape, shape, (0,) * len(shape), None
        )
        for key, shape in storage.stored_tensor_shapes(metadata).items()
    }


def load_plain_tensors(checkpoint_dir: str) -> StateDict:
    """Every saved tensor whole, as {key: tensor} on the CPU (collective when
    torch.distributed is initialized: every rank reads everything)."""
    request = load_tensors_metadata(checkpoint_dir)
    for sh in request.values():
        sh.init_data("cpu")
    return load(request, checkpoint_dir, validate_access_integrity=False)


def load_content_metadata(
    checkpoint_dir: Optional[str] = None, *, preloaded_state_dict: Optional[StateDict] = None
) -> Optional[dict]:
    """The ``content_metadata`` given to ``save`` (None when there was none)."""
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise ValueError("load_content_metadata: give checkpoint_dir or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(_CONTENT_METADATA_KEY)


# ----------------------------------------------------------------------------------------
# helpers

_SKIPPED = object()


def _check_strategy(strategy: Any, name: str, backend: str) -> None:
    """Only the default strategy exists here: None or ``(backend, version)``."""
    if strategy is None:
        return
    if isinstance(strategy, tuple) and len(strategy) == 2 and strategy[0] == backend:
        return
    raise CheckpointingException(
        f"{name}={strategy!r} is not supported; expected None or ({backend!r}, version) "
        f"(tensors are stored through torch.distributed.checkpoint, the common state with "
        "torch.save)"
    )


def _existing_dir(checkpoint_dir: Union[str, Path], what: str) -> Path:
    if not isinstance(checkpoint_dir, (str, Path)):
        raise CheckpointingException(
            f"{what}: checkpoint_dir must be a str or Path, got {type(checkpoint_dir).__name__}"
        )
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise CheckpointingException(
            f"{what}: checkpoint_dir={str(checkpoint_dir)!r} is not an existing directory "
            "(create it first; every rank must see the same directory)"
        )
    return path


def _complete_checkpoint(checkpoint_dir: Union[str, Path], what: str) -> Path:
    """The directory, if it holds a complete checkpoint of our backends; else a clear error."""
    path = _existing_dir(checkpoint_dir, what)
    config = maybe_load_config(path)
    if config is None:
        content = "empty" if not any(path.iterdir()) else "not empty"
        raise CheckpointingException(
            f"{what}: {path} is not a complete distributed checkpoint: {CONFIG_FNAME} is "
            f"missing (the directory is {content}). save writes it last, after every rank "
            "has finished; a save that was interrupted never does"
        )
    if config.sharded_backend != SHARDED_BACKEND or config.common_backend != "torch":
        raise CheckpointingException(
            f"{what}: {path} uses backends {config.sharded_backend!r}/{config.common_backend!r};"
            f" expected {SHARDED_BACKEND!r}/'torch'"
        )
    return path


def _without(x: Any, dropped: Callable[[Any], bool]) -> Any:
    """A copy of the nesting without the values for which ``dropped`` holds."""
    if isinstance(x, dict):
        return {k: _without(v, dropped) for k, v in x.items() if not dropped(v)}
    if isinstance(x, list):
        return [_without(v, dropped) for v in x if not dropped(v)]
    return x


def _drop_nonpersistent(x: Any) -> Any:
    """A copy of the nesting without LocalNonpersistentObjects."""
    return _without(x, lambda v: isinstance(v, LocalNonpersistentObject))


def _nonpersistent_values(x: Any) -> Any:
    """Only the LocalNonpersistentObjects of a nesting, unwrapped (lists as {index: value},
    which ``merge`` puts back by position); None when there are none."""
    items = x.items() if isinstance(x, dict) else enumerate(x)
    out = {}
    for k, v in items:
        if isinstance(v, LocalNonpersistentObject):
            out[k] = v.unwrap()
        elif isinstance(v, (dict, list)):
            sub = _nonpersistent_values(v)
            if sub:
                out[k] = sub
    return out


def _contains_sharded(x: Any) -> bool:
    if isinstance(x, (ShardedBase, ShardedTensorFactory)):
        return True
    if isinstance(x, dict):
        return any(_contains_sharded(v) for v in x.values())
    if isinstance(x, list):
        return any(_contains_sharded(v) for v in x)
    return False


def _split_sharded(x: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the parts holding sharded pieces, the common rest). Dicts are split by key; a list
    that holds any sharded piece goes whole to the first part (so positions survive)."""
    sharded, common = {}, {}
    for k, v in x.items():
        if isinstance(v, dict):
            s, c = _split_sharded(v)
            if s:
                sharded[k] = s
            if c or not s:
                common[k] = c
        elif _contains_sharded(v):
            sharded[k] = v
        else:
            common[k] = v
    return sharded, common


def _skip_partial_factories(loaded: Any, request: Any) -> Any:
    """``loaded`` with the sub-dict of each factory that lost a piece (not in the checkpoint,
    skipped by ``strict``) skipped whole: its ``merge_fn`` needs every piece."""
    if isinstance(request, ShardedTensorFactory):
        return _SKIPPED if _any_skipped(loaded) else loaded
    if isinstance(request, dict) and isinstance(loaded, dict):
        return {k: _skip_partial_factories(v, request.get(k)) for k, v in loaded.items()}
    if isinstance(request, list) and isinstance(loaded, list) and len(request) == len(loaded):
        return [_skip_partial_factories(v, r) for v, r in zip(loaded, request)]
    return loaded


def _any_skipped(x: Any) -> bool:
    if isinstance(x, (dict, list)):
        return any(v is _SKIPPED for v in nested_values(x))
    return x is _SKIPPED


def _drop_skipped(x: Any) -> Any:
    """A copy of the nesting without the entries no storage piece was read into."""
    return _without(x, lambda v: v is _SKIPPED)


def _storage_key(piece: ShardedBase) -> str:
    return piece.unique_key if isinstance(piece, ShardedObject) else piece.key


def _box_tensor(sh: ShardedTensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` viewed with the prepended axes (the box's full local shape)."""
    return data.reshape(sh.local_shape) if sh.prepend_axis_num else data


def _pieces_to_write(pieces: List[ShardedBase]):
    """This rank's main-replica boxes and serialized objects (errors name the piece)."""
    boxes, objects = [], {}
    for p in pieces:
        if not is_main_replica(p.replica_id):
            continue
        if isinstance(p, ShardedTensor):
            if not isinstance(p.data, torch.Tensor):
                raise CheckpointingException(f"ShardedTensor {p.key!r} has no data to save")
            p.validate_metadata_integrity()
            if p.flattened_range is None:
                box = storage.TensorBox(
                    p.key, _box_tensor(p, p.data), p.global_shape, p.global_offset
                )
                boxes.append(box)
                continue
            for offset, shape, start, stop in p.flat_boxes():
                data = p.data[start:stop].reshape(shape)
                boxes.append(storage.TensorBox(p.key, data, p.global_shape, offset))
        else:
            objects[p.unique_key] = storage.serialize_checked(  # megatron-core's form
                [p.data], f"ShardedObject {p.unique_key!r}"
            )
    return boxes, objects


def _boxes_to_read(pieces: List[ShardedBase], stored_shapes: Dict[str, Tuple[int, ...]]):
    """Destination boxes for the requested ShardedTensors; {id(piece): result tensor}."""
    boxes, destinations = [], {}
    for p in pieces:
        if not isinstance(p, ShardedTensor):
            continue
        shape = tuple(p.local_shape[p.prepend_axis_num :])
        if p.flattened_range is not None:
            shape = (p.flattened_range.stop - p.flattened_range.start,)
        device = p.data.device if isinstance(p.data, torch.Tensor) else torch.device("cpu")
        same_shape = tuple(stored_shapes[p.key]) == tuple(p.global_shape)
        if p.flattened_range is not None and same_shape and _readable_in_place(p, shape):
            out = p.data.detach()  # a flat shard is read into its own storage (no copy)
        elif not same_shape and p.data is not None:
            out = p.data.detach().clone().to(p.dtype)  # keeps what the checkpoint lacks
        else:
            out = torch.empty(shape, dtype=p.dtype, device=device)
        destinations[id(p)] = out
        if p.flattened_range is None:
            box = storage.TensorBox(p.key, _box_tensor(p, out), p.global_shape, p.global_offset)
            boxes.append(box)
            continue
        for offset, box_shape, start, stop in p.flat_boxes():  # views of the flat destination
            view = out[start:stop].view(box_shape)
            boxes.append(storage.TensorBox(p.key, view, p.global_shape, offset))
    return boxes, destinations


def _readable_in_place(piece: ShardedTensor, shape: Tuple[int, ...]) -> bool:
    data = piece.data
    return (
        isinstance(data, torch.Tensor)
        and data.dtype == piece.dtype
        and tuple(data.shape) == tuple(shape)
        and data.is_contiguous()
    )


def _shape_errors(pieces, stored_shapes, unexpected) -> List[str]:
    errors = []
    for p in pieces:
        if not isinstance(p, ShardedTensor) or p.key in unexpected:
            continue
        saved = tuple(stored_shapes[p.key])
        if saved != tuple(p.global_shape) and not p.allow_shape_mismatch:
            errors.append(
                f"{p.key!r}: the checkpoint's global shape is {saved}, the request's "
                f"{tuple(p.global_shape)} (set allow_shape_mismatch=True to read the overlap)"
            )
        elif len(saved) != len(p.global_shape):
            errors.append(
                f"{p.key!r}: the checkpoint's tensor has {len(saved)} dimensions, the "
                f"request {len(p.global_shape)}"
            )
    return errors


def _sharding_errors(metas_per_rank: List[List[ShardedBase]]) -> List[str]:
    """Every global tensor covered exactly once by main replicas, with one shape and dtype;
    every ShardedObject grid position written exactly once."""
    errors = _agreement_errors([m for metas in metas_per_rank for m in metas])
    if errors:
        return errors
    tensors: Dict[str, list] = {}
    objects: Dict[str, list] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    for rank, metas in enumerate(metas_per_rank):
        for m in metas:
            if isinstance(m, ShardedTensor):
                shapes[m.key] = m.global_shape
                entries = tensors.setdefault(m.key, [])
                if is_main_replica(m.replica_id):
                    entries += [((o, s), rank) for o, s, _, _ in m.flat_boxes()]
            else:
                entries = objects.setdefault(m.key, [])
                entries.append((m, rank))
    for key, boxes in tensors.items():
        errors += find_coverage_errors(key, shapes[key], boxes)
    for key, entries in objects.items():
        grid = entries[0][0].global_shape
        writers: Dict[Tuple[int, ...], List[int]] = {}
        for m, rank in entries:
            if tuple(m.global_shape) != tuple(grid):
                errors.append(
                    f"ShardedObject {key!r}: ranks disagree on global_shape "
                    f"({tuple(grid)} vs {tuple(m.global_shape)} on rank {rank})"
                )
            writers.setdefault(tuple(m.global_offset), [])
            if is_main_replica(m.replica_id):
                writers[tuple(m.global_offset)].append(rank)
        for offset, ranks in writers.items():
            if len(ranks) != 1:
                errors.append(
                    f"ShardedObject {key!r} at {offset}: {len(ranks)} main replicas "
                    f"(ranks {ranks}); expected exactly one"
                )
        count = 1
        for size in grid:
            count *= size
        if len(writers) != count:
            errors.append(
                f"ShardedObject {key!r}: {len(writers)} of {count} grid positions of "
                f"{tuple(grid)} present"
            )
    return errors


def _agreement_errors(metas: List[ShardedBase]) -> List[str]:
    """All pieces of one key agree on the global shape and dtype."""
    first: Dict[str, ShardedTensor] = {}
    errors = []
    for m in metas:
        if not isinstance(m, ShardedTensor):
            continue
        ref = first.setdefault(m.key, m)
        if ref.global_shape != m.global_shape or ref.dtype != m.dtype:
            errors.append(
                f"{m.key!r}: pieces disagree on the global tensor: shape {ref.global_shape} "
                f"dtype {ref.dtype} vs shape {m.global_shape} dtype {m.dtype}"
            )
    return errors


def _log_common_differences(common: StateDict, preprocess: Optional[Callable]) -> None:
    """Warn (rank 0) where ranks' common states differ from rank 0's."""
    view = preprocess(common) if preprocess is not None else common
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    gathered = gather_object(view, world_group(), dst=0)
    if _rank() != 0:
        return
    for rank, other in enumerate(gathered[1:], start=1):
        only_0, only_other, differ = diff(gathered[0], other)
        if only_0 or only_other or differ:
            logger.warning(
                "save: common state of rank %d differs from rank 0's (only rank 0: %s; only "
                "rank %d: %s; different: %s); rank 0's is saved",
                rank,
                only_0[:5],
                rank,
                only_other[:5],
                differ[:5],
            )


def _few(keys, limit: int = 8) -> str:
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _write_file(path: Path, payload: bytes) -> None:
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    barrier(world_group())


def _all_gather(obj: Any) -> List[Any]:
    """Every rank's ``obj`` (just ``[obj]`` without torch.distributed)."""
    return all_gather_object(obj, world_group())


__all__ = [
    "save",
    "load",
    "load_common_state_dict",
    "load_tensors_metadata",
    "load_plain_tensors",
    "load_content_metadata",
]
