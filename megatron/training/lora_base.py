"""The frozen base of a LoRA run, recorded in its checkpoints (``LORA_BASE_KEY``).

An adapter-only checkpoint (``--save-trainable-params-only``) holds no base weight: on resume
the base comes from ``--hf-model`` or ``--pretrained-checkpoint``. The checkpoint records
which base it was trained on (the flag, the absolute path, a fingerprint of the files), so a
resume on other weights of the same shapes is refused by name instead of silently training
the adapters on a base they do not belong to; the absolute path is also the PEFT adapter's
``base_model_name_or_path``.

The fingerprint samples the base's weight files (their names, sizes, the first 64 KiB and
64 blocks of 4 KiB spread over each; a file under 1 MiB whole): moving or copying the base
keeps it, other weights change it (a base differing from the recorded one only in bytes
that no sample reads would pass).
"""

import hashlib
from pathlib import Path
from typing import Any, Dict, List, Optional

LORA_BASE_KEY = "lora_base"
_WHOLE_FILE = 1 << 20
_HEAD = 64 << 10
_BLOCK = 4 << 10
_BLOCKS = 64


def lora_base_record(flag: str, path: str, weights: Optional[str] = None) -> Dict[str, str]:
    """{flag, absolute path, fingerprint} of the base given by ``flag`` (``--hf-model`` or
    ``--pretrained-checkpoint``) at ``path``; ``weights``: the folder its weights load from
    when not ``path`` itself (a checkpoint's iteration that ``--pretrained-checkpoint``
    loads, resolved by the caller)."""
    fingerprint = base_fingerprint(weights or path)
    return {"flag": flag, "path": str(Path(path).resolve()), "fingerprint": fingerprint}


def base_fingerprint(path: str) -> str:
    """A hash of the base's weight files: a HuggingFace folder's ``*.safetensors``, else
    every file under ``path`` (a checkpoint iteration's folder)."""
    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        files = sorted(p for p in root.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(root)}:{file.stat().st_size};".encode())
        for block in _samples(file):
            digest.update(block)
    return digest.hexdigest()[:32]


def check_lora_base(
    saved: Optional[Dict[str, Any]],
    flag: str,
    path: Optional[str],
    where: str,
    weights: Optional[str] = None,
) -> None:
    """Refuse (ValueError naming the flags and paths) a base at ``path`` (its weights in
    ``weights`` when given, as for ``lora_base_record``) whose fingerprint is not the recorded
    one (``saved``: the checkpoint's ``LORA_BASE_KEY``; None: an older checkpoint, not
    checked)."""
    if not saved or path is None:
        return
    now = base_fingerprint(weights or path)
    if now == saved.get("fingerprint"):
        return
    raise ValueError(
        f"{where} holds LoRA adapters trained on the base {saved.get('flag')} "
        f"{saved.get('path')} (fingerprint {saved.get('fingerprint')}), but {flag} {path} "
        f"holds other weights (fingerprint {now}); pass the base the adapters were trained on"
    )


def _samples(file: Path) -> List[bytes]:
    size = file.stat().st_size
    with open(file, "rb") as f:
        if size <= _WHOLE_FILE:
            return [f.read()]
        blocks = [f.read(_HEAD)]
        step = (size - _BLOCK) // (_BLOCKS - 1)
        for i in range(_BLOCKS):
            f.seek(i * step)
            blocks.append(f.read(_BLOCK))
        return blocks
