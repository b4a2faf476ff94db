"""Preference pairs for ``--dpo``: TRL's preference JSONL, or generated pairs.

``--data-path FILE.jsonl`` with ``--dpo``: one pair per line, in one of TRL's two forms:

- conversational ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``: the
  tokenizer's chat template renders the prompt with the generation prompt, P, and the prompt
  followed by the completion, Q; the completion's tokens are every token of Q after the
  templated prompt (with ChatML: the content, ``<|im_end|>`` and the newline), TRL's rule;
- standard ``{"prompt": str, "chosen": str, "rejected": str}``: no template;
  ``prompt + completion + [EOD]`` (after the tokenizer's own prefix, e.g. BOS), the
  completion's tokens starting where its ids diverge from the tokenized prompt's.

Each side becomes ids ``x`` with a 0/1 mask (1 on the completion), then a sample exactly as an
SFT record (``datasets.FileSFTDataset``): cut or padded to ``seq_length + 1`` ids,
``loss_mask[t] = m[t + 1]``. Pair ``i`` of the stream is record ``perm_e[i mod R]`` (the SFT
order rule). A global batch of P pairs is 2P rows, interleaved: row 2i the chosen, 2i + 1 the
rejected completion of pair i, so a micro-batch of b pairs (2b rows) holds whole pairs.

A pair with a side longer than ``seq_length + 1`` ids is cut (counted; more than 10% of the
pairs stops the run unless ``--allow-truncation``, as for SFT).

Without ``--data-path``: generated pairs. Pair i (its own generator, from ``--seed`` and i):
``[BOS] p [SEP]`` then the chosen ``reverse(p) [EOS]`` or a rejected random response of a
random length (1 .. len(p)) ``[EOS]``: the completions' lengths differ, as real pairs' do.
"""

import math
from typing import Any, Dict, List, Optional, Tuple

import numpy
import torch

from megatron.training.data import (
    EOS,
    PAD,
    Batch,
    SFTDataset,
    padding_row,
    set_document_bounds,
)
from megatron.training.datasets import (
    MAX_TRUNCATED,
    Record,
    build_training_tokenizer,
    jsonl_records,
    padded_sample,
    split_ranges,
)

_EOS = torch.tensor([EOS])
PAIR_FORMS = (
    "a JSON object with 'prompt', 'chosen' and 'rejected' (three strings, or three lists of "
    "chat messages)"
)
Pair = Tuple[Record, Record]


def build_preference_dataset(config: Any, valid: bool = False):
    """The generated pairs without ``--data-path``, else the pairs of the JSONL file (the
    training part of ``--split``); packed into rows with ``--pack-sequences``
    (``PackedPreferenceDataset``). ``valid``: the validation pairs instead, unpacked (the
    records of ``--valid-data-path``, or the validation part of ``--split``, or a generated
    stream of their own)."""
    dataset = _pairs(config, valid)
    if config.pack_sequences and not valid:
        return packed_preference_dataset(dataset, config)
    return dataset


def _pairs(config: Any, valid: bool):
    if not (config.data_path or (valid and config.valid_data_path)):
        stream = "dpo-valid" if valid else "dpo"
        return GeneratedPreferenceDataset(config.seq_length, config.vocab_size, config.seed, stream)
    tokenizer = build_training_tokenizer(config.tokenizer, config.eod_token)
    path = config.valid_data_path if valid and config.valid_data_path else config.data_path
    flag = "--valid-data-path" if valid and config.valid_data_path else "--data-path"
    pairs = [
        tokenize_pair(record, tokenizer, where)
        for where, record in jsonl_records(path, expected=PAIR_FORMS)
    ]
    if not pairs:
        raise ValueError(f"{flag} {path!r}: no records (the file is empty)")
    name = path
    if config.split and flag == "--data-path":
        start, end = split_ranges(config.split, len(pairs))[1 if valid else 0]
        pairs, name = pairs[start:end], f"{name} (--split records {start}..{end - 1})"
        if not pairs:
            part = "validation" if valid else "training"
            raise ValueError(f"--split {config.split}: no {part} records in --data-path {path}")
    return PreferenceDataset(
        pairs,
        config.seq_length,
        config.seed,
        tokenizer.pad,
        tokenizer.vocab_size,
        name,
        None if config.allow_truncation else MAX_TRUNCATED,
    )


