"""Where an export may write (no torch: the launcher checks ``--export-hf`` before any
worker starts).

An export never destroys what it did not write: its target must be new, empty or an earlier
export of ours, recognised by the metadata our safetensors files carry; anything else is
refused naming the folder unless the user asks to overwrite it.
"""

import json
import re
import struct
from pathlib import Path
from typing import List, Optional

INDEX_FILENAME = "model.safetensors.index.json"
SINGLE_FILENAME = "model.safetensors"
EXPORTED_BY = "megatron.training.hf"
# The safetensors metadata of our exports: how a folder is recognised as an earlier export.
EXPORT_METADATA = {"format": "pt", "exported_by": EXPORTED_BY}
# Part of the name of the folder an export is staged in, beside its target.
STAGING_MARK = ".export-staging-"
# Small files of a HuggingFace directory carried through a checkpoint to the export.
SIDECAR_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
_ITERATION_DIR = re.compile(r"iter_\d{7}")
_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own bound on a header


def check_export_target(out_dir, overwrite: bool = False, flag: str = "--out") -> Path:
    """``out_dir`` as a Path when an export may write there: a new folder, an empty one, or
    an earlier export of ours (every entry one we write: config.json, the marked
    safetensors, the index, the carried tokenizer files, ``iter_*`` exports, a stale
    staging folder); with ``overwrite`` any folder. Otherwise a one-line error naming the
    folder (``flag``: the option that named it)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(
            f"{flag} {out} is a file; expected a folder for the HuggingFace model (a new or "
            "empty one, or an earlier export)"
        )
    if out.is_dir() and not overwrite:
        foreign = foreign_entries(out)
        if foreign:
            shown = ", ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else "")
            raise ValueError(
                f"{flag} {out}: the folder is not empty and is not an earlier export of ours "
                f"(it holds {shown}); refusing to replace what it holds: choose a new or empty "
                "folder (python -m megatron.training.hf export --overwrite replaces its model "
                "files)"
            )
    return out


def foreign_entries(folder: Path) -> List[str]:
    """The entries of ``folder`` that an export of ours did not write (see
    ``check_export_target``)."""
    ours = {"config.json", "adapter_config.json", INDEX_FILENAME, *SIDECAR_FILES}
    foreign = []
    for entry in sorted(folder.iterdir()):
        name = entry.name
        if entry.is_dir():
            mine = (_ITERATION_DIR.fullmatch(name) and not foreign_entries(entry)) or (
                STAGING_MARK in name
            )
        elif name.endswith(".safetensors") and name.startswith(("model", "adapter_model")):
            mine = _is_our_export(entry)
        else:
            mine = name in ours
        if not mine:
            foreign.append(name)
    return foreign


def tensor_names(directory) -> Optional[List[str]]:
    """The tensor names of the HuggingFace checkpoint in ``directory`` (the index's weight
    map, else ``model.safetensors``'s header), without torch; None when neither is there or
    readable (the weight loader names that problem)."""
    folder = Path(directory)
    try:
        if (folder / INDEX_FILENAME).is_file():
            return list(json.loads((folder / INDEX_FILENAME).read_text())["weight_map"])
        header = _header(folder / SINGLE_FILENAME)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None if header is None else [k for k in header if k != "__metadata__"]


def _header(path: Path) -> Optional[dict]:
    """A safetensors file's JSON header (8 bytes of little-endian length, then the JSON);
    None when it is not one."""
    try:
        with open(path, "rb") as handle:
            length = struct.unpack("<Q", handle.read(8))[0]
            if length > _HEADER_LIMIT:
                return None
            header = json.loads(handle.read(length))
    except (OSError, struct.error, ValueError):  # not a safetensors file at all
        return None
    return header if isinstance(header, dict) else None


def _is_our_export(path: Path) -> bool:
    """Whether the safetensors file ``path`` carries our export's metadata (read from its
    header: 8 bytes of little-endian length, then that many bytes of JSON)."""
    header = _header(path)
    metadata = header.get("__metadata__") if header is not None else None
    return isinstance(metadata, dict) and metadata.get("exported_by") == EXPORTED_BY
