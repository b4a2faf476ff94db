"""GPT pre-training samples: fixed-length windows over shuffled, concatenated documents.

Three indices decide which tokens sample ``i`` holds (built once, cached as ``.npy`` when a
cache path is set):

- document index: the split's document ids repeated for each epoch and shuffled
  (``numpy.random.RandomState(random_seed)``, the same stream as megatron-core's);
- sample index: ``(document position, offset)`` where each window starts
  (``helpers.build_sample_idx``);
- shuffle index: a permutation of the windows.

A window holds ``sequence_length + 1`` tokens: ``tokens = w[:-1]``, ``labels = w[1:]``.
"""

import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy
import torch

from megatron.core.datasets import helpers
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """megatron-core 0.16.1's GPT dataset config (the fields this project implements).

    ``reset_position_ids``: positions restart at 0 after every end-of-document token.
    ``reset_attention_mask``: tokens after an end-of-document do not attend to tokens up to it.
    ``eod_mask_loss``: positions whose input token is end-of-document get loss weight 0.
    """

    reset_position_ids: Optional[bool] = None
    reset_attention_mask: Optional[bool] = None
    eod_mask_loss: Optional[bool] = None
    create_attention_mask: bool = True
    drop_last_partial_validation_sequence: bool = True
    add_extra_token_to_sequence: bool = True
    object_storage_cache_path: Optional[str] = None
    data_parallel_size: int = 1
    sequence_parallel_size: int = 0
    hybrid_context_parallel: bool = False
    sequences_per_dataset: Optional[Dict[str, int]] = None
    token_dtype_code: Optional[int] = field(init=False, default=None)
    context_parallel_size: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError("GPTDatasetConfig: tokenizer=None; expected a tokenizer")
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(self, name) is None:
                raise ValueError(f"GPTDatasetConfig: {name}=None; expected True or False")
        if self.hybrid_context_parallel:
            raise NotImplementedError("hybrid_context_parallel=True is not supported")
        vocab_size = getattr(self.tokenizer, "vocab_size", None)
        if vocab_size is not None:
            self.token_dtype_code = 4 if vocab_size > numpy.iinfo(numpy.uint16).max + 1 else 8


