"""A weighted mixture of mid-level datasets."""

import hashlib
import json
import os
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple, Union

import numpy
import torch

from megatron.core.datasets import helpers
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import normalize


class BlendedDataset(torch.utils.data.Dataset):
    """Sample ``i`` comes from dataset ``dataset_index[i]``, its ``dataset_sample_index[i]``-th.

    With ``size`` the weights are normalised and sample ``i`` goes to the dataset lagging most
    behind its share (``w_k * i - n_k``); with ``size=None`` dataset ``k`` contributes exactly
    ``weights[k]`` samples. Items are the dataset's dict plus ``dataset_id``.
    """

    def __init__(
        self,
        datasets: List[MegatronDataset],
        weights: List[Union[int, float]],
        size: Optional[int],
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(
                f"BlendedDataset: {len(datasets)} datasets and {len(weights)} weights; expected "
                "equal, non-zero numbers"
            )
        if len(datasets) >= 32767:
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets, expected < 32767")
        if any(type(d) is not type(datasets[0]) for d in datasets) or any(
            d.index_split != datasets[0].index_split for d in datasets
        ):
            raise ValueError("BlendedDataset: datasets must share one class and one split")
        if any(w <= 0 for w in weights):
            raise ValueError(f"BlendedDataset: weights={list(weights)}, expected all > 0")
        if size is None and any(float(w) != int(w) for w in weights):
            raise ValueError(
                f"BlendedDataset: size=None needs integer sample counts as weights, got {weights}"
            )
        if size is not None:
            weights = normalize(weights)
        self.datasets = datasets
        self.split = datasets[0].index_split
        self.weights = weights
        self.size = size
        self.config = config

        identifiers = OrderedDict()
        identifiers["class"] = type(self).__name__
        identifiers["datasets"] = [d.unique_identifiers for d in datasets]
        identifiers["split"] = self.split.name
        identifiers["weights"] = self.weights
        identifiers["size"] = self.size
        self.unique_description = json.dumps(
            identifiers, indent=4, default=lambda o: getattr(o, "unique_identifiers", repr(o))
        )
        self.unique_description_hash = hashlib.md5(
            self.unique_description.encode("utf-8")
        ).hexdigest()
        self.dataset_index, self.dataset_sample_index = self._build_indices()

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> Dict[str, Union[int, numpy.ndarray]]:
        dataset_id = self.dataset_index[idx]
        sample_id = self.dataset_sample_index[idx]
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][sample_id]}

    def _build_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray]:
        cache = self.config.path_to_cache
        if cache:
            base = os.path.join(
                cache, f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}"
            )
            index_path = f"{base}-dataset_index.npy"
            sample_path = f"{base}-dataset_sample_index.npy"
            if os.path.isfile(index_path) and os.path.isfile(sample_path):
                return (
                    numpy.load(index_path, allow_pickle=False, mmap_mode="r"),
                    numpy.load(sample_path, allow_pickle=False, mmap_mode="r"),
                )

        if self.size is not None:
            dataset_index = numpy.zeros(self.size, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(self.size, dtype=numpy.int64)
            helpers.build_blending_indices(
                dataset_index,
                dataset_sample_index,
                numpy.asarray(self.weights, dtype=numpy.float64),
                len(self.datasets),
                self.size,
                False,
            )
        else:
            total = int(sum(self.weights))
            dataset_index = numpy.zeros(total, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(total, dtype=numpy.int64)
            helpers.build_exhaustive_blending_indices(
                dataset_index,
                dataset_sample_index,
                numpy.asarray(self.weights, dtype=numpy.int64),
                len(self.datasets),
            )
        ids, counts = numpy.unique(dataset_index, return_counts=True)
        for k, count in zip(ids, counts):
            if len(self.datasets[k]) < count:
                raise IndexError(
                    f"The {self.split.name} blend requests {count} samples from dataset {k}, "
                    f"which has {len(self.datasets[k])}; raise mid_level_dataset_surplus "
                    f"(now {self.config.mid_level_dataset_surplus})"
                )
        if cache:
            os.makedirs(cache, exist_ok=True)
            with open(f"{base}-description.txt", "wt") as f:
                f.write(self.unique_description)
            for path, array in ((index_path, dataset_index), (sample_path, dataset_sample_index)):
                tmp = f"{path}.tmp{os.getpid()}.npy"
                numpy.save(tmp, array, allow_pickle=False)
                os.replace(tmp, path)
        return dataset_index, dataset_sample_index