def tokenize_pair(record: Any, tokenizer: Any, where: str) -> Pair:
    """(chosen, rejected) ``(ids, mask)`` of one JSONL record (module docstring); errors
    start with ``where`` (``FILE:LINE``)."""
    if not isinstance(record, dict) or not {"prompt", "chosen", "rejected"} <= set(record):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: got {keys}; expected {PAIR_FORMS}")
    prompt = record["prompt"]
    sides = (record["chosen"], record["rejected"])
    if all(isinstance(v, list) for v in (prompt, *sides)):
        return tuple(_conversational(prompt, side, tokenizer, where) for side in sides)
    if all(isinstance(v, str) for v in (prompt, *sides)):
        prefix = list(getattr(tokenizer, "document_prefix", []))
        prompt_ids = prefix + list(tokenizer.tokenize(prompt))
        return tuple(
            _split(prompt_ids, prefix + list(tokenizer.tokenize(prompt + side)) + [tokenizer.eod])
            for side in sides
        )
    kinds = ", ".join(type(v).__name__ for v in (prompt, *sides))
    raise ValueError(f"{where}: prompt, chosen, rejected are {kinds}; expected {PAIR_FORMS}")


def _conversational(prompt: list, completion: list, tokenizer: Any, where: str) -> Record:
    """TRL's rule: the tokens of template(prompt + completion) after template(prompt, with
    the generation prompt)."""
    from megatron.core.tokenizers.chat_template import (
        ChatTemplateError,
        frozen_strftime_now,
        render_chat,
    )

    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            f"{where}: a conversational pair needs a tokenizer with a chat template: pass "
            "--tokenizer with a HuggingFace tokenizer folder holding chat_template"
        )
    variables = dict(getattr(tokenizer, "special_tokens", {}))
    variables.setdefault("strftime_now", frozen_strftime_now())  # one date for both
    try:
        before = render_chat(template, prompt, variables, add_generation_prompt=True)
        full = render_chat(template, list(prompt) + list(completion), variables)
    except ChatTemplateError as err:
        raise ValueError(f"{where}: {err}") from None
    return _split(list(tokenizer.tokenize(before)), list(tokenizer.tokenize(full)))


def _split(prompt_ids: List[int], ids: List[int]) -> Record:
    """``ids`` with the mask 1 from the first position where they differ from
    ``prompt_ids`` on."""
    common = 0
    for a, b in zip(prompt_ids, ids):
        if a != b:
            break
        common += 1
    mask = numpy.zeros(len(ids), numpy.uint8)
    mask[common:] = 1
    return numpy.asarray(ids, dtype=numpy.int64), mask


