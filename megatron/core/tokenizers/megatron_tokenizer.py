"""``MegatronTokenizer.from_pretrained``: restore a tokenizer from its metadata."""

import json
import os
from typing import Any, Optional, Union

from megatron.core.tokenizers.base_tokenizer import MegatronTokenizerBase

TOKENIZER_LIBRARIES = ["sentencepiece", "huggingface", "megatron", "tiktoken", "byte-level", "null"]

# libraries that need no tokenizer file ("null-text" is newer megatron's name for "null")
_FILELESS = {"null", "null-text", "byte-level"}


class MegatronTokenizer:
    """Entry point only: use ``MegatronTokenizer.from_pretrained(...)``."""

    def __init__(self) -> None:
        raise EnvironmentError(
            "MegatronTokenizer is built with MegatronTokenizer.from_pretrained(), not directly"
        )

    @staticmethod
    def from_pretrained(
        tokenizer_path: Optional[str] = None,
        metadata_path: Optional[Union[str, dict]] = None,
        **kwargs: Any,
    ) -> MegatronTokenizerBase:
        """The tokenizer described by ``metadata_path`` (a JSON file or a dict with at least
        ``library``), for the file at ``tokenizer_path`` where the library needs one.

        ``metadata_path`` defaults to ``<tokenizer dir>/tokenizer_metadata.json``. Extra
        keyword arguments go to the library (``vocab_size`` for ``null``; ``vocab_size``,
        ``_eos_id``, ``_pad_id``, ``_bos_id``, ``special_tokens`` for ``byte-level``). The
        misspelt ``metdata_path`` of newer megatron's example script is accepted too.
        """
        from megatron.core.tokenizers.text import MegatronTokenizerText

        if "metdata_path" in kwargs:
            alias = kwargs.pop("metdata_path")
            if metadata_path is not None:
                raise ValueError("give metadata_path or metdata_path, not both")
            metadata_path = alias
        if not metadata_path:
            if tokenizer_path is None:
                raise ValueError(
                    "MegatronTokenizer.from_pretrained: tokenizer_path=None and "
                    "metadata_path=None; expected a metadata dict/file (e.g. "
                    "{'library': 'null'}) or a tokenizer path"
                )
            metadata_path = _get_metadata_path(tokenizer_path)
        if isinstance(metadata_path, str):
            if not os.path.exists(metadata_path):
                raise FileNotFoundError(
                    f"metadata_path={metadata_path!r} does not exist; write one with "
                    "MegatronTokenizer.write_metadata() or pass a dict"
                )
            with open(metadata_path) as f:
                metadata = json.load(f)
        elif isinstance(metadata_path, dict):
            metadata = dict(metadata_path)
            metadata_path = None
        else:
            raise ValueError(
                f"metadata_path={metadata_path!r}: expected a str or a dict, got "
                f"{type(metadata_path).__name__}"
            )
        library = metadata.get("library")
        if library not in _FILELESS and not tokenizer_path:
            raise ValueError(f"library={library!r} needs a tokenizer file: tokenizer_path=None")
        metadata["metadata_path"] = metadata_path
        return MegatronTokenizerText(path=tokenizer_path, config=metadata, **kwargs)

    @staticmethod
    def write_metadata(
        tokenizer_path: str,
        tokenizer_library: str,
        model_type: Optional[str] = None,
        tokenizer_class: Optional[type] = None,
        chat_template: Optional[str] = None,
        overwrite: Optional[bool] = False,
        metadata_path: Optional[str] = None,
    ) -> None:
        """Write ``tokenizer_metadata.json`` next to the tokenizer (or at ``metadata_path``)."""
        if not os.path.exists(tokenizer_path):
            raise FileNotFoundError(f"tokenizer_path={tokenizer_path!r} does not exist")
        if tokenizer_library not in TOKENIZER_LIBRARIES:
            raise ValueError(
                f"tokenizer_library={tokenizer_library!r}: expected one of {TOKENIZER_LIBRARIES}"
            )
        if model_type is None and tokenizer_class is None:
            model_type = "default"
        metadata_path = metadata_path or _get_metadata_path(tokenizer_path)
        if os.path.exists(metadata_path) and not overwrite:
            raise ValueError(f"{metadata_path} exists; pass overwrite=True to replace it")
        metadata = {
            "library": tokenizer_library,
            "class_name": tokenizer_class.__name__ if tokenizer_class else None,
            "class_path": tokenizer_class.__module__ if tokenizer_class else None,
            "model_type": model_type,
            "chat_template": chat_template,
        }
        with open(metadata_path, "w") as f:
            json.dump(metadata, f)


def _get_metadata_path(tokenizer_path: str) -> str:
    directory = (
        os.path.dirname(tokenizer_path) if os.path.isfile(tokenizer_path) else tokenizer_path
    )
    return f"{directory}/tokenizer_metadata.json"
