"""A HuggingFace tokenizer folder (or a bare ``tokenizer.json``) for training, with its chat
template: ``load_hf_tokenizer(path)``.

The files are read by megatron-core's ``TokenizersFileTokenizer`` (``tokenizers`` library only,
no ``transformers`` at run time); this module adds megatron's legacy interface and the choice
of the end-of-document token:

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
from megatron.core.tokenizers.text import EOD_CANDIDATES, TokenizersFileTokenizer


def load_hf_tokenizer(path: str, eod_token: Optional[str] = None) -> "HuggingFaceTokenizer":
    """The tokenizer in HuggingFace folder ``path`` (``tokenizer.json`` +
    ``tokenizer_config.json``) or in the ``tokenizer.json`` file ``path``; ``eod_token``
    overrides the end-of-document token (module docstring). Every file problem raises an
    error naming the file."""
    return HuggingFaceTokenizer(path, eod_token)


class HuggingFaceTokenizer(MegatronLegacyTokenizer):
    """megatron's legacy tokenizer interface over a HuggingFace tokenizer, plus what chat
    data needs: ``chat_template`` (a Jinja string or ``None``), ``special_tokens`` (the
    ``bos_token``/``eos_token``/... strings a template may use), ``encode_with_offsets(text)``
    (ids and character spans) and ``document_prefix`` (the ids the tokenizer puts before a
    text, e.g. BOS). ``tokenize`` never adds the tokenizer's own special tokens (a chat
    template writes them itself)."""

    def __init__(self, path: str, eod_token: Optional[str] = None) -> None:
        self._files = TokenizersFileTokenizer(path)
        super().__init__(self._files.path, eod_token=eod_token)
        self.path = self._files.path
        self.chat_template: Optional[str] = self._files.chat_template
        self.special_tokens: Dict[str, str] = dict(self._files.special_tokens)
        vocab = self._files.vocab
        if eod_token is not None:
            if eod_token not in vocab:
                special = list(self.special_tokens.values())
                raise ValueError(
                    f"--eod-token {eod_token!r}: not a token of {self.path} (expected one of "
                    f"its tokens, e.g. {', '.join(special) or 'its eos_token'})"
                )
            self._eod = vocab[eod_token]
        elif self._files.eod is None:
            raise ValueError(
                f"tokenizer {self.path}: no end-of-document token (no eos_token in "
                f"tokenizer_config.json, none of {', '.join(EOD_CANDIDATES)}); pass "
                "--eod-token TOKEN"
            )
        else:
            self._eod = self._files.eod

    def tokenize(self, text: str) -> List[int]:
        return self._files.text_to_ids(text)

    def encode_with_offsets(self, text: str) -> Tuple[List[int], List[Tuple[int, int]]]:
        """Ids of ``text`` (no added special tokens) and each id's ``(start, end)`` character
        span in ``text``."""
        return self._files.encode_with_offsets(text)

    @property
    def document_prefix(self) -> List[int]:
        """The ids the tokenizer's own post-processor puts before a text (e.g. Llama's
        ``<|begin_of_text|>``); plain-text records start with them, as ``tokenizer(text)``
        would give."""
        return self._files.document_prefix

    def detokenize(self, ids: List[int]) -> str:
        return self._files.ids_to_text(numpy.asarray(ids).tolist(), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._files.vocab_size

    @property
    def vocab(self) -> Dict[str, int]:
        return self._files.vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {i: t for t, i in self._files.vocab.items()}

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        """The pad token's id, or ``eod`` when the tokenizer has none (padding is never
        trained, so any id serves)."""
        return self._eod if self._files.pad_id is None else self._files.pad_id

    @property
    def bos(self) -> Optional[int]:
        return self._files.bos_id
