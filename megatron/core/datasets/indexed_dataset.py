"""megatron's indexed token format: a ``.bin`` of raw token ids and an ``.idx`` index.

Byte layout of ``<prefix>.idx`` (little endian), identical to megatron-core's so either
side reads the other's files::

    b"MMIDIDX\\x00\\x00"        9-byte magic
    uint64 version = 1
    uint8  dtype code           (DType: uint8=1 int8=2 int16=3 int32=4 int64=5
                                 float64=6 float32=7 uint16=8)
    uint64 S                    number of sequences
    uint64 D                    number of document boundaries (documents + 1)
    int32[S] sequence lengths   (tokens)
    int64[S] sequence pointers  (byte offset of each sequence in the .bin)
    int64[D] document indices   (sequence index where each document ends; starts with 0)
    int8[S]  sequence modes     (only for multimodal datasets)

``<prefix>.bin`` is the concatenation of every sequence's ids in the dtype above.
"""

import os
import shutil
import struct
from enum import Enum
from itertools import accumulate
from typing import Any, List, Optional, Tuple, Type, Union

import numpy
import torch

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1


class DType(Enum):
    """The numeric dtype codes stored in the index header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: Type[numpy.number]) -> int:
        """The code of a numpy dtype."""
        return cls[numpy.dtype(value).name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> Type[numpy.number]:
        """The numpy dtype of a code."""
        return getattr(numpy, cls(value).name)

    @staticmethod
    def size(key: Union[int, Type[numpy.number]]) -> int:
        """Bytes per element for a code or a numpy dtype."""
        if isinstance(key, int):
            return numpy.dtype(DType.dtype_from_code(key)).itemsize
        return numpy.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> Type[numpy.number]:
        """uint16 for vocabularies below 65500 ids, int32 otherwise."""
        if cardinality is not None and cardinality < 65500:
            return numpy.uint16
        return numpy.int32


class IndexedDataset(torch.utils.data.Dataset):
    """Read a ``.bin``/``.idx`` pair; ``ds[i]`` is sequence ``i`` as a numpy array.

    Args mirror megatron-core 0.16.1. Object storage (``object_storage_config``,
    ``s3_config``) and ``fast_cache_load`` are not supported here and raise.
    """

    def __init__(
        self,
        path_prefix: str,
        multimodal: bool = False,
        mmap: bool = True,
        object_storage_config: Optional[Any] = None,
        s3_config: Optional[Any] = None,
        fast_cache_load: bool = False,
        sequences_per_dataset: Optional[Tuple[int, int]] = None,
        dtype_code: Optional[int] = None,
    ) -> None:
        super().__init__()
        if object_storage_config is not None or s3_config is not None:
            raise NotImplementedError(
                "IndexedDataset: object_storage_config/s3_config given; only local files are "
                "supported"
            )
        if fast_cache_load:
            raise NotImplementedError(
                "IndexedDataset: fast_cache_load=True is not supported; expected False"
            )
        self.initialize(path_prefix, multimodal, mmap, None, fast_cache_load, None, dtype_code)

    def initialize(
        self,
        path_prefix: str,
        multimodal: bool,
        mmap: bool,
        object_storage_config: Optional[Any] = None,
        fast_cache_load: bool = False,
        sequences_per_dataset: Optional[Tuple[int, int]] = None,
        dtype_code: Optional[int] = None,
    ) -> None:
        """Open the index and the data file (also used when unpickling)."""
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self.object_storage_config = object_storage_config
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"IndexedDataset: path_prefix={path_prefix!r}: {path} does not exist "
                    "(expected a .bin/.idx pair written by IndexedDatasetBuilder)"
                )
        self.index = _IndexReader(idx_path, multimodal)
        self.bin_reader: _BinReader = _MMapBinReader(bin_path) if mmap else _FileBinReader(bin_path)
        needed, size = self.index.data_end(), os.path.getsize(bin_path)
        if size < needed:
            raise ValueError(
                f"{bin_path}: truncated data file: {idx_path} indexes {len(self.index)} "
                f"sequences ending at byte {needed}, the file has {size} bytes"
            )

    def __getstate__(self) -> Tuple[str, bool, bool]:
        return self.path_prefix, self.multimodal, self.mmap

    def __setstate__(self, state: Tuple[str, bool, bool]) -> None:
        self.initialize(*state)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: Union[int, numpy.integer, slice]) -> Any:
        """Sequence ``idx`` (with its mode when multimodal), or a list for a contiguous slice."""
        if isinstance(idx, (int, numpy.integer)):
            pointer, length, mode = self.index[idx]
            sequence = self.bin_reader.read(self.index.dtype, length, pointer)
            return (sequence, mode) if mode is not None else sequence
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"idx={idx}: slices into IndexedDataset must be contiguous")
            lengths = self.index.sequence_lengths[idx]
            if len(lengths) == 0:
                return []
            flat = self.bin_reader.read(
                self.index.dtype, int(numpy.sum(lengths)), int(self.index.sequence_pointers[start])
            )
            sequences = numpy.split(flat, list(accumulate(lengths))[:-1])
            if self.multimodal:
                return sequences, self.index.sequence_modes[idx]
            return sequences
        raise TypeError(f"idx={idx!r}: expected an int or a slice, got {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> Any:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end by default)."""
        pointer, seq_length, mode = self.index[idx]
        if length is None:
            length = seq_length - offset
        if offset < 0 or length < 0 or offset + length > seq_length:
            raise ValueError(
                f"get(idx={idx}, offset={offset}, length={length}): sequence {idx} of "
                f"{self.path_prefix!r} has {seq_length} tokens; expected 0 <= offset and "
                "offset + length <= its length"
            )
        pointer += offset * DType.size(self.index.dtype)
        sequence = self.bin_reader.read(self.index.dtype, length, pointer)
        return (sequence, mode) if mode is not None else sequence

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        """Tokens per sequence (int32)."""
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> numpy.ndarray:
        """Sequence index where each document ends, starting with 0 (int64)."""
        return self.index.document_indices

    def get_document_indices(self) -> numpy.ndarray:
        """Same as ``document_indices``."""
        return self.index.document_indices

    def set_document_indices(self, document_indices: numpy.ndarray) -> None:
        """Replace the document indices (in memory only)."""
        self.index.document_indices = document_indices

    @property
    def sequence_modes(self) -> numpy.ndarray:
        """Per-sequence modes of a multimodal dataset."""
        if self.index.sequence_modes is None:
            raise AttributeError("sequence_modes: this IndexedDataset is not multimodal")
        return self.index.sequence_modes

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both ``<prefix>.idx`` and ``<prefix>.bin`` exist."""
        return os.path.exists(get_idx_path(path_prefix)) and os.path.exists(
            get_bin_path(path_prefix)
        )


class IndexedDatasetBuilder:
    """Write a ``.bin`` as items arrive; ``finalize(idx_path)`` writes the ``.idx``.

    Usage: ``add_item`` per sequence and ``end_document`` after each document (or
    ``add_document`` for a whole document at once), then ``finalize``.
    """

    def __init__(
        self, bin_path: str, dtype: Type[numpy.number] = numpy.int32, multimodal: bool = False
    ) -> None:
        self.data_file = open(bin_path, "wb")
        self.dtype = dtype
        self.multimodal = multimodal
        self.sequence_lengths: List[int] = []
        self.document_indices: List[int] = [0]
        self.sequence_modes: Optional[List[int]] = [] if multimodal else None

    def add_item(self, tensor: torch.Tensor, mode: int = 0) -> None:
        """Append one sequence."""
        array = numpy.asarray(_to_numpy(tensor), dtype=self.dtype)
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(int(array.size))
        if self.sequence_modes is not None:
            self.sequence_modes.append(mode)

    def add_document(
        self, tensor: torch.Tensor, lengths: List[int], modes: Optional[List[int]] = None
    ) -> None:
        """Append a document made of ``len(lengths)`` sequences stored back to back."""
        array = numpy.asarray(_to_numpy(tensor), dtype=self.dtype)
        if int(sum(lengths)) != array.size:
            raise ValueError(
                f"add_document: lengths={list(lengths)} sum to {sum(lengths)}, expected the "
                f"tensor's {array.size} elements"
            )
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.sequence_modes is not None:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def end_document(self) -> None:
        """Close the current document (after ``add_item`` calls)."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every sequence and document of another dataset with the same dtype."""
        index = _IndexReader(get_idx_path(path_prefix), self.multimodal)
        if index.dtype != self.dtype:
            raise ValueError(
                f"add_index: {path_prefix!r} has dtype {numpy.dtype(index.dtype).name}, expected "
                f"{numpy.dtype(self.dtype).name}"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(int(n) for n in index.sequence_lengths)
        self.document_indices.extend(int(d) for d in (offset + index.document_indices)[1:])
        if self.sequence_modes is not None:
            self.sequence_modes.extend(int(m) for m in index.sequence_modes)
        del index
        with open(get_bin_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self.data_file)

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin`` and write the ``.idx``."""
        self.data_file.close()
        _write_index(
            idx_path, self.dtype, self.sequence_lengths, self.sequence_modes, self.document_indices
        )


def get_idx_path(path_prefix: str) -> str:
    """``<prefix>.idx``."""
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """``<prefix>.bin``."""
    return path_prefix + ".bin"


# --------------------------------------------------------------------------- internals


def _to_numpy(tensor: Any) -> numpy.ndarray:
    if isinstance(tensor, torch.Tensor):
        return tensor.detach().cpu().numpy()
    return numpy.asarray(tensor)


def _write_index(
    idx_path: str,
    dtype: Type[numpy.number],
    sequence_lengths: List[int],
    sequence_modes: Optional[List[int]],
    document_indices: List[int],
) -> None:
    lengths = numpy.asarray(sequence_lengths, dtype=numpy.int64)
    pointers = numpy.zeros_like(lengths)
    if lengths.size:
        pointers[1:] = numpy.cumsum(lengths[:-1]) * DType.size(dtype)
    with open(idx_path, "wb") as f:
        f.write(_INDEX_HEADER)
        f.write(struct.pack("<Q", _INDEX_VERSION))
        f.write(struct.pack("<B", DType.code_from_dtype(dtype)))
        f.write(struct.pack("<Q", len(sequence_lengths)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(lengths.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(numpy.asarray(document_indices, dtype="<i8").tobytes(order="C"))
        if sequence_modes is not None:
            f.write(numpy.asarray(sequence_modes, dtype=numpy.int8).tobytes(order="C"))


class _IndexReader:
    """Parse an ``.idx`` file into numpy views over one memory map; every size is checked
    against the file's, so a truncated or corrupt index is an error naming the file."""

    def __init__(self, idx_path: str, multimodal: bool) -> None:
        with open(idx_path, "rb") as f:
            header = f.read(len(_INDEX_HEADER))
            if header != _INDEX_HEADER:
                raise ValueError(
                    f"{idx_path}: header {header!r} is not megatron's index header "
                    f"{_INDEX_HEADER!r}"
                )
            (version,) = struct.unpack("<Q", _read_exact(f, 8, idx_path, "the version"))
            if version != _INDEX_VERSION:
                raise ValueError(f"{idx_path}: index version {version}, expected 1")
            (code,) = struct.unpack("<B", _read_exact(f, 1, idx_path, "the dtype code"))
            if code not in {d.value for d in DType}:
                raise ValueError(
                    f"{idx_path}: dtype code {code} in the header is not a valid DType "
                    f"(expected one of {', '.join(f'{d.value}={d.name}' for d in DType)})"
                )
            self.dtype = DType.dtype_from_code(code)
            self.dtype_size = DType.size(self.dtype)
            counts = _read_exact(f, 16, idx_path, "the sequence and document counts")
            self.sequence_count, self.document_count = struct.unpack("<QQ", counts)
            offset = f.tell()
        s, d = self.sequence_count, self.document_count
        expected = offset + 4 * s + 8 * s + 8 * d + (s if multimodal else 0)
        actual = os.path.getsize(idx_path)
        if actual < expected:
            raise ValueError(
                f"{idx_path}: truncated index: {s} sequences and {d} document boundaries need "
                f"{expected} bytes, the file has {actual}"
            )
        self._mmap = numpy.memmap(idx_path, mode="r", order="C")
        buffer = memoryview(self._mmap)
        self.sequence_lengths = numpy.frombuffer(buffer, numpy.int32, s, offset)
        offset += 4 * s
        self.sequence_pointers = numpy.frombuffer(buffer, numpy.int64, s, offset)
        offset += 8 * s
        self.document_indices = numpy.frombuffer(buffer, numpy.int64, d, offset)
        offset += 8 * d
        self.sequence_modes = (
            numpy.frombuffer(buffer, numpy.int8, s, offset) if multimodal else None
        )
        if d == 0 or self.document_indices[-1] != s:
            raise ValueError(
                f"{idx_path}: document indices end at "
                f"{self.document_indices[-1] if d else None}, expected {s} sequences"
            )
        if s and (self.sequence_lengths.min() < 0 or self.sequence_pointers.min() < 0):
            raise ValueError(f"{idx_path}: negative sequence lengths or pointers")

    def data_end(self) -> int:
        """Bytes the ``.bin`` must hold: the end of the sequence that ends last."""
        if not self.sequence_count:
            return 0
        ends = self.sequence_pointers + self.sequence_lengths.astype(numpy.int64) * self.dtype_size
        return int(ends.max())

    def __len__(self) -> int:
        return self.sequence_count

    def __getitem__(self, idx: int) -> Tuple[int, int, Optional[int]]:
        mode = self.sequence_modes[idx] if self.sequence_modes is not None else None
        return int(self.sequence_pointers[idx]), int(self.sequence_lengths[idx]), mode


def _read_exact(f: Any, count: int, path: str, what: str) -> bytes:
    data = f.read(count)
    if len(data) != count:
        raise ValueError(
            f"{path}: truncated index: {what} needs {count} bytes at offset "
            f"{f.tell() - len(data)}, the file ends after {len(data)}"
        )
    return data


class _BinReader:
    """Reads ``count`` elements at byte ``offset`` of the ``.bin``; a read past the end of the
    file is an error naming the file, the bytes asked for and the file's size."""

    def __init__(self, bin_path: str) -> None:
        self._path = bin_path
        self._size = os.path.getsize(bin_path)

    def read(self, dtype: Type[numpy.number], count: int, offset: int) -> numpy.ndarray:
        end = offset + count * DType.size(dtype)
        if count < 0 or offset < 0 or end > self._size:
            raise ValueError(
                f"{self._path}: truncated or wrong data file: reading {count} tokens at byte "
                f"{offset} needs {end} bytes, the file has {self._size}"
            )
        return self._read(dtype, count, offset)

    def _read(self, dtype: Type[numpy.number], count: int, offset: int) -> numpy.ndarray:
        raise NotImplementedError


class _MMapBinReader(_BinReader):
    """Views into one read-only memory map of the ``.bin``."""

    def __init__(self, bin_path: str) -> None:
        super().__init__(bin_path)
        self._mmap = numpy.memmap(bin_path, mode="r", order="C") if self._size else None
        self._buffer = memoryview(self._mmap) if self._size else memoryview(b"")

    def _read(self, dtype: Type[numpy.number], count: int, offset: int) -> numpy.ndarray:
        return numpy.frombuffer(self._buffer, dtype=dtype, count=count, offset=offset)


class _FileBinReader(_BinReader):
    """Plain file reads (``mmap=False``)."""

    def _read(self, dtype: Type[numpy.number], count: int, offset: int) -> numpy.ndarray:
        out = numpy.empty(count, dtype=dtype)
        with open(self._path, "rb", buffering=0) as f:
            f.seek(offset)
            got = f.readinto(memoryview(out).cast("B"))
        if got != out.nbytes:  # the file shrank since it was opened
            raise ValueError(
                f"{self._path}: read {got} of {out.nbytes} bytes at byte {offset}: the file is "
                "truncated"
            )
        return out
