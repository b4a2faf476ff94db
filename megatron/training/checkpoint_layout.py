"""Megatron's checkpoint directory layout and what one checkpoint holds.

``DIR/iter_0000010/`` holds one ``dist_checkpointing`` checkpoint: the model chunks
(``model``, or ``model0``, ``model1``, ... with VPP; a LoRA run's adapters alone with
``--save-trainable-params-only``), the optimizer state (``optimizer.*``), each rank's RNG
states (``rng_state.py``) and the common state (iteration, consumed samples, the
optimizer-parameter scheduler, the run's layout and settings: ``layout_record``,
``settings_record``). ``DIR/latest_checkpointed_iteration.txt`` (``TRACKER_FILENAME``) names
the newest complete one; a directory without ``metadata.json`` is incomplete.
"""

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.core import dist_checkpointing
from megatron.training.arguments import Layout, TrainingConfig

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
OPTIMIZER_KEY_PREFIX = "optimizer."


def checkpoint_dir(save_dir: str, iteration: int) -> Path:
    """``save_dir/iter_<7-digit iteration>``."""
    return Path(save_dir) / f"iter_{iteration:07d}"


def find_latest_checkpoint(load_dir: str) -> Tuple[Optional[int], List[str]]:
    """(the iteration of the newest complete checkpoint in ``load_dir`` or None, notes on
    what was skipped). The tracker's choice wins when complete; otherwise the newest
    ``iter_*`` directory with ``metadata.json``."""
    notes: List[str] = []
    root = Path(load_dir)
    tracker = root / TRACKER_FILENAME
    if tracker.exists():
        text = tracker.read_text().strip()
        if text.isdigit():
            iteration = int(text)
            if dist_checkpointing.check_is_distributed_checkpoint(
                str(checkpoint_dir(load_dir, iteration))
            ):
                return iteration, notes
            notes.append(f"{TRACKER_FILENAME} names iteration {iteration}, which is incomplete")
        else:
            notes.append(f"{TRACKER_FILENAME} holds {text!r}, not an iteration")
    candidates = []
    for path in root.glob("iter_*"):
        suffix = path.name[len("iter_") :]
        if not suffix.isdigit():
            continue
        if dist_checkpointing.check_is_distributed_checkpoint(str(path)):
            candidates.append(int(suffix))
        else:
            notes.append(f"{path.name} is incomplete (no metadata.json): skipped")
    return (max(candidates) if candidates else None), notes


def iteration_of(path: Path) -> Optional[int]:
    """N for a directory named ``iter_N`` (digits), else None."""
    suffix = path.name[len("iter_") :]
    return int(suffix) if path.name.startswith("iter_") and suffix.isdigit() else None


def directory_bytes(directory: Path) -> int:
    """The size of the files directly in ``directory``."""
    return sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file())


def model_sharded_state_dict(model: List[torch.nn.Module]) -> Dict[str, Any]:
    """``{"model": ...}`` for one chunk, ``{"model0": ..., "model1": ...}`` with VPP
    (megatron's names; the storage keys inside do not depend on them)."""
    chunks = [getattr(chunk, "module", chunk) for chunk in model]
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def is_adapter(key: str) -> bool:
    """A LoRA adapter's state-dict key (``...linear_qkv.adapter.linear_in.weight``)."""
    return ".adapter." in key


def model_keys(model_state: Dict[str, Any]) -> List[str]:
    """Every chunk's state-dict keys."""
    return [k for chunk in model_state.values() for k in chunk]


def select(model_state: Dict[str, Any], adapters: bool) -> Dict[str, Any]:
    """The adapters' entries of each chunk's sharded state dict, or everything else."""
    return {
        name: {k: v for k, v in chunk.items() if is_adapter(k) == adapters}
        for name, chunk in model_state.items()
    }


def layout_record(layout: Layout) -> Dict[str, int]:
    """The layout as plain values (kept in checkpoints; decides whether RNG states apply)."""
    return {
        "world_size": layout.world_size,
        "tensor_model_parallel_size": getattr(layout, "tensor_model_parallel_size", 1),
        "context_parallel_size": layout.context_parallel_size,
        "pipeline_model_parallel_size": layout.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": layout.virtual_pipeline_model_parallel_size or 0,
    }


def settings_record(config: TrainingConfig) -> Dict[str, object]:
    """The run's settings as plain values, lists of them as lists (for the record in the
    checkpoint); with ``--hf-model``, also its config.json text (``--export-hf`` writes it
    back)."""
    plain = (int, float, str, bool, type(None))
    record: Dict[str, object] = {}
    for name, value in vars(config).items():
        if isinstance(value, plain):
            record[name] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, plain) for v in value):
            record[name] = list(value)  # e.g. the LoRA targets, a --moe-layer-freq list
    if config.hf_model:
        record["hf_config"] = (Path(config.hf_model) / "config.json").read_text()
    return record
