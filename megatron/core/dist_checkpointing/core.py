"""The checkpoint's marker file and the package's exception.

``metadata.json`` in a checkpoint directory names the storage backends (the same fields as
megatron-core's). ``save`` writes it last, after every rank has finished writing, so it also
marks the checkpoint complete: a directory without it is not (or not yet) a checkpoint.
"""

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

CONFIG_FNAME = "metadata.json"


class CheckpointingException(Exception):
    """A checkpoint cannot be saved or loaded as asked (the message says why)."""


@dataclass
class CheckpointingConfig:
    """Backends of a checkpoint: tensors through torch.distributed.checkpoint ("torch_dist"),
    the common (non-sharded) state through ``torch.save`` ("torch")."""

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1


def check_is_distributed_checkpoint(checkpoint_dir: Union[str, Path]) -> bool:
    """True when ``checkpoint_dir`` holds a complete checkpoint (its ``metadata.json``)."""
    return maybe_load_config(checkpoint_dir) is not None


def maybe_load_config(checkpoint_dir: Union[str, Path]) -> Optional[CheckpointingConfig]:
    """The checkpoint's config, or None when ``metadata.json`` is absent; an error naming
    the file when it is empty or not the JSON that ``save`` writes."""
    path = Path(checkpoint_dir) / CONFIG_FNAME
    if not path.exists():
        return None
    text = path.read_bytes()
    expected = (
        'expected the JSON object {"sharded_backend": ..., ...} that save writes last; '
        "the marker is damaged, so the checkpoint cannot be trusted"
    )
    if not text.strip():
        raise CheckpointingException(f"{path}: empty ({len(text)} bytes); {expected}")
    try:
        fields = json.loads(text)
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointingException(f"{path}: not valid JSON ({err}); {expected}") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("sharded_backend"), str):
        raise CheckpointingException(f"{path}: holds {fields!r}; {expected}")
    known = {k: v for k, v in fields.items() if k in CheckpointingConfig.__dataclass_fields__}
    return CheckpointingConfig(**known)


def save_config(config: CheckpointingConfig, checkpoint_dir: Union[str, Path]) -> None:
    """Write ``metadata.json`` atomically (temporary file, fsync, rename)."""
    path = Path(checkpoint_dir) / CONFIG_FNAME
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(asdict(config), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort where the OS refuses)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
