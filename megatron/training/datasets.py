"""SFT data read from files: JSONL (chat, prompt/completion, prompt/response or text) or
megatron's indexed format.

``--data-path`` is either

- a JSONL file, one record per line, tokenized when the job starts:

  - ``{"messages": [{"role": ..., "content": ...}, ...]}``: a conversation (system,
    developer, user, assistant, tool turns; several rounds) rendered with the tokenizer's chat
    template; only the assistant's tokens are trained
    (``megatron.core.tokenizers.chat_template``: exact assistant spans from
    ``{% generation %}`` blocks or incremental rendering). Nothing is appended: the template
    writes its own end-of-turn tokens.
  - ``{"prompt": [messages], "completion": [messages]}``: the same, the conversation being
    prompt + completion (TRL's conversational prompt/completion form).
  - ``{"prompt": str, "completion": str}`` or ``{"prompt": str, "response": str}``: plain text,
    ``prompt + completion + [EOD]``, the prompt masked out of the loss (no chat template).
  - ``{"text": str}``: ``text + [EOD]``, every token trained.

  Plain-text records start with the ids a HuggingFace tokenizer's post-processor puts before
  a text (Llama's BOS; nothing for GPT-2 style or byte-level tokenizers), never trained.

- the prefix of an indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``) written by
  ``python -m megatron.training.preprocess_data``: a document of one sequence is all trained
  (EOD appended when it does not end with one); a document of k >= 2 sequences alternates
  untrained and trained segments, starting untrained, taken as written (``--sft`` writes
  prompt, response + EOD; ``--chat`` writes any record form above this way).

Every record becomes ids ``x`` with a 0/1 mask ``m`` over them (1 = a token the model learns to
write). Sample ``i`` is record ``perm_e[i mod R]`` of epoch ``e = i div R`` (``perm_e``: a
permutation drawn from ``(seed, e)``), cut or padded to ``seq_length + 1`` tokens;
``tokens = x[:-1]``, ``labels = x[1:]``, ``loss_mask[t] = m[t + 1]`` (0 on padding),
``padding_mask[t]`` True when ``x[t + 1]`` is padding (t >= len(x) - 1: a record's prompt is
data, only the fill after it is padding; ``megatron.training.data``). With
``--pack-sequences`` the records, in the same order, are packed into rows instead
(``megatron.training.data.PackedSFTDataset``). Nothing depends on the parallel layout.

Records longer than ``seq_length + 1`` tokens are cut; the job reports how many (and how many
records have no trained token left), and refuses data with no trained token at all.
"""

import copy
import json
import math
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy
import torch

from megatron.training.data import Batch, PackedSFTDataset, SFTDataset

BYTE_LEVEL = "byte-level"

# The trainer stops when more than this share of the records would be cut (--allow-truncation).
MAX_TRUNCATED = 0.10
Record = Tuple[numpy.ndarray, numpy.ndarray]  # (ids int64, mask uint8), same length


def build_sft_dataset(config: Any):
    """The generated ``SFTDataset`` without ``--data-path`` (``PackedSFTDataset`` with
    ``--pack-sequences``), else a ``FileSFTDataset`` (packed with ``--pack-sequences``)."""
    if not config.data_path:
        if config.pack_sequences:
            return PackedSFTDataset(config.seq_length, config.vocab_size, config.seed)
        return SFTDataset(config.seq_length, config.vocab_size, config.seed)
    dataset = FileSFTDataset(
        config.data_path,
        config.tokenizer,
        config.seq_length,
        config.seed,
        eod_token=getattr(config, "eod_token", None),
        max_truncated=None if getattr(config, "allow_truncation", True) else MAX_TRUNCATED,
    )
    if getattr(config, "split", None):  # the training part of --split
        dataset = dataset.part(split_ranges(config.split, len(dataset))[0], "--split")
    if config.pack_sequences:
        return PackedSFTDataset(config.seq_length, dataset.vocab_size, config.seed, dataset)
    return dataset


