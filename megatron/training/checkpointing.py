"""Saving and resuming training: ``--save DIR``, ``--load DIR``, ``--save-interval N``.

Megatron's directory layout: ``DIR/iter_0000010/`` holds one ``dist_checkpointing``
checkpoint (model chunks, optimizer state, and the common state: iteration, consumed
samples, the optimizer-parameter scheduler, the run's layout and settings) and
``DIR/latest_checkpointed_iteration.txt`` names the newest complete one. The tracker is
replaced atomically by rank 0 only after every rank has finished writing (``save`` ends
with ``metadata.json`` and a barrier), so an interrupted save leaves the tracker on the
previous checkpoint; ``load_checkpoint`` also skips any ``iter_*`` directory without
``metadata.json``.

The model and optimizer are stored by global keys and boxes, so a run may resume at another
(TP, CP, PP, VPP, DP) layout. Each rank's RNG states are saved too and restored when the
layout is the same (at another layout the ranks do not correspond; the trainer draws no
random numbers after building the model, whose weights are seeded per parameter).
"""

import os
import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


def checkpoint_dir(save_dir: str, iteration: int) -> Path:
    """``save_dir/iter_<7-digit iteration>``."""
    return Path(save_dir) / f"iter_{iteration:07d}"


def save_checkpoint(
    save_dir: str,
    iteration: int,
    model: List[torch.nn.Module],
    optimizer,
    opt_param_scheduler=None,
    layout: Optional[Dict[str, Any]] = None,
    consumed_samples: int = 0,
    run_settings: Optional[Dict[str, Any]] = None,
) -> Path:
    """Collective: write ``save_dir/iter_<iteration>`` and then point the tracker at it.

    ``model``: this rank's chunks (DDP-wrapped or not). ``optimizer``: anything with
    ``sharded_state_dict(model_sharded_state_dict)``. ``layout`` and ``run_settings`` are
    plain dicts kept in the common state (for the RNG decision and for the record).
    """
    directory = checkpoint_dir(save_dir, iteration)
    if _rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    _barrier()
    model_state = _model_sharded_state_dict(model)
    state = {
        **model_state,
        "optimizer": optimizer.sharded_state_dict(model_state),
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "layout": dict(layout or {}),
        "run_settings": dict(run_settings or {}),
        "rng_state": _rng_object(),
        "checkpoint_version": 3.0,
    }
    if opt_param_scheduler is not None:
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    dist_checkpointing.save(state, str(directory))
    if _rank() == 0:
        tracker = Path(save_dir) / TRACKER_FILENAME
        tmp = tracker.with_name(tracker.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, tracker)
    _barrier()
    return directory


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


def load_checkpoint(
    load_dir: str,
    model: List[torch.nn.Module],
    optimizer,
    opt_param_scheduler=None,
    layout: Optional[Dict[str, Any]] = None,
) -> Tuple[int, int, List[str]]:
    """Collective: restore model, optimizer (and scheduler) from the newest complete
    checkpoint in ``load_dir``. Returns (iteration, consumed_samples, notes); (0, 0, notes)
    when there is none. RNG states are restored only when the saved ``layout`` equals
    ``layout``."""
    if not Path(load_dir).is_dir():
        raise FileNotFoundError(f"--load {load_dir!r}: not a directory")
    iteration, notes = _agree(find_latest_checkpoint(load_dir))
    if iteration is None:
        notes.append(f"no complete checkpoint in {load_dir}; starting from scratch")
        return 0, 0, notes
    directory = checkpoint_dir(load_dir, iteration)
    common = dist_checkpointing.load_common_state_dict(str(directory))
    same_layout = common.get("layout") == dict(layout or {})
    model_state = _model_sharded_state_dict(model)
    request = {
        **model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True),
    }
    if same_layout:
        request["rng_state"] = _rng_object(data=None)
    loaded = dist_checkpointing.load(request, str(directory))
    chunks = [getattr(chunk, "module", chunk) for chunk in model]
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"model{i}"])
    optimizer.load_state_dict(loaded["optimizer"])
    if opt_param_scheduler is not None and "opt_param_scheduler" in loaded:
        opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    else:
        notes.append(
            f"layout changed ({common.get('layout')} -> {dict(layout or {})}): RNG states "
            "not restored (weights, optimizer state and data position are)"
        )
    notes.append(f"resumed from {directory} (iteration {iteration})")
    return int(loaded["iteration"]), int(loaded.get("consumed_samples", 0)), notes


def _model_sharded_state_dict(model: List[torch.nn.Module]) -> Dict[str, Any]:
    """``{"model": ...}`` for one chunk, ``{"model0": ..., "model1": ...}`` with VPP
    (megatron's names; the storage keys inside do not depend on them)."""
    chunks = [getattr(chunk, "module", chunk) for chunk in model]
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _rng_object(data: Any = "current") -> ShardedObject:
    """This rank's RNG states as a ShardedObject at its global rank (written by every rank)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if data == "current":
        data = _rng_state()
    return ShardedObject("rng_state", data, (world,), (_rank(),), replica_id=0)


def _rng_state() -> Dict[str, Any]:
    """Python, NumPy, torch CPU (and CUDA) generator states, and the model-parallel RNG
    tracker's, as tensors and plain values (loadable with ``weights_only=True``)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    out = {
        "random": [version, list(state), gauss],
        "np": [np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(saved: Dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, state, gauss = saved["random"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = saved["np"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(saved["torch"])
    if saved.get("tracker"):
        get_cuda_rng_tracker().set_states(saved["tracker"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda"])


def _agree(value):
    """Rank 0's ``value`` on every rank (all ranks act on the same checkpoint)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
