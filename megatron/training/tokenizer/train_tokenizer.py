"""Train a byte-level BPE tokenizer on text with the HuggingFace ``tokenizers`` library and
write a HuggingFace tokenizer folder that ``--tokenizer DIR`` (and ``transformers``) read.

    python -m megatron.training.tokenizer train --input corpus.txt [more files] \\
        --output-dir tok/ [--vocab-size 4096] [--eod-token '<|endoftext|>'] \\
        [--special-tokens '<|im_start|>' '<|im_end|>'] [--chat-template chatml|FILE|none]

Inputs: ``.jsonl`` files contribute every string in each record (``text``, ``prompt``,
``response``, ``completion``, the ``content`` of chat ``messages``); other files contribute
their lines. The model is byte-level BPE (every UTF-8 string encodes, no unknown token) with
the special tokens added first (ids 0, 1, ...: the end-of-document token, then the others).
The folder gets ``tokenizer.json`` and ``tokenizer_config.json`` with ``eos_token`` (= the
end-of-document token) and, unless ``--chat-template none``, ``chat_template``: ``chatml``
(the default: ``<|im_start|>role\\n...<|im_end|>\\n`` turns, the assistant's content and
``<|im_end|>`` inside ``{% generation %}``) or a Jinja file of your own. ``eos_token`` is the
end of a document (the trainer appends it to text records); a chat turn ends with the
special token the template writes after the assistant's content (ChatML's ``<|im_end|>``),
which ``python -m megatron.training.generate`` finds in the template and stops at, as at
``eos_token``.

Refused: an ``--output-dir`` that already holds a tokenizer (unless ``--overwrite``), inputs
without any text, a file that is not UTF-8 (named with its line). A vocabulary that comes
out smaller than ``--vocab-size`` (too little text) is reported.
"""

import argparse
import json
import os
from typing import Any, Iterator, List, Optional, Sequence

from megatron.training.errors import missing_package

DEFAULT_EOD = "<|endoftext|>"
CHATML_SPECIAL = ["<|im_start|>", "<|im_end|>"]
# the files a tokenizer folder gets (an existing one is replaced only with --overwrite)
WRITTEN = ("tokenizer.json", "tokenizer_config.json")