class PreferenceDataset:
    """Pairs of ``(ids, mask)`` records as interleaved [2P, s] global batches (module
    docstring); ``notes``: truncation and empty-pair counts for the trainer to print."""

    def __init__(
        self,
        pairs: List[Pair],
        seq_length: int,
        seed: int,
        pad: int,
        vocab_size: int,
        name: str = "the pairs",
        max_truncated: Optional[float] = None,
    ) -> None:
        self.pairs, self.seq_length, self.seed, self.pad = pairs, seq_length, seed, pad
        self.vocab_size, self.name = vocab_size, name
        top = max(int(ids.max(initial=0)) for pair in pairs for ids, _ in pair)
        if top >= vocab_size:
            raise ValueError(
                f"--data-path {name!r} holds token id {top}, outside the tokenizer's "
                f"vocabulary of {vocab_size}"
            )
        self.notes = self._check_lengths(max_truncated)
        self._perms: Dict[int, List[int]] = {}

    def __len__(self) -> int:
        return len(self.pairs)

    def pair_in_file_order(self, position: int) -> Tuple[Batch, Batch]:
        """(chosen, rejected) samples of record ``position`` of the file (validation)."""
        chosen, rejected = self.pairs[position]
        return self._sample(chosen), self._sample(rejected)

    def pair(self, index: int) -> Tuple[Batch, Batch]:
        """(chosen, rejected) samples of pair ``index`` of the stream."""
        epoch, k = divmod(index, len(self.pairs))
        if epoch not in self._perms:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(len(self.pairs), generator=generator).tolist()
        chosen, rejected = self.pairs[self._perms[epoch][k]]
        return self._sample(chosen), self._sample(rejected)

    def global_batch(self, iteration: int, global_batch_size: int) -> Batch:
        """Pairs ``[iteration * GBS, (iteration + 1) * GBS)`` as [2 GBS, s] tensors, rows
        interleaved chosen / rejected."""
        return _stack(self, iteration, global_batch_size)

    def data_tokens(self, iteration: int, global_batch_size: int) -> int:
        """Positions of the global batch's 2 GBS rows that hold data, not padding."""
        batch = self.global_batch(iteration, global_batch_size)
        return int((~batch["padding_mask"]).sum())

    def _sample(self, record: Record) -> Batch:
        return padded_sample(record, self.seq_length, self.pad)

    def _check_lengths(self, max_truncated: Optional[float]) -> List[str]:
        s, total = self.seq_length, len(self.pairs)
        cut = sum(1 for pair in self.pairs if any(ids.size > s + 1 for ids, _ in pair))
        empty = sum(
            1 for pair in self.pairs if any(int(mask[1 : s + 1].sum()) == 0 for _, mask in pair)
        )
        if max_truncated is not None and cut > max_truncated * total:
            longest = max(ids.size for pair in self.pairs for ids, _ in pair)
            raise ValueError(
                f"--data-path {self.name!r}: {cut} of {total} pairs "
                f"({100 * cut / total:.0f}%, more than {100 * max_truncated:.0f}%) have a "
                f"prompt + completion longer than --seq-length {s} + 1 tokens and would be cut "
                f"(the longest has {longest}); raise --seq-length, or pass --allow-truncation "
                "to train on the cut pairs"
            )
        notes = []
        if cut:
            notes.append(f"{cut} of {total} pairs truncated to --seq-length {s}")
        if empty:
            notes.append(
                f"warning: {empty} of {total} pairs have a completion with no token within "
                f"--seq-length {s}; its log-probability is 0"
            )
        return notes


class GeneratedPreferenceDataset:
    """The generated pairs (module docstring): an endless, deterministic stream."""

    def __init__(self, seq_length: int, vocab_size: int, seed: int, stream: str = "dpo") -> None:
        self.samples = SFTDataset(seq_length, vocab_size, seed, stream=stream)
        self.others = SFTDataset(seq_length, vocab_size, seed, stream=f"{stream}-rejected")
        self.seq_length, self.vocab_size, self.seed = seq_length, vocab_size, seed
        self.notes: List[str] = []

    def pair_in_file_order(self, index: int) -> Tuple[Batch, Batch]:
        """Pair ``index`` (the generated stream has no file; validation reads it in order)."""
        return self.pair(index)

    def pair(self, index: int) -> Tuple[Batch, Batch]:
        """(chosen, rejected) samples of pair ``index``: the rejected response is the first
        min(L', L) prompt symbols of sample ``index`` of a stream of its own (L' its prompt
        length, L this pair's)."""
        chosen = self.samples[index]
        length = int(chosen["loss_mask"].sum().item()) - 1  # the prompt's length L
        other = self.others[index]
        size = min(int(other["loss_mask"].sum().item()) - 1, length)
        x = torch.full((self.seq_length + 1,), PAD, dtype=torch.long)
        x[: length + 2] = chosen["tokens"][: length + 2]  # BOS p SEP
        x[length + 2 : length + 3 + size] = torch.cat([other["tokens"][1 : 1 + size], _EOS])
        positions = torch.arange(self.seq_length)
        rejected = {
            "tokens": x[:-1].clone(),
            "labels": x[1:].clone(),
            "loss_mask": ((positions >= length + 1) & (positions <= length + 1 + size)).float(),
            "position_ids": positions,
            "padding_mask": positions >= length + size + 2,
        }
        return chosen, rejected

    def global_batch(self, iteration: int, global_batch_size: int) -> Batch:
        """Pairs ``[iteration * GBS, (iteration + 1) * GBS)`` as interleaved [2 GBS, s]."""
        return _stack(self, iteration, global_batch_size)

    def data_tokens(self, iteration: int, global_batch_size: int) -> int:
        """Positions of the global batch's 2 GBS rows that hold data, not padding."""
        batch = self.global_batch(iteration, global_batch_size)
        return int((~batch["padding_mask"]).sum())


