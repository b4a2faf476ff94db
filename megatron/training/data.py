"""The embedded supervised fine-tuning (SFT) data set: generated prompt/response pairs.

Sample i is ``[BOS] p_1 .. p_L [SEP] p_L .. p_1 [EOS] [PAD] ..`` (the response is the prompt
reversed), cut to ``seq_length + 1`` tokens; ``tokens = x[:-1]``, ``labels = x[1:]``. The loss
mask keeps only the response and EOS labels, so the prompt (of random length L) and the
padding are masked out and the valid tokens fall unevenly on context-parallel shards. Every
sample is drawn from its own generator seeded by (seed, i): the data never depends on the
parallel layout, only on ``--seed``.

Padding is not the loss mask. ``padding_mask`` (bool, True = padding) marks the positions
that hold no data: position t holds data when its label ``x[t + 1]`` is a token of the sample
(here t < 2L + 2, the positions ``data_tokens`` counts and packing keeps), so the fill after
the end of a sample, the padding of a packed document to a multiple of 16 and the unused tail
of a packed row are padding, while prompt tokens, masked out of the loss, are data. MoE
layers route data tokens only (docs/moe.md).
"""

import hashlib
import math
from typing import Any, Dict, List, Optional

import torch

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_SYMBOL = 4
MAX_SYMBOLS = 16  # prompt alphabet: tokens FIRST_SYMBOL .. FIRST_SYMBOL + num_symbols - 1

Batch = Dict[str, torch.Tensor]

# --pack-sequences pads every document to a multiple of this. 2C divides it for C in
# {1, 2, 4, 8}, so documents land in the same rows for every layout (the same objective).
PACK_PAD_MULTIPLE = 16


class SFTDataset:
    """An endless, deterministic stream of prompt-masked SFT samples.

    ``dataset[i]`` is a dict of [seq_length] tensors ``tokens``, ``labels``, ``loss_mask``
    (float, 1 on response labels), ``position_ids`` and ``padding_mask`` (bool, True from
    position 2L + 2 on: the positions whose label is padding).
    """

    def __init__(self, seq_length: int, vocab_size: int, seed: int, stream: str = "sft") -> None:
        if seq_length < 4:
            raise ValueError(f"SFTDataset: seq_length must be >= 4, got {seq_length}")
        if vocab_size <= FIRST_SYMBOL:
            raise ValueError(
                f"SFTDataset: vocab_size must be > {FIRST_SYMBOL} (4 special tokens), "
                f"got {vocab_size}"
            )
        self.seq_length, self.vocab_size, self.seed = seq_length, vocab_size, seed
        self.stream = stream  # "sft": the training samples; "sft-valid": held out
        self.num_symbols = min(MAX_SYMBOLS, vocab_size - FIRST_SYMBOL)
        # BOS + L prompt tokens + SEP + L response tokens + EOS fit in seq_length + 1.
        self.max_prompt_length = (seq_length - 2) // 2

    def __getitem__(self, index: int) -> Batch:
        """Sample ``index``: a prompt of length L ~ U{1..max_prompt_length}, its reversal."""
        generator = torch.Generator().manual_seed(_sample_seed(self.seed, index, self.stream))
        length = int(torch.randint(1, self.max_prompt_length + 1, (1,), generator=generator))
        prompt = torch.randint(
            FIRST_SYMBOL, FIRST_SYMBOL + self.num_symbols, (length,), generator=generator
        )
        sequence = torch.full((self.seq_length + 1,), PAD, dtype=torch.long)
        body = torch.cat(
            [
                torch.tensor([BOS]),
                prompt,
                torch.tensor([SEP]),
                prompt.flip(0),
                torch.tensor([EOS]),
            ]
        )
        sequence[: body.numel()] = body
        # Label t is x[t + 1]; the response and EOS occupy x[L + 2 .. 2L + 2].
        positions = torch.arange(self.seq_length)
        loss_mask = ((positions >= length + 1) & (positions <= 2 * length + 1)).float()
        return {
            "tokens": sequence[:-1].clone(),
            "labels": sequence[1:].clone(),
            "loss_mask": loss_mask,
            "position_ids": positions,
            "padding_mask": positions >= 2 * length + 2,
        }

    def data_tokens(self, iteration: int, global_batch_size: int) -> int:
        """Positions of the ``iteration``-th global batch that hold data (BOS .. the EOS
        label, 2L + 2 per sample), not padding."""
        start = iteration * global_batch_size
        return sum(
            int(self[i]["loss_mask"].nonzero().max()) + 1
            for i in range(start, start + global_batch_size)
        )

    def global_batch(self, iteration: int, global_batch_size: int) -> Batch:
        """The ``iteration``-th global batch (0-based): samples [i * GBS, (i + 1) * GBS),
        stacked to [GBS, seq_length] tensors."""
        start = iteration * global_batch_size
        samples = [self[start + i] for i in range(global_batch_size)]
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def microbatches_for_rank(
    global_batch: Batch, micro_batch_size: int, num_microbatches: int, dp_rank: int
) -> List[Batch]:
    """The M microbatches of data-parallel replica d: microbatch (d, m) holds samples
    [g * b, (g + 1) * b) of the global batch, g = d * M + m.

    The grouping of samples into microbatches is the same for every layout with the same
    micro batch size b, so every layout trains the same objective.
    """
    microbatches = []
    for m in range(num_microbatches):
        g = dp_rank * num_microbatches + m
        rows = slice(g * micro_batch_size, (g + 1) * micro_batch_size)
        microbatches.append({key: value[rows] for key, value in global_batch.items()})
    return microbatches