def parse_split(split: str) -> List[float]:
    """megatron's ``--split`` string (``"969,30,1"``, ``"90/10/0"``: train, validation, test
    weights, missing ones 0) as three finite non-negative weights with a positive, finite
    sum; a ValueError naming the flag otherwise."""
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    finite = all(math.isfinite(w) and w >= 0 for w in weights) and math.isfinite(sum(weights))
    if not 1 <= len(weights) <= 3 or not finite or sum(weights) <= 0:
        raise ValueError(
            f"--split {split!r}: expected up to three finite non-negative weights with a "
            "positive sum, train,validation,test (e.g. 969,30,1)"
        )
    return weights + [0.0] * (3 - len(weights))


def split_ranges(split: str, count: int) -> List[Tuple[int, int]]:
    """The ``[start, end)`` record ranges of the train, validation and test parts of
    ``count`` records in file order: part k ends at ``round(count * (w_0 + .. + w_k) /
    sum w)``. Contiguous and independent of the seed and the layout (megatron's rule)."""
    weights = parse_split(split)
    total, bounds, running = sum(weights), [0], 0.0
    for weight in weights:
        running += weight
        bounds.append(int(round(count * running / total)))
    bounds[-1] = count
    return [(bounds[k], bounds[k + 1]) for k in range(3)]


def build_training_tokenizer(tokenizer: Any, eod_token: Optional[str] = None):
    """``None`` / ``"byte-level"``: UTF-8 bytes (no file); else a HuggingFace tokenizer folder
    or ``tokenizers`` JSON file (``load_hf_tokenizer``; ``eod_token`` overrides its
    end-of-document token)."""
    from types import SimpleNamespace

    from megatron.training.tokenizer.hf_tokenizer import load_hf_tokenizer
    from megatron.training.tokenizer.tokenizer import build_tokenizer

    if tokenizer in (None, BYTE_LEVEL):
        if eod_token is not None:
            raise ValueError(
                f"--eod-token {eod_token!r}: the byte-level tokenizer's end-of-document id is "
                "fixed (256); --eod-token needs --tokenizer DIR_OR_tokenizer.json"
            )
        return build_tokenizer(SimpleNamespace(tokenizer_type="ByteLevelTokenizer"))
    if not os.path.exists(tokenizer):
        raise FileNotFoundError(
            f"--tokenizer {tokenizer!r}: no such file or folder (expected 'byte-level', a "
            "tokenizers JSON file or a HuggingFace tokenizer folder)"
        )
    return load_hf_tokenizer(tokenizer, eod_token=eod_token)


