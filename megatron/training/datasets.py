"""SFT data read from files: JSONL (prompt/response or text) or megatron's indexed format.

``--data-path`` is either

- a ``.jsonl`` file: one record per line with ``prompt`` and ``response`` strings (the
  prompt is masked out of the loss) or a ``text`` string (every token trained), tokenized
  when the job starts; or
- the prefix of an indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``) written by
  ``python -m megatron.training.preprocess_data``: a document of two sequences is
  (prompt, response), a document of one sequence is all trained.

Sample ``i`` is record ``perm_e[i mod R]`` of epoch ``e = i div R`` (``perm_e``: a permutation
drawn from ``(seed, e)``), laid out as ``prompt + response + [EOD]``, cut or padded to
``seq_length + 1`` tokens; ``tokens = x[:-1]``, ``labels = x[1:]``; the loss mask keeps the
labels that are response tokens or the EOD. As with the generated data, nothing depends on
the parallel layout.
"""

import json
import os
from typing import Any, Dict, List, Tuple

import numpy
import torch

from megatron.training.data import Batch, PackedSFTDataset, SFTDataset

BYTE_LEVEL = "byte-level"


def build_sft_dataset(config: Any):
    """The generated ``SFTDataset`` without ``--data-path`` (``PackedSFTDataset`` with
    ``--pack-sequences``), else a ``FileSFTDataset``."""
    if config.pack_sequences:
        return PackedSFTDataset(config.seq_length, config.vocab_size, config.seed)
    if not config.data_path:
        return SFTDataset(config.seq_length, config.vocab_size, config.seed)
    return FileSFTDataset(config.data_path, config.tokenizer, config.seq_length, config.seed)


def build_training_tokenizer(tokenizer: Any):
    """``None`` / ``"byte-level"``: UTF-8 bytes (no file); else a HuggingFace ``tokenizers``
    JSON file."""
    from types import SimpleNamespace

    from megatron.training.tokenizer.tokenizer import build_tokenizer

    if tokenizer in (None, BYTE_LEVEL):
        return build_tokenizer(SimpleNamespace(tokenizer_type="ByteLevelTokenizer"))
    if not os.path.isfile(tokenizer):
        raise ValueError(
            f"--tokenizer {tokenizer!r}: expected 'byte-level' or a tokenizers JSON file"
        )
    return build_tokenizer(
        SimpleNamespace(tokenizer_type="TokenizersFile", tokenizer_model=tokenizer)
    )


class FileSFTDataset:
    """Prompt-masked samples from a JSONL file or an indexed dataset (module docstring)."""

    def __init__(self, data_path: str, tokenizer: Any, seq_length: int, seed: int) -> None:
        self.tokenizer = build_training_tokenizer(tokenizer)
        self.seq_length, self.seed = seq_length, seed
        self.eod, self.pad = self.tokenizer.eod, self.tokenizer.pad
        self.vocab_size = self.tokenizer.vocab_size
        if data_path.endswith(".jsonl") or data_path.endswith(".json"):
            self.records = _read_jsonl(data_path, self.tokenizer)
        else:
            self.records = _read_indexed(data_path, self.eod)
        if not self.records:
            raise ValueError(f"--data-path {data_path!r}: no records")
        top = max(int(max(p.max(initial=0), r.max(initial=0))) for p, r in self.records)
        if top >= self.vocab_size:
            raise ValueError(
                f"--data-path {data_path!r} holds token id {top}, outside the tokenizer's "
                f"vocabulary of {self.vocab_size} (was it written with another --tokenizer?)"
            )
        self._perms: Dict[int, List[int]] = {}

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Batch:
        epoch, k = divmod(index, len(self.records))
        prompt, response = self.records[self._perm(epoch)[k]]
        body = numpy.concatenate([prompt, response, [self.eod]]).astype(numpy.int64)
        x = torch.full((self.seq_length + 1,), self.pad, dtype=torch.long)
        n = min(body.size, self.seq_length + 1)
        x[:n] = torch.from_numpy(body[:n])
        positions = torch.arange(self.seq_length)
        # label t is x[t + 1]; train on labels inside the body that follow the prompt
        loss_mask = ((positions + 1 >= prompt.size) & (positions + 1 < n)).float()
        return {
            "tokens": x[:-1].clone(),
            "labels": x[1:].clone(),
            "loss_mask": loss_mask,
            "position_ids": positions,
        }

    def global_batch(self, iteration: int, global_batch_size: int) -> Batch:
        """Samples ``[iteration * GBS, (iteration + 1) * GBS)`` stacked to [GBS, s] tensors."""
        start = iteration * global_batch_size
        samples = [self[start + i] for i in range(global_batch_size)]
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}

    def _perm(self, epoch: int) -> List[int]:
        if epoch not in self._perms:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(len(self.records), generator=generator).tolist()
        return self._perms[epoch]


def _read_jsonl(path: str, tokenizer: Any) -> List[Tuple[numpy.ndarray, numpy.ndarray]]:
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "prompt" in record and "response" in record:
                prompt, response = record["prompt"], record["response"]
            elif "text" in record:
                prompt, response = "", record["text"]
            else:
                raise ValueError(
                    f"{path}:{line_no}: keys {sorted(record)}; expected 'prompt' and "
                    "'response', or 'text'"
                )
            records.append((_ids(tokenizer.tokenize(prompt)), _ids(tokenizer.tokenize(response))))
    return records


def _read_indexed(prefix: str, eod: int) -> List[Tuple[numpy.ndarray, numpy.ndarray]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    bounds = dataset.document_indices
    records = []
    for d in range(len(bounds) - 1):
        parts = [
            numpy.asarray(dataset[i], dtype=numpy.int64) for i in range(bounds[d], bounds[d + 1])
        ]
        if len(parts) == 2:
            prompt, response = parts
        elif len(parts) == 1:
            prompt, response = numpy.zeros(0, dtype=numpy.int64), parts[0]
        else:
            raise ValueError(
                f"--data-path {prefix!r}: document {d} has {len(parts)} sequences; expected 1 "
                "(text) or 2 (prompt, response)"
            )
        if response.size and response[-1] == eod:  # the tool appends the EOD; we add it
            response = response[:-1]
        records.append((prompt, response))
    return records


def _ids(ids: Any) -> numpy.ndarray:
    return numpy.asarray(list(ids), dtype=numpy.int64)
