"""A HuggingFace tokenizer folder (or a bare ``tokenizer.json``) for training, with its chat
template: ``load_hf_tokenizer(path)``.

What is read, with the ``tokenizers`` library only (no ``transformers`` at run time):

- ``tokenizer.json``: the vocabulary, merges, added (special) tokens; ``path`` may be this file
  or the folder holding it.
- ``tokenizer_config.json`` beside it, when present: ``chat_template`` (a string, or a list of
  ``{"name", "template"}`` of which ``default`` is used), ``eos_token``, ``bos_token``,
  ``pad_token``, ``unk_token`` (strings, or ``{"content": ...}`` as ``transformers`` writes
  added tokens). A ``chat_template.jinja`` file beside it (``transformers`` 5 writes the
  template there) is used when the config has none.

End-of-document (``eod``, megatron's name; the token appended to documents and the default
padding) is, in order: the ``eod_token`` argument (``--eod-token``), the config's
``eos_token``, else the first of ``<|endoftext|>``, ``</s>``, ``<eos>``, ``<|end_of_text|>``,
``<|im_end|>`` in the vocabulary; none of these is an error naming the file.
"""

from typing import Dict, List, Optional, Tuple

import numpy

from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer
from megatron.core.tokenizers.hf_folder import read_tokenizer_config, resolve_tokenizer_file

_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")
_PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]")


def load_hf_tokenizer(path: str, eod_token: Optional[str] = None) -> "HuggingFaceTokenizer":
    """The tokenizer in HuggingFace folder ``path`` (``tokenizer.json`` +
    ``tokenizer_config.json``) or in the ``tokenizer.json`` file ``path``; ``eod_token``
    overrides the end-of-document token (module docstring). Every file problem raises an
    error naming the file."""
    tokenizer_file = resolve_tokenizer_file(path)
    config, template, special = read_tokenizer_config(tokenizer_file)
    return HuggingFaceTokenizer(tokenizer_file, special, template, eod_token)


class HuggingFaceTokenizer(MegatronLegacyTokenizer):
    """megatron's legacy tokenizer interface over a ``tokenizers.Tokenizer``, plus what chat
    data needs: ``chat_template`` (a Jinja string or ``None``), ``special_tokens`` (the
    ``bos_token``/``eos_token``/... strings a template may use), and
    ``encode_with_offsets(text)`` (ids and character spans). ``tokenize`` never adds the
    tokenizer's own special tokens (a chat template writes them itself)."""

    def __init__(
        self,
        tokenizer_file: str,
        special_tokens: Dict[str, str],
        chat_template: Optional[str],
        eod_token: Optional[str] = None,
    ) -> None:
        super().__init__(tokenizer_file, eod_token=eod_token)
        try:
            from tokenizers import Tokenizer
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                f"tokenizer {tokenizer_file}: reading it needs the 'tokenizers' package "
                "(pip install -e '.[hf]')"
            ) from err
        self.path = tokenizer_file
        try:
            self._tok = Tokenizer.from_file(tokenizer_file)
        except Exception as err:  # the library raises a bare Exception on a bad file
            raise ValueError(
                f"tokenizer file {tokenizer_file}: not a valid HuggingFace tokenizers JSON "
                f"file ({err})"
            ) from None
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        if eod_token is not None:
            if eod_token not in self._vocab:
                raise ValueError(
                    f"--eod-token {eod_token!r}: not a token of {tokenizer_file} (expected one "
                    f"of its tokens, e.g. {', '.join(self._special_names()[:6]) or 'none'})"
                )
            self._eod = self._vocab[eod_token]
        else:
            eos = self.special_tokens.get("eos_token")
            names = ([eos] if eos in self._vocab else []) + list(_EOD_CANDIDATES)
            found = [n for n in names if n in self._vocab]
            if not found:
                raise ValueError(
                    f"tokenizer {tokenizer_file}: no end-of-document token (no eos_token in "
                    f"tokenizer_config.json, none of {', '.join(_EOD_CANDIDATES)}); pass "
                    "--eod-token TOKEN"
                )
            self._eod = self._vocab[found[0]]
        pad = self.special_tokens.get("pad_token")
        pads = [n for n in ([pad] if pad else []) + list(_PAD_CANDIDATES) if n in self._vocab]
        self._pad = self._vocab[pads[0]] if pads else None
        bos = self.special_tokens.get("bos_token")
        self._bos = self._vocab.get(bos) if bos else None

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    @property
    def document_prefix(self) -> List[int]:
        """The ids the tokenizer's own post-processor puts before a text (e.g. Llama's
        ``<|begin_of_text|>``; empty for GPT-2 style tokenizers): plain-text records start
        with them, as ``tokenizer(text)`` would give."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[:start]
        return []

    def encode_with_offsets(self, text: str) -> Tuple[List[int], List[Tuple[int, int]]]:
        """Ids of ``text`` (no added special tokens) and each id's ``(start, end)`` character
        span in ``text``."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def detokenize(self, ids: List[int]) -> str:
        return self._tok.decode(
            [int(i) for i in numpy.asarray(ids).tolist()], skip_special_tokens=False
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {i: t for t, i in self._vocab.items()}

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        """The pad token's id, or ``eod`` when the tokenizer has none (padding is never
        trained, so any id serves)."""
        return self._eod if self._pad is None else self._pad

    @property
    def bos(self) -> Optional[int]:
        return self._bos

    def _special_names(self) -> List[str]:
        return [t.content for t in self._tok.get_added_tokens_decoder().values()]
