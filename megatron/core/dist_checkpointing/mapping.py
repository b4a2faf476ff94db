"""What a sharded state dict holds: where each local piece sits in a global tensor.

A ``ShardedTensor`` says that its ``data`` (shape ``local_shape`` without the prepended axes) is
the box ``[global_offset, global_offset + local_shape)`` of a global tensor of shape
``global_shape`` stored under ``key``. The key and the box do not depend on the parallel
layout, which is what lets a checkpoint saved at one layout load at another. A ``replica_id``
other than 0 (or a tuple with a non-zero entry) marks a copy that another rank writes.

A ``ShardedObject`` is a non-tensor piece at a position of a grid (``global_shape``,
``global_offset``); a ``ShardedTensorFactory`` turns one local tensor into several
``ShardedTensor`` s at save/load time and merges them back after loading; a
``LocalNonpersistentObject`` is returned by ``load`` as it is and never saved.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

ReplicaId = Union[int, Tuple[int, ...]]
StateDict = Dict[str, Any]
CommonStateDict = Dict[str, Any]
ShardedStateDict = Dict[str, Any]

__all__ = [
    "ShardedBase",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonpersistentObject",
    "ReplicaId",
    "StateDict",
    "CommonStateDict",
    "ShardedStateDict",
    "is_main_replica",
    "apply_factories",
    "apply_factory_merges",
]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the copy that is written: replica id 0, or a tuple of zeros."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedBase(ABC):
    """Common interface of the pieces of a sharded state dict."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise ``CheckpointingException`` if the piece's metadata is inconsistent."""

    @abstractmethod
    def without_data(self) -> "ShardedBase":
        """A copy without the payload (for metadata exchange)."""