class FileSFTDataset:
    """Masked samples from a JSONL file or an indexed dataset (module docstring).

    ``notes`` holds the lines the trainer prints on rank 0 (truncation and records without
    trained tokens, with counts); ``document(j)`` is record j of the sample order as one
    unpadded document (for packing).
    """

    def __init__(
        self,
        data_path: str,
        tokenizer: Any,
        seq_length: int,
        seed: int,
        eod_token: Optional[str] = None,
        max_truncated: Optional[float] = None,
    ) -> None:
        self.max_truncated = max_truncated
        self.tokenizer = build_training_tokenizer(tokenizer, eod_token)
        self.seq_length, self.seed = seq_length, seed
        self.eod, self.pad = self.tokenizer.eod, self.tokenizer.pad
        self.vocab_size = self.tokenizer.vocab_size
        self.data_path = data_path
        if os.path.isfile(data_path) and not data_path.endswith((".bin", ".idx")):
            self.records = _tokenized_records(data_path, self.tokenizer)
        else:
            self.records = _read_indexed(data_path, self.eod)
        if not self.records:
            raise ValueError(f"--data-path {data_path!r}: no records (the file is empty)")
        top = max(int(ids.max(initial=0)) for ids, _ in self.records)
        if top >= self.vocab_size:
            raise ValueError(
                f"--data-path {data_path!r} holds token id {top}, outside the tokenizer's "
                f"vocabulary of {self.vocab_size} (was it written with another --tokenizer?)"
            )
        self.notes = self._check_lengths()
        self._perms: Dict[int, List[int]] = {}

    def __len__(self) -> int:
        return len(self.records)

    def part(self, bounds: Tuple[int, int], name: str) -> "FileSFTDataset":
        """The records ``[start, end)`` (file order) as a data set of their own (``name``,
        e.g. ``--split``, in its messages); a part without any trained token is an error."""
        start, end = bounds
        subset = copy.copy(self)
        subset.records = self.records[start:end]
        subset.data_path = f"{self.data_path} ({name} records {start}..{end - 1})"
        if not subset.records:
            raise ValueError(
                f"{name}: the part of --data-path {self.data_path!r} in records "
                f"[{start}, {end}) is empty ({len(self.records)} records); give it a larger "
                "weight"
            )
        subset.notes = subset._check_lengths()
        subset._perms = {}
        return subset

    def sample_of_record(self, position: int) -> Batch:
        """Record ``position`` in file order (not the shuffled order) as a sample."""
        return self._sample(self.records[position])

    def document_of_record(self, position: int) -> Optional[Batch]:
        """Record ``position`` in file order as a document; None past the last record."""
        if position >= len(self.records):
            return None
        return self._document(self.records[position])

    def __getitem__(self, index: int) -> Batch:
        return self._sample(self._record(index))

    def _sample(self, record: Record) -> Batch:
        return padded_sample(record, self.seq_length, self.pad)

    def document(self, index: int) -> Batch:
        """Sample ``index``'s record as a document of ``min(len - 1, seq_length)`` positions:
        ``tokens``, ``labels``, ``loss_mask`` without padding."""
        ids, mask = self._record(index)
        n = min(ids.size, self.seq_length + 1)
        x = torch.from_numpy(ids[:n])
        return {
            "tokens": x[:-1].clone(),
            "labels": x[1:].clone(),
            "loss_mask": torch.from_numpy(mask[1:n].astype(numpy.float32)),
        }

    def data_tokens(self, iteration: int, global_batch_size: int) -> int:
        """Positions of the ``iteration``-th global batch that hold record tokens (a record
        of n ids fills ``min(n - 1, seq_length)`` positions), not padding."""
        start = iteration * global_batch_size
        return sum(
            min(self._record(i)[0].size - 1, self.seq_length)
            for i in range(start, start + global_batch_size)
        )

    def global_batch(self, iteration: int, global_batch_size: int) -> Batch:
        """Samples ``[iteration * GBS, (iteration + 1) * GBS)`` stacked to [GBS, s] tensors."""
        start = iteration * global_batch_size
        samples = [self[start + i] for i in range(global_batch_size)]
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}

    def _record(self, index: int) -> Record:
        epoch, k = divmod(index, len(self.records))
        return self.records[self._perm(epoch)[k]]

    def _perm(self, epoch: int) -> List[int]:
        if epoch not in self._perms:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(len(self.records), generator=generator).tolist()
        return self._perms[epoch]

    def _check_lengths(self) -> List[str]:
        """Count records cut to ``seq_length + 1`` tokens and records with no trained label
        left; raise when no record has one, or when more than ``max_truncated`` of them
        would be cut (the trainer's default: ``MAX_TRUNCATED``)."""
        s, total = self.seq_length, len(self.records)
        cut = sum(1 for ids, _ in self.records if ids.size > s + 1)
        trained = [int(mask[1 : s + 1].sum()) for _, mask in self.records]
        empty = sum(1 for t in trained if t == 0)
        if sum(trained) == 0:
            raise ValueError(
                f"--data-path {self.data_path!r}: nothing to train on at --seq-length {s}: "
                f"none of the {total} records has a loss token within its first {s + 1} "
                f"tokens ({cut} of {total} records are longer than that and would be cut); "
                "raise --seq-length or shorten the prompts"
            )
        if self.max_truncated is not None and cut > self.max_truncated * total:
            longest = max(ids.size for ids, _ in self.records)
            raise ValueError(
                f"--data-path {self.data_path!r}: {cut} of {total} records "
                f"({100 * cut / total:.0f}%, more than {100 * self.max_truncated:.0f}%) are "
                f"longer than --seq-length {s} + 1 tokens and would be cut (the longest has "
                f"{longest}); raise --seq-length, or pass --allow-truncation to train on the "
                "cut records"
            )
        notes = []
        if cut:
            notes.append(f"{cut} of {total} records truncated to --seq-length {s}")
        if empty:
            notes.append(
                f"warning: {empty} of {total} records have no loss tokens within --seq-length "
                f"{s} (their prompt fills the sequence, or they train nothing); they add no "
                "gradient"
            )
        return notes


