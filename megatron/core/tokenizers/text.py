"""Text tokenizers behind ``MegatronTokenizer.from_pretrained`` (one wrapper, three libraries).

- ``null`` / ``null-text``: ``"3 1 4"`` <-> ``[3, 1, 4]``; ``vocab_size`` ids plus an
  end-of-document id equal to ``vocab_size`` (so ``tokenizer.vocab_size == vocab_size + 1``).
- ``byte-level``: UTF-8 bytes are the ids (megatron-core's defaults: ``vocab_size=512``,
  eos 0, pad 1, no bos).
- ``huggingface``: a HuggingFace ``tokenizers`` JSON file (``tokenizer.json``, or a folder
  holding one). The library is only imported for this case.
"""

from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple, Union

from megatron.core.tokenizers.base_tokenizer import MegatronTokenizerBase


class NullTokenizer:
    """Integer ids written as whitespace-separated text; eod = ``vocab_size``."""

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size_without_eod = int(vocab_size)
        self._eod_id = self._vocab_size_without_eod

    def text_to_ids(self, text: str) -> List[int]:
        return [int(x) for x in text.split(" ")]

    def ids_to_text(self, ids: List[int]) -> str:
        return " ".join(str(x) for x in ids)

    def offsets(self, ids: List[int], text: str) -> List[int]:
        out, start = [], 0
        for i in ids:
            out.append(start)
            start += 1 + len(str(i))
        return out

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def eod(self) -> int:
        return self._eod_id