class GPTDataset(MegatronDataset):
    """One split of an ``IndexedDataset`` as GPT samples (see the module docstring).

    ``ds[i]`` is a dict of ``tokens``, ``labels`` (int64 ``[s]``), ``loss_mask`` (float
    ``[s]``), ``position_ids`` (int64 ``[s]``) and, with ``create_attention_mask``,
    ``attention_mask`` (bool ``[1, s, s]``, True = masked out). ``ds[None]`` is a padding
    sample with an all-zero loss mask.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: Optional[str],
        indexed_indices: numpy.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        super().__init__(
            indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config
        )
        self.masks_and_position_ids_are_cacheable = not any(
            [config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss]
        )
        self._cached_masks: Optional[Tuple] = None
        self.document_index, self.sample_index, self.shuffle_index = (
            self._build_document_sample_shuffle_indices()
        )

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """GPT splits by sequence."""
        return low_level_dataset.sequence_lengths.shape[0]

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        """Open ``dataset_path``'s ``.bin``/``.idx``."""
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        text, _ = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        text = torch.from_numpy(text).long()
        pad = self._pad_token_id
        if self.config.add_extra_token_to_sequence:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = pad

        if self.masks_and_position_ids_are_cacheable and self._cached_masks is not None:
            attention_mask, loss_mask, position_ids = self._cached_masks
            loss_mask = loss_mask.clone()
        else:
            attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
                tokens,
                self.config.tokenizer.eod,
                self.config.reset_position_ids,
                self.config.reset_attention_mask,
                self.config.eod_mask_loss,
                self.config.create_attention_mask,
            )
            if self.masks_and_position_ids_are_cacheable:
                self._cached_masks = (attention_mask, loss_mask.clone(), position_ids)

        loss_mask[labels == pad] = 0.0  # padding never counts
        tokens[tokens == pad] = 0  # keep ids inside the embedding table
        labels[labels == pad] = 0
        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)
        sample = {"tokens": tokens, "labels": labels}
        if self.config.create_attention_mask:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _query_document_sample_shuffle_indices(
        self, idx: int
    ) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """The window's token ids (padded to full length) and the ids of its documents."""
        extra = int(self.config.add_extra_token_to_sequence)
        idx = self.shuffle_index[idx]
        doc_beg, offset_beg = self.sample_index[idx]
        doc_end, offset_end = self.sample_index[idx + 1]
        document_ids, parts = [], []
        for i in range(doc_beg, doc_end + 1):
            document_ids.append(self.document_index[i])
            offset = int(offset_beg) if i == doc_beg else 0
            if i < doc_end:
                length = None
            else:
                length = int(offset_end) + extra - offset
            parts.append(self.dataset.get(self.document_index[i], offset=offset, length=length))
        want = self.config.sequence_length + extra
        have = sum(len(p) for p in parts)
        if have < want:
            parts.append(numpy.full(want - have, self._pad_token_id, dtype=numpy.int64))
        return (
            numpy.concatenate(parts).astype(numpy.int64),
            numpy.array(document_ids, dtype=numpy.int64),
        )

    def _build_document_sample_shuffle_indices(
        self,
    ) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        path_to_cache = self.config.path_to_cache
        if path_to_cache is None and not self.config.mock:
            path_to_cache = os.path.join(
                self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices"
            )
        paths = None
        if path_to_cache:
            base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
            paths = {
                k: os.path.join(path_to_cache, f"{base}-{k}")
                for k in (
                    "description.txt",
                    "document_index.npy",
                    "sample_index.npy",
                    "shuffle_index.npy",
                )
            }
            if all(os.path.isfile(p) for p in paths.values()):
                return tuple(  # type: ignore[return-value]
                    numpy.load(paths[k], allow_pickle=False, mmap_mode="r")
                    for k in ("document_index.npy", "sample_index.npy", "shuffle_index.npy")
                )

        document_index, sample_index, shuffle_index = self._build_indices()
        if paths is not None:
            os.makedirs(path_to_cache, exist_ok=True)
            with open(paths["description.txt"], "wt") as f:
                f.write(self.unique_description)
            for key, array in (
                ("document_index.npy", document_index),
                ("sample_index.npy", sample_index),
                ("shuffle_index.npy", shuffle_index),
            ):
                _atomic_save(paths[key], array)
        return document_index, sample_index, shuffle_index

    def _build_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        seq = self.config.sequence_length
        extra = int(self.config.add_extra_token_to_sequence)
        tokens_per_epoch = self._get_num_tokens_per_epoch()
        num_epochs = self._get_num_epochs(tokens_per_epoch)
        separate_final_epoch = False
        if num_epochs > 1:
            # samples from all but the last epoch; the last epoch is shuffled apart when it
            # contributes less than 80% of an epoch's samples
            before_last = ((num_epochs - 1) * tokens_per_epoch - extra) // seq
            from_last = self.num_samples - before_last
            per_epoch = (tokens_per_epoch - extra) // seq
            separate_final_epoch = from_last < int(0.80 * per_epoch)

        rng = numpy.random.RandomState(self.config.random_seed)
        document_index = _build_document_index(self.indices, num_epochs, rng, separate_final_epoch)
        drop_last = True
        if self.index_split == Split.valid:
            drop_last = self.config.drop_last_partial_validation_sequence
        sample_index = helpers.build_sample_idx(
            numpy.asarray(self.dataset.sequence_lengths),
            document_index,
            seq,
            num_epochs,
            tokens_per_epoch,
            drop_last,
            self.config.add_extra_token_to_sequence,
        )
        total = sample_index.shape[0] - 1
        first = before_last if separate_final_epoch else total
        shuffle_index = _build_shuffle_index(first, total, rng)
        return document_index, sample_index, shuffle_index

    def _get_num_tokens_per_epoch(self) -> int:
        return int(numpy.sum(numpy.asarray(self.dataset.sequence_lengths)[self.indices]))

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        """Smallest number of epochs whose tokens cover ``num_samples * s + extra``."""
        if self.num_samples is None:
            return 1
        if num_tokens_per_epoch <= 0:
            raise ValueError(
                f"{type(self).__name__} {self.index_split.name} split: no tokens, cannot draw "
                f"num_samples={self.num_samples}"
            )
        wanted = self.num_samples * self.config.sequence_length + int(
            self.config.add_extra_token_to_sequence
        )
        return max(1, -(-wanted // num_tokens_per_epoch))


def _build_document_index(
    documents: numpy.ndarray,
    num_epochs: int,
    rng: numpy.random.RandomState,
    separate_final_epoch: bool,
) -> numpy.ndarray:
    """``documents`` repeated ``num_epochs`` times and shuffled (last epoch apart if asked)."""
    if not separate_final_epoch or num_epochs == 1:
        index = numpy.tile(numpy.asarray(documents), num_epochs).astype(numpy.int32)
        rng.shuffle(index)
        return index
    first = _build_document_index(documents, num_epochs - 1, rng, False)
    last = _build_document_index(documents, 1, rng, False)
    return numpy.concatenate((first, last))


def _build_shuffle_index(
    num_samples: int, total_size: int, rng: numpy.random.RandomState
) -> numpy.ndarray:
    """A permutation of ``[0, num_samples)`` followed by one of ``[num_samples, total_size)``."""
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    first = numpy.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return numpy.concatenate((first, last))


def _get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Causal mask (True = masked), loss mask and positions for one sequence ``data`` [s].

    With end-of-document tokens at positions e_1 < e_2 < ...: ``reset_attention_mask`` also
    masks every (query > e_j, key <= e_j) pair; ``reset_position_ids`` makes positions count
    from 0 again at e_j + 1; ``eod_mask_loss`` zeroes the loss where ``data == eod``.
    """
    s = data.numel()
    eods = torch.nonzero(data == eod_token).flatten().tolist()
    loss_mask = torch.ones(s, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(s, dtype=torch.long, device=data.device)
    if reset_position_ids:
        start = 0
        for e in eods:
            position_ids[e + 1 :] -= e + 1 - start
            start = e + 1
    attention_mask = None
    if create_attention_mask:
        allowed = torch.tril(torch.ones((s, s), dtype=torch.bool, device=data.device))
        if reset_attention_mask:
            for e in eods:
                allowed[e + 1 :, : e + 1] = False
        attention_mask = (~allowed).unsqueeze(0)
    return attention_mask, loss_mask, position_ids


def _atomic_save(path: str, array: numpy.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}.npy"
    numpy.save(tmp, numpy.asarray(array), allow_pickle=False)
    os.replace(tmp, path)


class MockGPTLowLevelDataset:
    """Synthetic documents: document ``i`` has length ``L_i`` (seeded, 1 <= L_i < 4096) and
    holds ``1, 2, ..., L_i - 1`` (mod vocab) followed by the end-of-document id.
    """

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eod_token = tokenizer.eod
        rng = numpy.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(
            low=1, high=self.max_sequence_length, size=self.size, dtype=numpy.int32
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> numpy.ndarray:
        length = int(self.sequence_lengths[idx])
        body = (numpy.arange(length - 1, dtype=numpy.int64) + 1) % self.vocab_size
        return numpy.concatenate([body, numpy.array([self.eod_token], dtype=numpy.int64)])

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``idx``."""
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset : offset + length]


class MockGPTDataset(GPTDataset):
    """``GPTDataset`` over ``MockGPTLowLevelDataset`` (config.mock must be True)."""

    def __init__(
        self,
        dataset: MockGPTLowLevelDataset,
        dataset_path: Optional[str],
        indices: numpy.ndarray,
        num_samples: int,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        if not config.mock:
            raise ValueError(
                "MockGPTDataset: config.mock=False (a blend was given); expected a config "
                "without blend/blend_per_split"
            )
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        """Number of mock documents."""
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(
        dataset_path: Optional[str], config: GPTDatasetConfig
    ) -> MockGPTLowLevelDataset:
        """The mock documents for ``config.tokenizer``."""
        return MockGPTLowLevelDataset(config.tokenizer)