def _sample_seed(seed: int, index: int, stream: str = "sft") -> int:
    """A 63-bit generator seed for sample ``index`` of the stream of ``seed``."""
    digest = hashlib.sha256(f"{stream}/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class PackedRows:
    """Rows packed on demand by ``_pack_row`` (None once the stream has ended) and kept:
    ``dataset[i]``, ``all_rows`` of a finite stream, ``global_batch``; ``items`` names what
    is packed in the error past the end."""

    items = "documents"
    _rows: List[Batch]

    def _pack_row(self) -> Optional[Batch]:
        raise NotImplementedError

    def __getitem__(self, index: int) -> Batch:
        while len(self._rows) <= index:
            row = self._pack_row()
            if row is None:
                raise IndexError(f"{type(self).__name__}: no {self.items} left for row {index}")
            self._rows.append(row)
        return self._rows[index]

    def all_rows(self) -> List[Batch]:
        """Every row of a finite stream (one whose source returns None past its end), in
        order."""
        while True:
            row = self._pack_row()
            if row is None:
                return list(self._rows)
            self._rows.append(row)

    def global_batch(self, iteration: int, global_batch_size: int) -> Batch:
        """Rows [i * GBS, (i + 1) * GBS) stacked to [GBS, ...] tensors."""
        start = iteration * global_batch_size
        rows = [self[start + i] for i in range(global_batch_size)]
        return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}


def padding_row(length: int, pad: int = PAD) -> Batch:
    """A row of ``length`` padding positions (``padding_mask`` True, loss mask 0, positions
    0) that packing fills."""
    return {
        "tokens": torch.full((length,), pad, dtype=torch.long),
        "labels": torch.full((length,), pad, dtype=torch.long),
        "loss_mask": torch.zeros(length),
        "position_ids": torch.zeros(length, dtype=torch.long),
        "padding_mask": torch.ones(length, dtype=torch.bool),
    }


def set_document_bounds(row: Batch, real: List[int], padded: List[int], slots: int) -> Batch:
    """``row``'s ``cu_seqlens`` / ``cu_seqlens_padded`` from the documents' cumulative real /
    padded lengths, the last repeated up to ``slots + 1`` entries, and ``max_seqlen``."""
    fill = slots + 1 - len(real)
    row["cu_seqlens"] = torch.tensor(real + real[-1:] * fill, dtype=torch.int32)
    row["cu_seqlens_padded"] = torch.tensor(padded + padded[-1:] * fill, dtype=torch.int32)
    longest = max(b - a for a, b in zip(padded[:-1], padded[1:]))
    row["max_seqlen"] = torch.tensor([longest], dtype=torch.int32)
    return row