@dataclass
class ShardedTensor(ShardedBase):
    """One local box of a global tensor (see the module docstring).

    ``prepend_axis_num`` leading axes of the global tensor have no counterpart in ``data``
    (each has local size 1): a layer index, for example, so that every layer of a stack
    shares one key. ``allow_shape_mismatch``: on load the stored global shape may differ
    (padded vocabularies); only the overlap is read.

    ``flattened_range`` (the distributed optimizer's shards): ``data`` is 1-D and holds the
    elements ``[start, stop)`` of the box flattened in row-major order (``local_shape`` is
    still the whole box). On disk such a piece is the few rectangular boxes that range is made
    of (``flat_boxes``), so it reads back at any other layout, flat or not.
    """

    key: str
    data: Optional[torch.Tensor]
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Check shapes, offsets and dtype against each other and against ``data``."""
        ndim = len(self.global_shape)
        if len(self.local_shape) != ndim or len(self.global_offset) != ndim:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: local_shape {self.local_shape}, global_shape "
                f"{self.global_shape} and global_offset {self.global_offset} must have the "
                "same number of dimensions"
            )
        for axis, (off, loc, glob) in enumerate(
            zip(self.global_offset, self.local_shape, self.global_shape)
        ):
            if off < 0 or loc < 0 or off + loc > glob:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: axis {axis} box [{off}, {off + loc}) does "
                    f"not fit in global size {glob} (global_shape {self.global_shape}, "
                    f"global_offset {self.global_offset}, local_shape {self.local_shape})"
                )
        if not 0 <= self.prepend_axis_num <= ndim:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: prepend_axis_num={self.prepend_axis_num} must be "
                f"in [0, {ndim}]"
            )
        if any(s != 1 for s in self.local_shape[: self.prepend_axis_num]):
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: prepended axes must have local size 1, got "
                f"local_shape {self.local_shape} with prepend_axis_num={self.prepend_axis_num}"
            )
        if self.flattened_range is not None:
            self._validate_flattened_range()
        elif self.data is not None:
            expected = tuple(self.local_shape[self.prepend_axis_num :])
            if tuple(self.data.shape) != expected:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: data has shape {tuple(self.data.shape)}, "
                    f"expected {expected} (local_shape {self.local_shape} without "
                    f"{self.prepend_axis_num} prepended axes)"
                )
        if self.data is not None and self.data.dtype != self.dtype:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: data dtype {self.data.dtype} differs from "
                f"dtype {self.dtype}"
            )

    def _validate_flattened_range(self) -> None:
        rng, numel = self.flattened_range, _numel(self.local_shape)
        if not isinstance(rng, slice) or rng.step not in (None, 1):
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: flattened_range={rng!r}; expected a slice "
                "start:stop with step 1"
            )
        if rng.start is None or rng.stop is None or not 0 <= rng.start < rng.stop <= numel:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: flattened_range={rng!r} must satisfy "
                f"0 <= start < stop <= {numel} (the box {self.local_shape} flattened)"
            )
        if self.data is not None and tuple(self.data.shape) != (rng.stop - rng.start,):
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: data has shape {tuple(self.data.shape)}, "
                f"expected ({rng.stop - rng.start},) for flattened_range={rng!r}"
            )

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs,
    ) -> "ShardedTensor":
        """The ShardedTensor of ``data`` given, per sharded axis, ``(axis, rank, count)``.

        Along ``axis`` the global tensor is ``count`` equal pieces of ``data``'s size and this
        is piece ``rank``: global size = local size * count, offset = local size * rank. Axes
        index the global tensor, whose first ``prepend_axis_num`` axes are prepended (local
        size 1). Unlisted axes are whole.
        """
        if flattened_range is not None:
            raise CheckpointingException(
                f"ShardedTensor.from_rank_offsets({key!r}): flattened_range="
                f"{flattened_range!r} is not accepted here; use from_rank_offsets_flat (data "
                "1-D, the box's shape given separately)"
            )
        if not isinstance(data, torch.Tensor):
            raise CheckpointingException(
                f"ShardedTensor.from_rank_offsets({key!r}): data must be a torch.Tensor, got "
                f"{type(data).__name__}"
            )
        local_shape = (1,) * prepend_axis_num + tuple(data.shape)
        global_shape = list(local_shape)
        global_offset = [0] * len(local_shape)
        fragmentations = [1] * len(local_shape)
        seen = set()
        for entry in rank_offsets:
            if len(entry) != 3:
                raise CheckpointingException(
                    f"ShardedTensor.from_rank_offsets({key!r}): rank offset {entry!r} must be "
                    "(axis, axis_rank_offset, axis_fragmentations)"
                )
            axis, rank, count = (int(x) for x in entry)
            if not 0 <= axis < len(local_shape) or axis in seen:
                raise CheckpointingException(
                    f"ShardedTensor.from_rank_offsets({key!r}): axis {axis} in {entry!r} is out "
                    f"of range for {len(local_shape)} dimensions or repeated"
                )
            if count < 1 or not 0 <= rank < count:
                raise CheckpointingException(
                    f"ShardedTensor.from_rank_offsets({key!r}): {entry!r} needs "
                    "0 <= axis_rank_offset < axis_fragmentations"
                )
            seen.add(axis)
            global_shape[axis] = local_shape[axis] * count
            global_offset[axis] = local_shape[axis] * rank
            fragmentations[axis] = count
        return cls(
            key,
            data,
            data.dtype,
            local_shape,
            tuple(global_shape),
            tuple(global_offset),
            tuple(fragmentations),
            replica_id,
            prepend_axis_num,
            flattened_range=None,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: Tuple[int, ...],
        *rank_offsets: Tuple[int, int, int],
        flattened_range: slice,
        **init_kwargs,
    ) -> "ShardedTensor":
        """As ``from_rank_offsets`` for a box of shape ``non_flat_local_shape`` of which the
        1-D ``data`` is the elements ``flattened_range`` (row-major)."""
        if flattened_range is None:
            raise CheckpointingException(
                f"ShardedTensor.from_rank_offsets_flat({key!r}): flattened_range is None; "
                "expected a slice (use from_rank_offsets for whole boxes)"
            )
        if not isinstance(data, torch.Tensor) or data.dim() != 1:
            raise CheckpointingException(
                f"ShardedTensor.from_rank_offsets_flat({key!r}): data must be a 1-D tensor"
            )
        meta = torch.empty(tuple(non_flat_local_shape), dtype=data.dtype, device="meta")
        box = cls.from_rank_offsets(key, meta, *rank_offsets, **init_kwargs)
        return replace(box, data=data, flattened_range=flattened_range)

    def flat_boxes(self) -> List[Tuple[Tuple[int, ...], Tuple[int, ...], int, int]]:
        """The rectangular boxes this piece covers: ``(global_offset, shape, start, stop)``
        each, ``data[start:stop]`` (reshaped to ``shape``) being the box at ``global_offset``
        (shapes include the prepended axes). One box, the whole ``data``, without
        ``flattened_range``."""
        if self.flattened_range is None:
            return [
                (tuple(self.global_offset), tuple(self.local_shape), 0, _numel(self.local_shape))
            ]
        rng = self.flattened_range
        return [
            (
                tuple(o + g for o, g in zip(offset, self.global_offset)),
                shape,
                a - rng.start,
                b - rng.start,
            )
            for offset, shape, a, b in flat_range_boxes(
                tuple(self.local_shape), rng.start, rng.stop
            )
        ]

    def global_slice(self) -> Tuple[slice, ...]:
        """The box this piece covers, as slices of the global tensor."""
        return tuple(
            slice(off, off + size) for off, size in zip(self.global_offset, self.local_shape)
        )

    def without_data(self) -> "ShardedTensor":
        return replace(self, data=None)

    def init_data(self, device: Union[str, torch.device], init_fn=torch.empty) -> None:
        """Allocate ``data`` (shape ``local_shape`` without prepended axes) if it is None."""
        if self.data is None:
            shape = self.local_shape[self.prepend_axis_num :]
            if self.flattened_range is not None:
                shape = (self.flattened_range.stop - self.flattened_range.start,)
            self.data = init_fn(shape, dtype=self.dtype, device=device)

    def __str__(self) -> str:
        return (
            f"{type(self).__name__}(key={self.key!r}, global_shape={self.global_shape}, "
            f"global_offset={self.global_offset}, local_shape={self.local_shape}, "
            f"replica_id={self.replica_id})"
        )


def flat_range_boxes(
    shape: Tuple[int, ...], start: int, stop: int
) -> List[Tuple[Tuple[int, ...], Tuple[int, ...], int, int]]:
    """The elements ``[start, stop)`` of a row-major array of ``shape`` as rectangular boxes
    ``(offset, box shape, start, stop)`` in flat order (at most 2 per dimension): a partial
    leading row, whole rows, a partial trailing row, recursively."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,), start, stop)] if shape else [((), (), 0, 1)]
    inner = _numel(shape[1:])
    boxes = []

    def rows(first: int, count: int, base: int) -> None:
        boxes.append(
            (
                (first,) + (0,) * (len(shape) - 1),
                (count,) + tuple(shape[1:]),
                base,
                base + count * inner,
            )
        )

    def partial(row: int, lo: int, hi: int) -> None:
        for offset, sub, a, b in flat_range_boxes(tuple(shape[1:]), lo, hi):
            boxes.append(((row,) + offset, (1,) + sub, row * inner + a, row * inner + b))

    if start % inner:
        row = start // inner
        partial(row, start % inner, min(stop - row * inner, inner))
        start = min(stop, (row + 1) * inner)
    if stop // inner > start // inner and start < stop:
        first, last = start // inner, stop // inner
        rows(first, last - first, start)
        start = last * inner
    if start < stop:
        row = start // inner
        partial(row, 0, stop - row * inner)
    return boxes


def _numel(shape: Tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@dataclass
class ShardedObject(ShardedBase):
    """A non-tensor piece at ``global_offset`` of a grid of shape ``global_shape``.

    Stored under ``unique_key``. Its ``data`` must be loadable with
    ``torch.load(weights_only=True)`` (tensors, numbers, strings, containers of these);
    ``save`` refuses anything else.
    """

    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"ShardedObject {self.key!r}: global_shape {self.global_shape} and "
                f"global_offset {self.global_offset} differ in length"
            )
        for off, size in zip(self.global_offset, self.global_shape):
            if not 0 <= off < size:
                raise CheckpointingException(
                    f"ShardedObject {self.key!r}: global_offset {self.global_offset} is outside "
                    f"global_shape {self.global_shape}"
                )

    @property
    def unique_key(self) -> str:
        """``key/shard_<offset>_<shape>`` (dot-separated): the name this piece is stored as."""
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"

    def without_data(self) -> "ShardedObject":
        return replace(self, data=None)

    def __str__(self) -> str:
        return f"{type(self).__name__}(key={self.unique_key!r}, replica_id={self.replica_id})"


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, Optional[slice]], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """Builds several sharded pieces from one local tensor, and merges them after loading.

    ``build_fn(key, data, replica_id, flattened_range)`` returns a sharded state dict (for
    example the two halves of a gated MLP weight, each a contiguous box of its own global
    tensor); ``merge_fn`` turns the loaded version of that dict back into one tensor.
    """

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def build(self) -> ShardedStateDict:
        """The sharded state dict this factory stands for."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        if self.flattened_range is not None:
            raise CheckpointingException(
                f"ShardedTensorFactory {self.key!r}: flattened_range is not supported"
            )

    def without_data(self) -> "ShardedTensorFactory":
        return replace(self, data=None)


@dataclass
class LocalNonpersistentObject:
    """A value ``load`` hands back as it is (from the request) and ``save`` never writes."""

    obj: Any

    def unwrap(self) -> Any:
        return self.obj


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every ``ShardedTensorFactory`` in place with the dict it builds."""

    def build(x):
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(build, sharded_state_dict)


def apply_factory_merges(
    x1: StateDict, x2: ShardedStateDict, key: Tuple[str, ...] = ()
) -> StateDict:
    """Walk ``x1`` (loaded values) beside ``x2`` (the request with factories) and replace
    each factory's sub-dict in ``x1`` with ``merge_fn`` of it. Returns ``x1``."""
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x2, dict):
        if not isinstance(x1, dict):
            raise CheckpointingException(f"factory merge at {key}: expected a dict, got {x1!r}")
        for k, v2 in x2.items():
            if k in x1:
                x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
        return x1
    if isinstance(x2, list):
        if not isinstance(x1, list) or len(x1) != len(x2):
            raise CheckpointingException(f"factory merge at {key}: list structure differs")
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key + (str(i),))
        return x1
    return x1