# --------------------------------------------------------------------------- readers

_RECORD_FORMS = (
    "a JSON object with 'messages', 'prompt' and 'completion', 'prompt' and 'response', or "
    "'text'"
)


def _tokenized_records(path: str, tokenizer: Any) -> List[Record]:
    return [
        tokenize_record(record, tokenizer, where)
        for where, record in jsonl_records(path, expected=_RECORD_FORMS)
    ]


def jsonl_records(path: str, expected: Optional[str] = None) -> Iterator[Tuple[str, Any]]:
    """(``FILE:LINE``, the parsed JSON value) for each non-blank line of ``path`` (lines end
    at ``b"\\n"`` only, so LINE is the editor's). A line that is not UTF-8, or not JSON, is a
    ValueError naming ``FILE:LINE`` (and ``expected``, what the caller reads, when given).
    Also the reader of ``preprocess_data``."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{where}: not UTF-8 text ({err.reason} at byte {err.start})"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                also = f"; expected {expected}" if expected else ""
                raise ValueError(
                    f"{where}: not valid JSON ({err.msg} at column {err.colno}){also}"
                ) from None
            yield where, record


TRAINER_TOKENIZER_HINT = (
    "pass --tokenizer with a HuggingFace tokenizer folder (tokenizer.json + "
    "tokenizer_config.json holding chat_template) or its tokenizer.json"
)


def tokenize_record(
    record: Any, tokenizer: Any, where: str, tokenizer_hint: str = TRAINER_TOKENIZER_HINT
) -> Record:
    """One JSONL record (any form of the module docstring) as ``(ids, mask)``; errors start
    with ``where`` (``FILE:LINE``). ``tokenizer_hint`` ends the error of a chat record met
    without a chat tokenizer (which flag to pass)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected {_RECORD_FORMS}; got {type(record).__name__}")
    if "messages" in record:
        return _conversation(record["messages"], tokenizer, where, tokenizer_hint)
    if "prompt" in record and ("completion" in record or "response" in record):
        key = "completion" if "completion" in record else "response"
        prompt, answer = record["prompt"], record[key]
        if isinstance(prompt, list) and isinstance(answer, list):
            return _conversation(prompt + answer, tokenizer, where, tokenizer_hint)
        _require_strings(where, prompt=prompt, **{key: answer})
        prompt_ids = _ids(_prefix(tokenizer) + list(tokenizer.tokenize(prompt)))
        answer_ids = _ids(list(tokenizer.tokenize(answer)) + [tokenizer.eod])
        ids = numpy.concatenate([prompt_ids, answer_ids])
        mask = numpy.concatenate(
            [numpy.zeros(prompt_ids.size, numpy.uint8), numpy.ones(answer_ids.size, numpy.uint8)]
        )
        return ids, mask
    if "text" in record:
        _require_strings(where, text=record["text"])
        prefix = _prefix(tokenizer)
        ids = _ids(prefix + list(tokenizer.tokenize(record["text"])) + [tokenizer.eod])
        mask = numpy.ones(ids.size, numpy.uint8)
        mask[: len(prefix)] = 0
        return ids, mask
    raise ValueError(f"{where}: keys {sorted(record)}; expected {_RECORD_FORMS}")


def _prefix(tokenizer: Any) -> List[int]:
    """The tokenizer's own start-of-text ids (e.g. BOS; none for byte-level)."""
    return list(getattr(tokenizer, "document_prefix", []))


def _conversation(messages: Any, tokenizer: Any, where: str, hint: str) -> Record:
    from megatron.core.tokenizers.chat_template import ChatTemplateError, tokenize_conversation

    if not hasattr(tokenizer, "encode_with_offsets"):
        raise ValueError(f"{where}: a chat record needs a tokenizer with a chat template: {hint}")
    try:
        ids, mask = tokenize_conversation(tokenizer, messages)
    except ChatTemplateError as err:
        raise ValueError(f"{where}: {err}") from None
    return _ids(ids), numpy.asarray(mask, dtype=numpy.uint8)


def _require_strings(where: str, **values: Any) -> None:
    for key, value in values.items():
        if not isinstance(value, str):
            raise ValueError(
                f"{where}: {key!r} is {type(value).__name__}; expected a string (or, for "
                "'prompt'/'completion', two lists of chat messages)"
            )


def _read_indexed(prefix: str, eod: int) -> List[Record]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if os.path.isdir(prefix):
        raise ValueError(
            f"--data-path {prefix!r} is a folder; expected a JSONL file or the prefix of an "
            "indexed dataset (PREFIX.bin + PREFIX.idx)"
        )
    if prefix.endswith((".bin", ".idx")):
        prefix = prefix[:-4]
    if not IndexedDataset.exists(prefix):
        raise FileNotFoundError(
            f"--data-path {prefix!r}: no such file, and no {prefix}.bin + {prefix}.idx pair "
            "(expected a JSONL file or the prefix of an indexed dataset written by python -m "
            "megatron.training.preprocess_data)"
        )
    dataset = IndexedDataset(prefix)
    bounds = dataset.document_indices
    records = []
    for d in range(len(bounds) - 1):
        parts = [
            numpy.asarray(dataset[i], dtype=numpy.int64) for i in range(bounds[d], bounds[d + 1])
        ]
        if len(parts) == 1:  # text: every token trained, EOD appended if missing
            ids = parts[0]
            if not (ids.size and ids[-1] == eod):
                ids = numpy.concatenate([ids, [eod]])
            mask = numpy.ones(ids.size, numpy.uint8)
        elif len(parts) >= 2:  # untrained, trained, untrained, ... segments, as written
            ids = numpy.concatenate(parts)
            mask = numpy.concatenate(
                [numpy.full(p.size, k % 2, numpy.uint8) for k, p in enumerate(parts)]
            )
        else:
            raise ValueError(f"--data-path {prefix!r}: document {d} has no sequences")
        ids = ids.astype(numpy.int64)
        records.append((ids, mask))
    return records


def _ids(ids: Any) -> numpy.ndarray:
    return numpy.asarray(list(ids), dtype=numpy.int64)


def padded_sample(record: Record, seq_length: int, pad: int) -> Batch:
    """One row of ``seq_length`` positions from a (token ids, loss mask) record: tokens and
    next-token labels, cut to the row or filled with ``pad`` (masked out, marked in
    ``padding_mask``)."""
    ids, mask = record
    s = seq_length
    n = min(ids.size, s + 1)
    x = torch.full((s + 1,), pad, dtype=torch.long)
    x[:n] = torch.from_numpy(ids[:n])
    loss_mask = torch.zeros(s)
    loss_mask[: n - 1] = torch.from_numpy(mask[1:n].astype(numpy.float32))
    return {
        "tokens": x[:-1].clone(),
        "labels": x[1:].clone(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(s),
        "padding_mask": torch.arange(s) >= n - 1,
    }
