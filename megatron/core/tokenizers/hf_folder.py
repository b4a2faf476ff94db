"""The files of a HuggingFace tokenizer folder, read without ``transformers``.

``resolve_tokenizer_file(path)``: ``path`` itself when it is a file, else ``path/tokenizer.json``.
``read_tokenizer_config(tokenizer_file)``: from ``tokenizer_config.json`` beside it (when
present) the config dict, the chat template (``chat_template`` as a string, or the ``default``
entry of a list of ``{"name", "template"}``; else a ``chat_template.jinja`` file, where
``transformers`` 5 writes it) and the special token strings ``bos_token``, ``eos_token``,
``pad_token``, ``unk_token`` (written as strings or as ``{"content": ...}``). Every problem is an
error naming the file (and the line, for JSON).
"""

import json
import os
from typing import Any, Dict, Optional, Tuple

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def resolve_tokenizer_file(path: str) -> str:
    """The ``tokenizer.json`` that ``path`` (a file or a folder) names."""
    if os.path.isdir(path):
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(
                f"tokenizer folder {path}: no tokenizer.json in it (expected a HuggingFace "
                "tokenizer folder holding tokenizer.json and tokenizer_config.json)"
            )
        return tokenizer_file
    if os.path.isfile(path):
        return path
    raise FileNotFoundError(
        f"tokenizer {path}: no such file or folder (expected a tokenizers JSON file or a "
        "HuggingFace folder holding tokenizer.json)"
    )


def read_tokenizer_config(
    tokenizer_file: str,
) -> Tuple[Dict[str, Any], Optional[str], Dict[str, str]]:
    """``(config, chat_template, special_tokens)`` of the folder holding ``tokenizer_file``."""
    folder = os.path.dirname(os.path.abspath(tokenizer_file))
    config_file = os.path.join(folder, "tokenizer_config.json")
    config = _read_json(config_file) if os.path.isfile(config_file) else {}
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    template = _chat_template(config, config_file)
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    special: Dict[str, str] = {}
    for key in SPECIAL_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            special[key] = value
    return config, template, special


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None


def _chat_template(config: Dict[str, Any], config_file: str) -> Optional[str]:
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(
            f"{config_file}: chat_template is a list without a 'default' entry (names: "
            f"{sorted(str(n) for n in named)}); expected a template string"
        )
    raise ValueError(
        f"{config_file}: chat_template is a {type(template).__name__}; expected a string"
    )
