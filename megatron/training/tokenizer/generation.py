"""The text side of ``python -m megatron.training.generate``: prompts to ids, ids to text,
and the ids that end a completion.

``generation_codec(spec)``: ``"byte-level"`` (UTF-8 bytes, end-of-document 256, the trainer's
default with ``--data-path``), or a HuggingFace tokenizer folder / ``tokenizer.json``.

Stopping (as HuggingFace's ``generation_config.eos_token_id``, a list: any of them ends the
completion): the tokenizer's ``eos_token`` (or the run's ``--eod-token``), every id of a
``generation_config.json`` beside the tokenizer or in the model folder, and the chat
template's end of turn: the first special token the template writes after an assistant's
content (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``), found by rendering a short
conversation. The stop token itself is not part of the text.

Decoding: the whole completion is decoded at once (special tokens shown, so nothing the
model wrote is hidden), and a last character whose UTF-8 bytes are not all there yet (a
completion cut by ``--max-new-tokens`` inside a character) is held back instead of printed
as U+FFFD.
"""

import codecs
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Set

BYTE_LEVEL = "byte-level"
_BYTES, _BYTE_EOD = 256, 256
_PROBE = "megatron generate probe"  # the assistant content of the turn-end probe


class ByteCodec:
    """The trainer's byte-level tokenizer: ids 0-255 are UTF-8 bytes, 256 ends a document,
    257 pads (``vocab_size`` 258)."""

    vocab_size = _BYTES + 2

    def __init__(self, eod_token: Optional[str] = None) -> None:
        self.stop_ids: Set[int] = {_BYTE_EOD}

    def encode(self, text: str, chat: bool = False) -> List[int]:
        if chat:
            raise ValueError(
                "--chat: the byte-level tokenizer has no chat template (train with --tokenizer "
                "DIR whose tokenizer_config.json holds one, or leave --chat out)"
            )
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i for i in ids if 0 <= i < _BYTES)
        # an incremental decoder holds back the bytes of an unfinished last character
        return codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=False)


class FileCodec:
    """A HuggingFace ``tokenizers`` file and its folder's ``tokenizer_config.json`` (chat
    template, ``eos_token``) and ``generation_config.json``; ``extra_folders``: more folders
    whose ``generation_config.json`` names stop ids (the ``--hf-model`` folder)."""

    def __init__(
        self,
        tokenizer_file: str,
        eod_token: Optional[str] = None,
        extra_folders: Sequence[str] = (),
    ) -> None:
        from megatron.core.tokenizers.hf_folder import read_tokenizer_config

        self.path = tokenizer_file
        self.tokenizer = _load_tokenizers_file(tokenizer_file)
        _, self.template, self.special = read_tokenizer_config(tokenizer_file)
        self.vocab_size = self.tokenizer.get_vocab_size()
        folders = [os.path.dirname(os.path.abspath(tokenizer_file)), *extra_folders]
        self.stop_ids = self._stop_ids(eod_token, folders)

    def encode(self, text: str, chat: bool = False) -> List[int]:
        """``text`` as the tokenizer's ``__call__`` would encode it (its special tokens
        added), or with ``chat`` as a user turn rendered with the chat template and the
        generation prompt (no special tokens added, as ``apply_chat_template``)."""
        if not chat:
            return self.tokenizer.encode(text, add_special_tokens=True).ids
        if self.template is None:
            raise ValueError(f"--chat: {self.path}'s folder has no chat template")
        rendered = self._render([{"role": "user", "content": text}], True)
        return self.tokenizer.encode(rendered, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """``ids`` as text, an unfinished last character held back (module docstring)."""
        ids = list(ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        for cut in range(1, min(4, len(ids)) + 1):
            if not text.endswith("\ufffd"):
                break
            shorter = self.tokenizer.decode(ids[:-cut], skip_special_tokens=False)
            if not shorter.endswith("\ufffd"):
                return shorter
        return text

    def turn_end_id(self) -> Optional[int]:
        """The first special token the chat template writes after an assistant's content,
        or None (no template, or none written)."""
        if self.template is None:
            return None
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            rendered = self._render(messages, False)
        except (ValueError, ImportError):  # refused, or no jinja2: no turn end known
            return None
        if _PROBE not in rendered:
            return None
        tail = rendered[rendered.index(_PROBE) + len(_PROBE) :]
        special = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        for token in self.tokenizer.encode(tail, add_special_tokens=False).ids:
            if token in special:
                return token
        return None

    def _render(self, messages: List[Dict[str, Any]], prompt: bool) -> str:
        from megatron.core.tokenizers.chat_template import render_chat

        return render_chat(self.template, messages, self.special, prompt)

    def _stop_ids(self, eod_token: Optional[str], folders: Sequence[str]) -> Set[int]:
        stops = set()
        for token in (eod_token, self.special.get("eos_token")):
            if token is not None and self.tokenizer.token_to_id(token) is not None:
                stops.add(self.tokenizer.token_to_id(token))
        for folder in folders:
            stops.update(generation_config_eos_ids(folder))
        turn_end = self.turn_end_id()
        if turn_end is not None:
            stops.add(turn_end)
        return stops


def _load_tokenizers_file(path: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        from megatron.training.errors import missing_package

        raise missing_package("tokenizers", "hf", "a tokenizer.json") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # the library raises a bare Exception on a bad file
        raise ValueError(
            f"tokenizer file {path}: not a valid HuggingFace tokenizers JSON file ({err})"
        ) from None


def generation_config_eos_ids(folder: str) -> List[int]:
    """``eos_token_id`` (an id or a list) of ``folder/generation_config.json``; [] without
    the file; a file that is not JSON is an error naming it."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"{path}: not a JSON object ({err})") from None
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int)]


def generation_codec(
    spec: str, eod_token: Optional[str] = None, extra_folders: Sequence[str] = ()
) -> Any:
    """The codec for tokenizer ``spec`` (module docstring)."""
    if spec == BYTE_LEVEL:
        return ByteCodec(eod_token)
    from megatron.core.tokenizers.hf_folder import resolve_tokenizer_file

    return FileCodec(resolve_tokenizer_file(spec), eod_token, extra_folders)
