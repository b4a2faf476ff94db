"""Build the train/valid/test datasets from a config: mock, one prefix, or a weighted blend.

Distributed use: call ``build()`` on every rank. Ranks where ``is_built_on_rank()`` is False
get ``None``. Rank 0 builds first (and writes any index cache), the others after a barrier,
so they read the cache rather than race to write it.
"""

import math
from typing import Any, Callable, List, Optional, Type, Union

import numpy
import torch

from megatron.core.communication import barrier, world_group
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, normalize

MidLevelDataset = MegatronDataset
TopLevelDataset = Union[BlendedDataset, MidLevelDataset]


class BlendedMegatronDatasetBuilder:
    """Builder of ``cls`` datasets (a ``MegatronDataset`` subclass) for each split.

    Args:
        cls: the mid-level dataset class, e.g. ``GPTDataset`` or ``MockGPTDataset``.
        sizes: samples wanted per split (train, valid, test); None = one epoch.
        is_built_on_rank: whether this rank needs the datasets.
        config: the ``BlendedMegatronDatasetConfig``.
    """

    def __init__(
        self,
        cls: Type[MidLevelDataset],
        sizes: List[int],
        is_built_on_rank: Callable,
        config: BlendedMegatronDatasetConfig,
    ):
        if len(sizes) != len(Split):
            raise ValueError(f"sizes={sizes}: expected {len(Split)} entries (train, valid, test)")
        self.cls = cls
        self.sizes = sizes
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        if not config.mock:
            for split in Split:
                blend = (
                    config.blend
                    if config.blend_per_split is None
                    else (config.blend_per_split[split.value])
                )
                if blend is None:
                    continue
                if sizes[split.value] is None and blend[1] is not None:
                    raise ValueError(
                        f"sizes[{split.value}]=None for the {split.name} split with blend "
                        f"weights {blend[1]}: weighted blends need a size"
                    )

    def build(self) -> List[Optional[TopLevelDataset]]:
        """One dataset (or None) per split: mid-level for a single prefix or mock data,
        ``BlendedDataset`` for several prefixes."""
        config = self.config
        if config.mock:
            return self._build_splits(None, config.split_matrix, self.sizes)
        if config.blend:
            prefixes, weights = config.blend
            return self._build_blend(prefixes, weights, config.split_matrix, self.sizes)
        datasets: List[Optional[TopLevelDataset]] = [None] * len(Split)
        for i in range(len(Split)):
            blend = config.blend_per_split[i]
            if blend is None:
                continue
            spoof_split: List[Any] = [None] * len(Split)
            spoof_split[i] = (0.0, 1.0)
            spoof_sizes: List[Any] = [0] * len(Split)
            spoof_sizes[i] = self.sizes[i]
            prefixes, weights = blend
            if config.multiple_validation_sets and i == Split.valid.value and len(prefixes) > 1:
                datasets[i] = [  # type: ignore[assignment]
                    self._build_splits(p, spoof_split, spoof_sizes)[i] for p in prefixes
                ]
                continue
            datasets[i] = self._build_blend(prefixes, weights, spoof_split, spoof_sizes)[i]
        return datasets

    # ------------------------------------------------------------------ internals

    def _build_blend(
        self,
        prefixes: List[str],
        weights: Optional[List[float]],
        split: List[Any],
        sizes: List[Optional[int]],
    ) -> List[Optional[TopLevelDataset]]:
        if len(prefixes) == 1 and weights is None:
            return self._build_splits(prefixes[0], split, sizes)
        if weights is not None:
            weights = normalize(weights)
            target = _get_size_per_split_per_dataset(weights, sizes)
            buffer = _get_size_per_split_per_dataset(
                weights, sizes, surplus=self.config.mid_level_dataset_surplus
            )
        else:
            buffer = [[None] * len(Split) for _ in prefixes]
        per_prefix = self._build_all_prefixes(prefixes, split, buffer)
        blended: List[Optional[TopLevelDataset]] = [None] * len(Split)
        for i in range(len(Split)):
            if split[i] is None:
                continue
            mids = [per_prefix[p][i] for p in range(len(prefixes))]
            if weights is not None and sizes[i] is not None:
                w_i: List[Any] = weights
                size_i: Optional[int] = sum(row[i] for row in target)
            elif weights is None:
                try:
                    w_i = [len(d) for d in mids]
                except TypeError:  # not built on this rank
                    w_i = [0 for _ in prefixes]
                size_i = None if sizes[i] is None else min(sizes[i], sum(w_i))
            else:
                raise ValueError(
                    f"sizes[{i}]=None with blend weights {weights}: weighted blends need a size"
                )
            blended[i] = self._build_generic(BlendedDataset, mids, w_i, size_i, self.config)
        return blended

    def _build_all_prefixes(
        self, prefixes: List[str], split: List[Any], sizes_per_dataset: List[List[Any]]
    ) -> List[List[Optional[MidLevelDataset]]]:
        distributed = torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        out: List[List[Optional[MidLevelDataset]]] = [[] for _ in prefixes]
        if rank == 0:
            for p, prefix in enumerate(prefixes):
                out[p] = self._build_splits(prefix, split, sizes_per_dataset[p], sync=False)
        if distributed:
            barrier(world_group())
        if rank != 0:
            for p, prefix in enumerate(prefixes):
                out[p] = self._build_splits(prefix, split, sizes_per_dataset[p], sync=False)
        return out

    def _build_splits(
        self,
        dataset_path: Optional[str],
        split: List[Any],
        sizes: List[Optional[int]],
        sync: bool = True,
    ) -> List[Optional[MidLevelDataset]]:
        """Every split of one low-level dataset (``None`` where the split is empty)."""
        if torch.distributed.is_initialized() and not self.is_built_on_rank():
            for i in range(len(Split)):
                if split[i] is not None and sync:
                    barrier(world_group())
            return [None] * len(Split)
        low_level = self.cls.build_low_level_dataset(dataset_path, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level)
        datasets: List[Optional[MidLevelDataset]] = []
        for i, split_name in enumerate(Split):
            if split[i] is None:
                datasets.append(None)
                continue
            beg = int(round(split[i][0] * float(num_elements)))
            end = int(round(split[i][1] * float(num_elements)))
            indices = numpy.arange(beg, end, dtype=numpy.int32)
            datasets.append(
                self._build_generic(
                    self.cls,
                    low_level,
                    dataset_path,
                    indices,
                    sizes[i],
                    split_name,
                    self.config,
                    sync=sync,
                )
            )
        return datasets

    def _build_generic(self, cls: Callable, *args: Any, sync: bool = True) -> Optional[Any]:
        """``cls(*args)``: on rank 0 first, then (after a barrier) on the other ranks."""
        return self.build_generic_dataset(cls, self.is_built_on_rank, sync, *args)

    @staticmethod
    def build_generic_dataset(
        cls: Union[Type[Any], Callable],
        is_built_on_rank: Callable,
        synchronize_ranks: bool,
        *args: Any,
    ) -> Optional[Any]:
        """Build ``cls(*args)`` where ``is_built_on_rank()``; rank 0 first when distributed."""
        if not torch.distributed.is_initialized():
            return cls(*args)
        rank = torch.distributed.get_rank()
        dataset = None
        if rank == 0 and is_built_on_rank():
            try:
                dataset = cls(*args)
            except OSError as err:
                raise RuntimeError(
                    "Could not write the dataset index cache; set path_to_cache in the dataset "
                    "config to a writable directory"
                ) from err
        if synchronize_ranks:
            barrier(world_group())
        if rank != 0 and is_built_on_rank():
            dataset = cls(*args)
        return dataset


def _get_size_per_split_per_dataset(
    normalized_weights: List[float],
    target_size_per_split: List[Optional[int]],
    surplus: float = 0.0,
) -> List[List[int]]:
    """Samples to request per dataset per split: ``ceil(ceil(size * w) * (1 + surplus))``."""
    if not numpy.isclose(sum(normalized_weights), 1.0):
        raise ValueError(f"weights={normalized_weights}: expected them to sum to 1")
    return [
        [int(math.ceil(math.ceil(size * weight) * (1 + surplus))) for size in target_size_per_split]
        for weight in normalized_weights
    ]