def _stack(dataset: Any, iteration: int, global_batch_size: int) -> Batch:
    start = iteration * global_batch_size
    rows = [s for i in range(start, start + global_batch_size) for s in dataset.pair(i)]
    return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}


class PackedPreferenceDataset:
    """``--dpo --pack-sequences``: each micro-batch's ``pairs_per_row`` pairs (M, batch sizes
    counting pairs as unpacked) packed into ONE row (megatron-core's THD format) whose length
    is the sum of their real lengths, padded as the layout needs: row r holds pairs
    [r M, (r + 1) M) of the stream (``pair_of(i)``, None past the end of a finite set), each
    pair's chosen side then its rejected side, each a document of its data positions (the
    unpacked sample's tokens, labels and loss mask) padded to a multiple of ``multiple``
    (2C under context parallelism: the zig-zag split of every document), the last one
    further so that the row is a multiple of ``row_multiple`` (x TP under sequence
    parallelism). Rows differ in length (``variable_seq_lengths`` between pipeline stages).
    Positions run from 0 in every document, capped at ``seq_length - 1`` (learned position
    embeddings): a last document lengthened for the row's multiple only pads further.

    A row has [t] ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (from 0 in every
    document), ``padding_mask`` (True outside the documents' data), ``sequence_index`` (the
    document of each position: 2k and 2k + 1 for the row's pair k) and ``cu_seqlens`` /
    ``cu_seqlens_padded`` [2M + 1] / ``max_seqlen`` [1]. ``global_batch`` stacks a global
    batch's rows padded on the right to its longest (``sequence_index`` -1 there);
    ``packed_row`` cuts a micro-batch back to its own length.
    """

    def __init__(
        self,
        pair_of,
        pairs_per_row: int,
        seq_length: int,
        vocab_size: int,
        multiple: int = 1,
        row_multiple: int = 1,
        notes=(),
    ) -> None:
        self.pair_of, self.pairs_per_row, self.vocab_size = pair_of, pairs_per_row, vocab_size
        self.multiple, self.row_multiple, self.seq_length = multiple, row_multiple, seq_length
        self.notes: List[str] = list(notes)
        self._rows: Dict[int, Batch] = {}

    def __getitem__(self, index: int) -> Batch:
        if index not in self._rows:
            row = self._pack_row(index)
            if row is None:
                raise IndexError(f"PackedPreferenceDataset: no pairs left for row {index}")
            self._rows[index] = row
        return self._rows[index]

    def global_batch(self, iteration: int, global_batch_size: int) -> Batch:
        """Pairs [i GBS, (i + 1) GBS) as GBS / M rows, stacked to [GBS / M, t] tensors (t the
        longest row; the others padded on the right)."""
        count = global_batch_size // self.pairs_per_row
        return stack_rows([self[iteration * count + i] for i in range(count)])

    def data_tokens(self, iteration: int, global_batch_size: int) -> int:
        """Positions of the global batch's rows that hold data, not padding."""
        return int((~self.global_batch(iteration, global_batch_size)["padding_mask"]).sum())

    def _pack_row(self, index: int) -> Optional[Batch]:
        sides, first = [], index * self.pairs_per_row
        for i in range(first, first + self.pairs_per_row):
            pair = self.pair_of(i)
            if pair is None:
                return None
            sides += list(pair)
        lengths = [max(int((~side["padding_mask"]).sum()), 1) for side in sides]
        spans = [-(-n // self.multiple) * self.multiple for n in lengths]
        spans[-1] += -sum(spans) % self.row_multiple
        t = sum(spans)
        row = {**padding_row(t), "sequence_index": torch.full((t,), -1, dtype=torch.long)}
        start = 0
        for document, (side, length, span) in enumerate(zip(sides, lengths, spans)):
            for key in ("tokens", "labels", "loss_mask"):
                row[key][start : start + length] = side[key][:length]
            row["padding_mask"][start : start + length] = False
            positions = torch.arange(span).clamp(max=self.seq_length - 1)
            row["position_ids"][start : start + span] = positions
            row["sequence_index"][start : start + span] = document
            start += span
        real = [0, *numpy.cumsum(lengths).tolist()]
        return set_document_bounds(row, real, [0, *numpy.cumsum(spans).tolist()], len(sides))


_PER_ROW = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")
_FILL = {"tokens": PAD, "labels": PAD, "padding_mask": True, "sequence_index": -1}


def stack_rows(rows: List[Batch]) -> Batch:
    """Packed rows of different lengths stacked, each padded on the right to the longest
    (``_FILL``; 0 elsewhere)."""
    t = max(int(row["tokens"].shape[0]) for row in rows)
    out = {}
    for key in rows[0]:
        if key in _PER_ROW:
            out[key] = torch.stack([row[key] for row in rows])
            continue
        out[key] = torch.full((len(rows), t), _FILL.get(key, 0), dtype=rows[0][key].dtype)
        for i, row in enumerate(rows):
            out[key][i, : row[key].shape[0]] = row[key]
    return out


def packed_row(microbatch: Batch) -> Batch:
    """A micro-batch of one packed row (``[1, t]`` of a stacked global batch) cut back to its
    own length, the end of its last document."""
    length = int(microbatch["cu_seqlens_padded"].reshape(-1)[-1])
    return {
        key: value if key in _PER_ROW else value[:, :length] for key, value in microbatch.items()
    }


def packing_multiples(config: Any) -> Tuple[int, int]:
    """(each document's, each row's) length multiple for packed pairs at the run's layout:
    2C for the zig-zag split of every document over C > 1 context-parallel ranks (1
    without), the row x TP under sequence parallelism (each CP rank's share split over TP)."""
    cp, tp = config.context_parallel_size, config.tensor_model_parallel_size
    document = 2 * cp if cp > 1 else 1
    return document, document * (tp if config.sequence_parallel else 1)


def packed_preference_dataset(dataset: Any, config: Any, in_file_order=False):
    """``dataset``'s pair stream packed (``PackedPreferenceDataset``: ``--micro-batch-size``
    pairs a row, the layout's multiples). ``in_file_order`` (validation): its pairs in file
    order instead, the first ``in_file_order`` of them (None: endless, the generated pairs)."""
    if in_file_order is False:
        pair_of = dataset.pair
    else:
        count = math.inf if in_file_order is None else in_file_order
        pair_of = lambda i: dataset.pair_in_file_order(i) if i < count else None  # noqa: E731
    document, row = packing_multiples(config)
    return PackedPreferenceDataset(
        pair_of,
        config.micro_batch_size,
        config.seq_length,
        dataset.vocab_size,
        document,
        row,
        dataset.notes,
    )