class PackedSFTDataset(PackedRows):
    """``--pack-sequences``: SFT documents packed into rows of ``seq_length`` tokens
    (megatron-core's THD format, one row per microbatch).

    The documents come from ``documents.document(j)`` (``tokens``, ``labels``, ``loss_mask``
    of one unpadded document, at most ``seq_length`` positions), by default the generated
    samples of ``SFTDataset`` (document j is sample j's real part: its 2L + 2 tokens and
    labels, prompt masked); ``FileSFTDataset`` supplies file records the same way. Each
    document is appended to the current row, padded with PAD to a multiple of
    ``PACK_PAD_MULTIPLE``; a document that does not fit starts the next row, and the rest of a
    row is padding; an empty document (one token, no label) is skipped.
    ``dataset[i]`` has [seq_length] ``tokens``, ``labels``, ``loss_mask`` (0 on prompts and
    padding), ``position_ids`` (restarting at 0 in every document) and ``padding_mask``
    (bool, True outside the documents' real positions: each document's padding to a
    multiple of 16 and the rest of the row), plus
    ``cu_seqlens`` / ``cu_seqlens_padded`` (cumulative real / padded lengths, int32,
    [seq_length / 16 + 1], the last value repeated past the row's last document) and
    ``max_seqlen`` [1] (the longest padded document).
    """

    def __init__(
        self, seq_length: int, vocab_size: int, seed: int, documents: Optional[Any] = None
    ) -> None:
        if seq_length % PACK_PAD_MULTIPLE:
            raise ValueError(
                f"PackedSFTDataset: seq_length must be a multiple of {PACK_PAD_MULTIPLE}, "
                f"got {seq_length}"
            )
        self.documents = (
            documents
            if documents is not None
            else _GeneratedDocuments(SFTDataset(seq_length, vocab_size, seed))
        )
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.notes: List[str] = list(getattr(self.documents, "notes", []))
        self.max_documents = seq_length // PACK_PAD_MULTIPLE
        self._rows: List[Batch] = []
        self._next_document = 0

    def data_tokens(self, iteration: int, global_batch_size: int) -> int:
        """Positions of the rows of the ``iteration``-th global batch that hold document
        tokens (the documents' real lengths), not padding."""
        start = iteration * global_batch_size
        return sum(int(self[i]["cu_seqlens"][-1]) for i in range(start, start + global_batch_size))

    def _pack_row(self) -> Optional[Batch]:
        s = self.seq_length
        row = padding_row(s)
        real, padded = [0], [0]
        while True:
            document = self.documents.document(self._next_document)
            if document is None:  # a finite set of documents (validation) has ended
                break
            length = int(document["tokens"].numel())
            if length == 0:
                self._next_document += 1
                continue
            if length > s:
                raise ValueError(
                    f"PackedSFTDataset: document {self._next_document} has {length} positions, "
                    f"more than seq_length {s}"
                )
            padded_length = math.ceil(length / PACK_PAD_MULTIPLE) * PACK_PAD_MULTIPLE
            start = padded[-1]
            if start + padded_length > s:
                break
            for key in ("tokens", "labels", "loss_mask"):
                row[key][start : start + length] = document[key]
            row["padding_mask"][start : start + length] = False
            row["position_ids"][start : start + padded_length] = torch.arange(padded_length)
            real.append(real[-1] + length)
            padded.append(start + padded_length)
            self._next_document += 1
        if len(real) == 1:
            return None
        return set_document_bounds(row, real, padded, self.max_documents)


def empty_sample(seq_length: int, packed: bool, pad: int = PAD) -> Batch:
    """A sample with no trained token (fills a last, partial validation batch): padding
    (``padding_mask`` all True), loss mask 0; packed, it is one document of ``seq_length``
    padding positions."""
    sample = padding_row(seq_length, pad)
    sample["position_ids"] = torch.arange(seq_length)
    if packed:
        bounds = [0] + [seq_length] * (seq_length // PACK_PAD_MULTIPLE)
        sample["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
        sample["cu_seqlens_padded"] = torch.tensor(bounds, dtype=torch.int32)
        sample["max_seqlen"] = torch.tensor([seq_length], dtype=torch.int32)
    return sample


class _GeneratedDocuments:
    """Document j of the generated data: sample j up to its EOS label (2L + 2 positions)."""

    def __init__(self, samples: SFTDataset) -> None:
        self.samples = samples

    def document(self, index: int) -> Batch:
        sample = self.samples[index]
        length = int(sample["loss_mask"].nonzero().max()) + 1
        return {key: sample[key][:length] for key in ("tokens", "labels", "loss_mask")}
