"""Turn JSONL into megatron's indexed format (``PREFIX.bin`` + ``PREFIX.idx``).

    python -m megatron.training.preprocess_data --input data.jsonl --output-prefix out \\
        [--json-keys text] [--sft | --chat] [--tokenizer-type ByteLevelTokenizer|
        HuggingFaceTokenizer|NullTokenizer] [--tokenizer-model tokenizer.json] [--vocab-size N]
        [--append-eod] [--eod-token TOKEN]

Plain mode (megatron-LM's tool): for every key in ``--json-keys`` one dataset
``{prefix}_{key}_document``, one document (a single sequence) per record, EOD appended with
``--append-eod``. ``--sft``: one dataset ``{prefix}_sft_document`` whose documents hold two
sequences, the tokenized ``prompt`` and ``response`` (+ EOD), which the trainer's
``--data-path`` reads with the prompt masked out of the loss. ``--chat``: one dataset
``{prefix}_chat_document``; every record form the trainer's JSONL reader takes (chat
``messages`` with the tokenizer's chat template, prompt/completion, text) becomes a document of
alternating untrained / trained segments (the first untrained, possibly empty), so the trainer
reads the same ids and loss mask as from the JSONL file. Token ids are stored as uint16
when the vocabulary has fewer than 65500 ids, else int32 (as megatron does). The folder of
``--output-prefix`` must exist (megatron-LM's tool does not create it either); a bad line is an
error naming ``FILE:LINE``.
"""

import argparse
import os
import sys
from typing import Any, List, Optional, Sequence, Tuple

import numpy
import torch

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from megatron.training.datasets import jsonl_records, tokenize_record
from megatron.training.errors import run_tool
from megatron.training.tokenizer.tokenizer import build_tokenizer

CHAT_TOKENIZER_HINT = (
    "pass --tokenizer-type HuggingFaceTokenizer --tokenizer-model with a HuggingFace "
    "tokenizer folder (tokenizer.json + tokenizer_config.json holding chat_template)"
)


def main(argv: Optional[Sequence[str]] = None) -> List[str]:
    """Run the tool; returns the written prefixes. From the command line a known error (a
    flag, a file, a bad line) is one line on stderr and exit 1 (``errors.run_tool``)."""
    args = _parser().parse_args(argv)
    folder = os.path.dirname(args.output_prefix) or "."
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(
            f"--output-prefix {args.output_prefix!r}: {folder!r} is a file; expected a folder"
        )
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"--output-prefix {args.output_prefix!r}: the folder {folder!r} does not exist "
            "(create it first; like megatron-LM's tool, this one does not create folders)"
        )
    if not os.path.isfile(args.input):
        raise FileNotFoundError(f"--input {args.input!r}: no such file (expected a JSONL file)")
    if args.tokenizer_type in ("HuggingFaceTokenizer", "TokenizersFile") and not (
        args.tokenizer_model and os.path.exists(args.tokenizer_model)
    ):
        raise FileNotFoundError(
            f"--tokenizer-model {args.tokenizer_model!r}: no such file (--tokenizer-type "
            f"{args.tokenizer_type} needs a tokenizers JSON file)"
        )
    tokenizer = build_tokenizer(args)  # reads the four --tokenizer-type ... --eod-token flags
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    if args.chat:
        prefixes = [f"{args.output_prefix}_chat_document"]
    elif args.sft:
        prefixes = [f"{args.output_prefix}_sft_document"]
    else:
        prefixes = [f"{args.output_prefix}_{key}_document" for key in args.json_keys]
    builders = [IndexedDatasetBuilder(p + ".bin", dtype=dtype) for p in prefixes]
    count = 0

    for where, record in jsonl_records(args.input):
        if args.chat:
            ids_and_mask = tokenize_record(record, tokenizer, where, CHAT_TOKENIZER_HINT)
            _add_segments(builders[0], ids_and_mask)
            count += 1
            continue
        if not isinstance(record, dict):
            raise ValueError(
                f"{where}: expected a JSON object with the keys "
                f"{[args.prompt_key, args.response_key] if args.sft else args.json_keys}; "
                f"got {type(record).__name__}"
            )
        if args.sft:
            for key in (args.prompt_key, args.response_key):
                _check_text(record, key, where)
            prompt = list(tokenizer.tokenize(record[args.prompt_key]))
            response = list(tokenizer.tokenize(record[args.response_key])) + [tokenizer.eod]
            builders[0].add_item(torch.tensor(prompt, dtype=torch.int64))
            builders[0].add_item(torch.tensor(response, dtype=torch.int64))
            builders[0].end_document()
        else:
            for key, builder in zip(args.json_keys, builders):
                _check_text(record, key, where)
                ids = list(tokenizer.tokenize(record[key]))
                if args.append_eod:
                    ids.append(tokenizer.eod)
                builder.add_item(torch.tensor(ids, dtype=torch.int64))
                builder.end_document()
        count += 1
    for prefix, builder in zip(prefixes, builders):
        builder.finalize(prefix + ".idx")
    print(
        f"{count} records -> {', '.join(prefixes)} "
        f"({numpy.dtype(dtype).name}, vocab {tokenizer.vocab_size})",
        file=sys.stderr,
    )
    return prefixes


def _add_segments(builder: IndexedDatasetBuilder, record: Tuple[Any, Any]) -> None:
    """One document of alternating untrained / trained segments (the first untrained, maybe
    empty), the runs of equal mask in ``record = (ids, mask)``."""
    ids, mask = record
    cuts = [0] + [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]] + [len(mask)]
    segments = [ids[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    if len(mask) and mask[0]:
        segments.insert(0, ids[:0])
    if len(segments) == 1:  # all untrained: keep the two-or-more rule with an empty trained part
        segments.append(ids[:0])
    for segment in segments:
        builder.add_item(torch.as_tensor(segment, dtype=torch.int64))
    builder.end_document()


def _check_text(record: dict, key: str, where: str) -> None:
    if key not in record:
        raise ValueError(f"{where}: no {key!r} key (keys: {sorted(record)})")
    if not isinstance(record[key], str):
        raise ValueError(f"{where}: {key!r} is {type(record[key]).__name__}; expected a string")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron.training.preprocess_data")
    p.add_argument("--input", required=True, help="JSONL file")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--sft", action="store_true", help="prompt/response records")
    p.add_argument(
        "--chat",
        action="store_true",
        help="any record the trainer's --data-path reads (chat 'messages' rendered with the "
        "tokenizer's chat template, prompt/completion, text), as untrained/trained segments",
    )
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--response-key", default="response")
    p.add_argument(
        "--tokenizer-type",
        default="ByteLevelTokenizer",
        choices=["ByteLevelTokenizer", "HuggingFaceTokenizer", "TokenizersFile", "NullTokenizer"],
    )
    p.add_argument("--tokenizer-model", default=None, help="tokenizers JSON file")
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    p.add_argument("--append-eod", action="store_true")
    p.add_argument(
        "--eod-token",
        default=None,
        help="HuggingFaceTokenizer: the end-of-document token (as the trainer's --eod-token)",
    )
    p.add_argument("--workers", type=int, default=1, help="accepted; one process is used")
    return p


if __name__ == "__main__":
    sys.exit(run_tool(main, "megatron.training.preprocess_data"))
