"""The base of the mid-level datasets (one split of one low-level dataset)."""

import hashlib
import json
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Union

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split

LowLevelDataset = Union[IndexedDataset, Iterable]

_PAD_TOKEN_ID = -1


class MegatronDataset(ABC, torch.utils.data.Dataset):
    """A split of a low-level dataset, drawing ``num_samples`` samples (one epoch if None).

    ``unique_description`` (JSON of the identifying config) and its md5 name the cached
    indices. The pad id is the tokenizer's ``pad`` unless it collides with another special
    token (then -1, so no real token is masked as padding; ``allow_ambiguous_pad_tokens``
    keeps the collision with a warning).
    """

    def __init__(
        self,
        dataset: LowLevelDataset,
        dataset_path: Optional[str],
        indices: numpy.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config

        self.unique_identifiers: Dict[str, Any] = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["dataset_path"] = self.dataset_path
        self.unique_identifiers["num_samples"] = self.num_samples
        self.unique_identifiers["index_split"] = self.index_split.name
        for attr in self._key_config_attributes():
            self.unique_identifiers[attr] = getattr(self.config, attr)
        self.unique_description = json.dumps(
            self.unique_identifiers, indent=4, default=_identifiers_of
        )
        self.unique_description_hash = hashlib.md5(
            self.unique_description.encode("utf-8")
        ).hexdigest()
        self._pad_token_id = self._resolve_pad_token_id()

    def _resolve_pad_token_id(self) -> int:
        tokenizer = self.config.tokenizer
        try:
            pad = tokenizer.pad
        except Exception:  # tokenizers without a pad id raise AttributeError/NotImplementedError
            return _PAD_TOKEN_ID
        specials: List[int] = []
        try:
            specials = [v for k, v in tokenizer.special_tokens_dict.items() if k != "pad_token"]
        except (AttributeError, IndexError, ValueError):
            specials = []
        if not specials:
            for name in ("eos", "eod"):
                try:
                    specials.append(getattr(tokenizer, name))
                except (AttributeError, NotImplementedError):
                    pass
        if pad in specials:
            warnings.warn(
                "The tokenizer's pad id collides with another special token id"
                + (
                    "; keeping it (allow_ambiguous_pad_tokens=True)."
                    if self.config.allow_ambiguous_pad_tokens
                    else "; no token will be masked as padding."
                ),
                stacklevel=2,
            )
            if not self.config.allow_ambiguous_pad_tokens:
                return _PAD_TOKEN_ID
        return pad

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: LowLevelDataset) -> int:
        """Number of elements the train/valid/test split divides."""
        raise NotImplementedError

    @staticmethod
    def build_low_level_dataset(
        dataset_path: str, config: BlendedMegatronDatasetConfig
    ) -> LowLevelDataset:
        """Open the low-level dataset at ``dataset_path``."""
        raise NotImplementedError

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __getitem__(self, idx: int) -> Dict[str, Union[torch.Tensor, numpy.ndarray]]: ...


def _identifiers_of(obj: Any) -> Any:
    ids = getattr(obj, "unique_identifiers", None)
    if ids is not None:
        return ids
    return repr(obj)
