"""The configuration shared by every megatron dataset (blend, split, cache, tokenizer)."""

import re
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from megatron.core.datasets.utils import Split, normalize


@dataclass
class BlendedMegatronDatasetConfig:
    """megatron-core 0.16.1's dataset config.

    With neither ``blend`` nor ``blend_per_split`` the datasets are mock ones (``mock`` is set
    and ``split`` becomes ``"1,1,1"``). ``split`` such as ``"99,1,0"`` gives each split a
    contiguous share of the documents (``split_matrix`` holds the book-ends).
    """

    random_seed: int
    sequence_length: int
    blend: Optional[Tuple[List[str], Optional[List[float]]]] = None
    blend_per_split: Optional[List[Optional[Tuple[List[str], Optional[List[float]]]]]] = None
    multiple_validation_sets: Optional[bool] = None
    full_validation: Optional[bool] = None
    split: Optional[str] = None
    split_matrix: Optional[List[Optional[Tuple[float, float]]]] = field(init=False, default=None)
    num_dataset_builder_threads: int = 1
    path_to_cache: Optional[str] = None
    mmap_bin_files: bool = True
    mock: bool = field(init=False, default=False)
    tokenizer: Optional[Any] = None
    mid_level_dataset_surplus: float = 0.005
    allow_ambiguous_pad_tokens: Optional[bool] = False
    fast_cache_load: bool = False
    defer_npy_index_mmap: bool = False

    def __post_init__(self) -> None:
        if self.fast_cache_load or self.defer_npy_index_mmap:
            raise NotImplementedError(
                f"fast_cache_load={self.fast_cache_load}, defer_npy_index_mmap="
                f"{self.defer_npy_index_mmap}: not supported here; expected False"
            )
        if self.sequence_length is None or int(self.sequence_length) < 2:
            raise ValueError(f"sequence_length={self.sequence_length!r}: expected an int >= 2")
        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None or self.split is not None:
                raise ValueError(
                    f"blend_per_split given together with blend={self.blend!r} / "
                    f"split={self.split!r}: expected only blend_per_split"
                )
            if len(self.blend_per_split) != len(Split):
                raise ValueError(
                    f"blend_per_split has {len(self.blend_per_split)} entries, expected "
                    f"{len(Split)} (train, valid, test)"
                )
            for blend in self.blend_per_split:
                _check_blend("blend_per_split", blend)
            return
        if self.blend is not None:
            _check_blend("blend", self.blend)
            if self.split is None:
                raise ValueError("split=None with a blend: expected a split such as '99,1,0'")
        else:
            self.mock = True
            self.split = "1,1,1"
        self.split_matrix = convert_split_vector_to_split_matrix(
            parse_and_normalize_split(self.split)
        )


def parse_and_normalize_split(split: str) -> List[float]:
    """``"99,1,0"`` -> ``[0.99, 0.01, 0.0]`` (missing entries are 0)."""
    values = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if len(values) > len(Split) or any(v < 0 for v in values):
        raise ValueError(f"split={split!r}: expected up to 3 non-negative weights")
    values += [0.0] * (len(Split) - len(values))
    return normalize(values)


def convert_split_vector_to_split_matrix(
    vector_a: List[float], vector_b: Optional[List[float]] = None
) -> List[Optional[Tuple[float, float]]]:
    """Book-ends ``(start, end)`` per split, the overlap of two split vectors (None if empty).

    ``[0.99, 0.01, 0.0]`` -> ``[(0, 0.99), (0.99, 1.0), None]``.
    """

    def bookends(vector: List[float]) -> List[Tuple[float, float]]:
        edges = [0.0]
        for v in vector:
            edges.append(edges[-1] + v)
        return list(zip(edges[:-1], edges[1:]))

    a = bookends(vector_a)
    b = bookends(vector_a if vector_b is None else vector_b)
    matrix: List[Optional[Tuple[float, float]]] = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        matrix.append(None if hi <= lo else (lo, hi))
    return matrix


def _check_blend(name: str, blend: Any) -> None:
    if blend is None:
        return
    prefixes, weights = blend
    if weights is not None and len(weights) != len(prefixes):
        raise ValueError(
            f"{name}: {len(prefixes)} prefixes but {len(weights)} weights; expected equal numbers"
        )