class ByteLevelTokenizer:
    """UTF-8 bytes as ids; special tokens take the top ids of ``vocab_size``."""

    def __init__(
        self,
        special_tokens: Optional[Union[Dict[str, str], List[str]]] = None,
        vocab_size: int = 512,
        _eos_id: int = 0,
        _pad_id: int = 1,
        _bos_id: Optional[int] = None,
    ) -> None:
        if vocab_size < 256:
            raise ValueError(f"vocab_size={vocab_size}: a byte-level vocabulary needs >= 256")
        self.eos_id, self.pad_id, self.bos_id = _eos_id, _pad_id, _bos_id
        special_tokens = special_tokens or []
        self.vocab_size = vocab_size + len(special_tokens)
        self.special_token_to_id: Dict[Any, int] = {}
        top = self.vocab_size
        for token in special_tokens:
            top -= 1
            self.special_token_to_id[token] = top
        self.special_start = top

    def text_to_ids(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def ids_to_text(self, ids: List[int]) -> str:
        kept = [int(i) for i in ids if 0 <= int(i) < min(256, self.special_start)]
        return bytes(kept).decode("utf-8", errors="ignore")

    @property
    def eod(self) -> int:
        return self.eos_id


EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")


class TokenizersFileTokenizer:
    """A HuggingFace ``tokenizers`` JSON file, or a folder holding ``tokenizer.json`` (and
    ``tokenizer_config.json``: its chat template and special tokens, read by
    ``megatron.core.tokenizers.hf_folder``).

    End-of-document is ``eod_token`` if given, else the config's ``eos_token``, else the first
    of ``EOD_CANDIDATES`` in the vocabulary (``None`` when none is); pad and bos likewise from
    ``pad_token``/``bos_token``.
    """

    def __init__(
        self,
        path: str,
        eod_token: Optional[str] = None,
        pad_token: Optional[str] = None,
        bos_token: Optional[str] = None,
        **_: Any,
    ) -> None:
        from megatron.core.tokenizers.hf_folder import (
            read_tokenizer_config,
            resolve_tokenizer_file,
        )

        try:
            from tokenizers import Tokenizer
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the huggingface tokenizer file needs the 'tokenizers' package: "
                "pip install -e '.[hf]'"
            ) from err
        path = resolve_tokenizer_file(path)
        self.path = path
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as err:  # the library raises a bare Exception on a bad file
            raise ValueError(
                f"tokenizer file {path}: not a valid HuggingFace tokenizers JSON file ({err})"
            ) from None
        _, self.chat_template, self.special_tokens = read_tokenizer_config(path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab = vocab
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

        def find(explicit: Optional[str], key: str, candidates: List[str]) -> Optional[int]:
            if explicit is not None:
                if explicit not in vocab:
                    raise ValueError(f"token {explicit!r} is not in the vocabulary of {path}")
                return vocab[explicit]
            configured = self.special_tokens.get(key)
            for name in ([configured] if configured else []) + candidates:
                if name in vocab:
                    return vocab[name]
            return None

        self.eod = find(eod_token, "eos_token", list(EOD_CANDIDATES))
        self.pad_id = find(pad_token, "pad_token", ["<pad>", "<|pad|>", "[PAD]"])
        self.bos_id = find(bos_token, "bos_token", ["<s>", "<bos>", "<|begin_of_text|>"])
        self.eos_id = self.eod

    def text_to_ids(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> Tuple[List[int], List[Tuple[int, int]]]:
        """Ids of ``text`` (no added special tokens) and their character spans."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def ids_to_text(self, ids: List[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def document_prefix(self) -> List[int]:
        """The ids the tokenizer's own post-processor puts before a text (e.g. Llama's
        ``<|begin_of_text|>``; empty for GPT-2 style tokenizers)."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[:start]
        return []


_LIBRARIES = {
    "null": NullTokenizer,
    "null-text": NullTokenizer,
    "byte-level": ByteLevelTokenizer,
    "huggingface": TokenizersFileTokenizer,
}


class MegatronTokenizerText(MegatronTokenizerBase):
    """The object ``MegatronTokenizer.from_pretrained`` returns for text libraries."""

    def __init__(self, path: Optional[str], config: dict, **kwargs: Any) -> None:
        super().__init__(path, config, **kwargs)
        library = config.get("library")
        if library not in _LIBRARIES:
            raise NotImplementedError(
                f"library={library!r}: this project provides {sorted(_LIBRARIES)}"
            )
        cls = _LIBRARIES[library]
        self._tokenizer = cls(path, **kwargs) if library == "huggingface" else cls(**kwargs)
        self.additional_args = kwargs
        # megatron-core's order: the metadata's template, the tokenizer's own, the kwargs'
        self.chat_template = (
            config.get("chat_template")
            or getattr(self._tokenizer, "chat_template", None)
            or kwargs.get("chat_template")
        )

    def apply_chat_template(
        self,
        conversation: List[Dict[str, Any]],
        chat_template: Optional[str] = None,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> Union[str, List[int]]:
        """``conversation`` rendered with ``chat_template`` (default: the tokenizer's), as
        token ids (``tokenize=True``, no added special tokens: the template writes them) or
        as text. Other keyword arguments are template variables."""
        from megatron.core.tokenizers.chat_template import render_chat

        template = chat_template or self.chat_template
        if not template:
            raise ValueError(
                f"apply_chat_template: chat_template=None and the {self.library} tokenizer has "
                "no chat template (expected chat_template in the metadata or the tokenizer "
                "folder's tokenizer_config.json)"
            )
        variables = dict(getattr(self._tokenizer, "special_tokens", {}))
        variables.update(kwargs)
        text = render_chat(template, conversation, variables, add_generation_prompt)
        return self.tokenize(text) if tokenize else text

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer.text_to_ids(text)

    def detokenize(self, ids: List[int]) -> str:
        return self._tokenizer.ids_to_text(ids)

    def offsets(self, ids: List[int], text: str) -> List[int]:
        return self._tokenizer.offsets(ids, text)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.vocab_size

    @property
    def vocab(self) -> Dict[str, int]:
        return self._tokenizer.vocab

    @property
    def unique_identifiers(self) -> "OrderedDict[str, Any]":
        ids: "OrderedDict[str, Any]" = OrderedDict()
        ids["class"] = f"{type(self).__module__}.{type(self).__qualname__}"
        ids["tokenizer_path"] = self.path
        for key, value in self.additional_args.items():
            ids[key] = str(value)
        return ids

    @property
    def eod(self) -> int:
        return self._tokenizer.eod

    @property
    def pad(self) -> int:
        return self._special("pad_id")

    @property
    def pad_id(self) -> int:
        return self._special("pad_id")

    @property
    def eos(self) -> int:
        return self._special("eos_id")

    @property
    def eos_id(self) -> int:
        return self._special("eos_id")

    @property
    def bos(self) -> int:
        return self._special("bos_id")

    @property
    def bos_id(self) -> int:
        return self._special("bos_id")

    def _special(self, name: str) -> int:
        value = getattr(self._tokenizer, name, None)
        if value is None:
            raise AttributeError(f"{self.library} tokenizer has no {name}")
        return value
