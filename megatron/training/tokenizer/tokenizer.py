"""megatron-LM's training tokenizers: ``build_tokenizer(args)`` and ``_NullTokenizer``.

Provided: ``NullTokenizer`` (integer ids as text), ``ByteLevelTokenizer`` (UTF-8 bytes 0-255,
eod 256, pad 257; needs no file) and ``HuggingFaceTokenizer`` for a HuggingFace tokenizer
folder or ``tokenizers`` JSON file (``--tokenizer-model path/tokenizer.json``;
``load_hf_tokenizer``; needs the ``tokenizers`` package).
"""

from typing import Any, List

import numpy

from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer
from megatron.core.tokenizers.text import NullTokenizer
from megatron.training.tokenizer.hf_tokenizer import load_hf_tokenizer


class _NullTokenizer(MegatronLegacyTokenizer):
    """``"3 1 4"`` <-> ``[3, 1, 4]``; ids ``0..vocab_size-1`` plus eod = ``vocab_size``.

    ``vocab_size`` reports ``vocab_size + 1`` (the eod id included), as megatron's does. The
    ids come from ``megatron.core.tokenizers.text.NullTokenizer``; this class adapts it to the
    legacy interface.
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__(None, vocab_size=vocab_size)
        self._tok = NullTokenizer(vocab_size)

    def tokenize(self, text: str) -> List[int]:
        return self._tok.text_to_ids(text)

    def detokenize(self, ids: List[int]) -> str:
        return self._tok.ids_to_text(ids)

    def offsets(self, ids: List[int], text: str) -> List[int]:
        return self._tok.offsets(ids, text)

    @property
    def vocab_size(self) -> int:
        return self._tok.vocab_size

    @property
    def cls(self) -> int:
        return -1

    @property
    def sep(self) -> int:
        return -1

    @property
    def mask(self) -> int:
        return -1

    @property
    def eod(self) -> int:
        return self._tok.eod

    @property
    def additional_special_tokens_ids(self) -> None:
        return None


class _ByteLevelTokenizer(MegatronLegacyTokenizer):
    """UTF-8 bytes are ids 0-255; eod = 256, pad = 257; ``vocab_size`` = 258. No file."""

    BYTES = 256

    def __init__(self) -> None:
        super().__init__(None)

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: List[int]) -> str:
        data = bytes(int(i) for i in numpy.asarray(ids).tolist() if 0 <= int(i) < self.BYTES)
        return data.decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return self.BYTES + 2

    @property
    def eod(self) -> int:
        return self.BYTES

    @property
    def pad(self) -> int:
        return self.BYTES + 1


def build_tokenizer(args: Any, **kwargs: Any) -> MegatronLegacyTokenizer:
    """Tokenizer named by ``args.tokenizer_type``: ``NullTokenizer`` (``args.vocab_size``),
    ``ByteLevelTokenizer``, or ``HuggingFaceTokenizer`` / ``TokenizersFile`` for a
    ``tokenizers`` JSON file at ``args.tokenizer_model``. Sets ``args.padded_vocab_size``
    when ``args`` has ``make_vocab_size_divisible_by``."""
    kind = getattr(args, "tokenizer_type", None)
    if kind == "NullTokenizer":
        tokenizer: MegatronLegacyTokenizer = _NullTokenizer(args.vocab_size)
    elif kind == "ByteLevelTokenizer":
        tokenizer = _ByteLevelTokenizer()
    elif kind in ("HuggingFaceTokenizer", "TokenizersFile"):
        # a folder or tokenizer.json; eod from eod_token, else the config's eos_token (the
        # same choice the trainer's --tokenizer makes, so preprocessed data agrees with it)
        tokenizer = load_hf_tokenizer(
            args.tokenizer_model, eod_token=getattr(args, "eod_token", None)
        )
    else:
        raise NotImplementedError(
            f"tokenizer_type={kind!r}: expected NullTokenizer, ByteLevelTokenizer or "
            "HuggingFaceTokenizer (a tokenizers JSON file)"
        )
    divisor = getattr(args, "make_vocab_size_divisible_by", None)
    if divisor:
        multiple = divisor * max(1, int(getattr(args, "tensor_model_parallel_size", 1) or 1))
        args.padded_vocab_size = -(-tokenizer.vocab_size // multiple) * multiple
    return tokenizer