# Written for this project: ChatML turns; the assistant writes its content and <|im_end|>.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(
    inputs: Sequence[str],
    output_dir: str,
    vocab_size: int = 4096,
    eod_token: str = DEFAULT_EOD,
    special_tokens: Optional[Sequence[str]] = None,
    chat_template: Optional[str] = "chatml",
    min_frequency: int = 2,
    overwrite: bool = False,
) -> str:
    """Train and save (module docstring) into ``output_dir`` (created when missing; a
    folder that already holds a tokenizer is refused unless ``overwrite``); returns
    ``output_dir``. ``chat_template``: ``"chatml"``, a path to a Jinja file, or
    ``None``/``"none"`` for no template. ``special_tokens`` default to ChatML's with the
    chatml template, else none. Inputs without any text are refused; a vocabulary that
    comes out smaller than ``vocab_size`` (too little text) is reported."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise missing_package("tokenizers", "tokenizers", "training a tokenizer") from None

    _check_paths(inputs, output_dir, overwrite)
    template = _template(chat_template)
    if special_tokens is None:
        special_tokens = CHATML_SPECIAL if chat_template == "chatml" else []
    special = [eod_token] + [t for t in special_tokens if t != eod_token]
    minimum = 256 + len(special)
    if vocab_size < minimum:
        raise ValueError(
            f"--vocab-size {vocab_size}: a byte-level BPE needs at least {minimum} ids (256 "
            f"bytes + {len(special)} special tokens)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    counted = _Counted(_texts(inputs))
    tokenizer.train_from_iterator(counted, trainer)
    if counted.count == 0:
        raise ValueError(
            f"--input {' '.join(inputs)}: no text in these files (only empty lines); expected "
            "text lines or JSONL records with strings"
        )
    size = tokenizer.get_vocab_size()
    if size < vocab_size:
        print(
            f"note: the vocabulary has {size} tokens, fewer than --vocab-size {vocab_size}: "
            f"the text has no more pairs seen at least --min-frequency {min_frequency} times"
        )
    _save(tokenizer, output_dir, eod_token, template)
    return output_dir


class _Counted:
    """An iterator that counts what it yields (the trainer consumes it)."""

    def __init__(self, items: Iterator[str]) -> None:
        self.items, self.count = items, 0

    def __iter__(self) -> Iterator[str]:
        for item in self.items:
            self.count += 1
            yield item


def _check_paths(inputs: Sequence[str], output_dir: str, overwrite: bool) -> None:
    for path in inputs:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--input {path!r}: no such file")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise NotADirectoryError(
            f"--output-dir {output_dir!r} is a file; expected a folder (created when missing)"
        )
    there = [n for n in WRITTEN if os.path.exists(os.path.join(output_dir, n))]
    if there and not overwrite:
        raise ValueError(
            f"--output-dir {output_dir!r} already holds {', '.join(there)}; refusing to "
            "replace a tokenizer: choose a new folder, or pass --overwrite"
        )


def _save(tokenizer: Any, output_dir: str, eod_token: str, template: Optional[str]) -> None:
    os.makedirs(output_dir, exist_ok=True)
    tokenizer.save(os.path.join(output_dir, "tokenizer.json"))
    config: dict = {"eos_token": eod_token, "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    _write_json(os.path.join(output_dir, "tokenizer_config.json"), config)


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)


def main(argv: Optional[Sequence[str]] = None) -> str:
    """``python -m megatron.training.tokenizer train ...``."""
    parser = argparse.ArgumentParser(prog="python -m megatron.training.tokenizer")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a byte-level BPE tokenizer")
    train.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    train.add_argument("--output-dir", required=True, help="the folder (created when missing)")
    train.add_argument("--vocab-size", type=int, default=4096)
    train.add_argument("--eod-token", default=DEFAULT_EOD, help="end-of-document token")
    train.add_argument("--special-tokens", nargs="*", default=None, help="more special tokens")
    train.add_argument("--chat-template", default="chatml", help="chatml, a Jinja file, or none")
    train.add_argument("--min-frequency", type=int, default=2)
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the tokenizer files of an --output-dir that already holds a tokenizer",
    )
    args = parser.parse_args(argv)
    out = train_tokenizer(
        args.input,
        args.output_dir,
        vocab_size=args.vocab_size,
        eod_token=args.eod_token,
        special_tokens=args.special_tokens,
        chat_template=args.chat_template,
        min_frequency=args.min_frequency,
        overwrite=args.overwrite,
    )
    files = [n for n in WRITTEN if os.path.isfile(os.path.join(out, n))]
    print(f"tokenizer written to {out} ({', '.join(files)})")
    return out


def _template(chat_template: Optional[str]) -> Optional[str]:
    if chat_template in (None, "none"):
        return None
    if chat_template == "chatml":
        return CHATML_TEMPLATE
    if not os.path.isfile(chat_template):
        raise FileNotFoundError(
            f"--chat-template {chat_template!r}: expected chatml, none or a Jinja file"
        )
    with open(chat_template, encoding="utf-8") as f:
        return f.read()


def _texts(inputs: Sequence[str]) -> Iterator[str]:
    for path in inputs:
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(
                        f"{path}:{line_no}: not UTF-8 text (byte 0x{raw[err.start]:02x} at "
                        f"column {err.start + 1}); expected UTF-8 files"
                    ) from None
                if not line.strip():
                    continue
                if path.endswith(".jsonl"):
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
                    yield from _strings(record)
                else:
                    yield line


def _strings(value: Any) -> List[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for key, v in value.items() if key != "role" for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []
