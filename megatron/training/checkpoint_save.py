"""``--save DIR``: write one checkpoint (``checkpoint_layout.py``'s layout), then move the
tracker to it.

The tracker is replaced atomically by rank 0 only after every rank has finished writing
(``dist_checkpointing.save`` ends with ``metadata.json`` and a barrier), so an interrupted
save leaves the tracker on the previous checkpoint; a save refused before anything was written
removes the directory it created, and what a save that died while writing left stays for load
to refuse by name.
"""

import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from tqdm import tqdm

from megatron.core import dist_checkpointing
from megatron.core.communication import barrier, world_group
from megatron.training.checkpoint_layout import (
    TRACKER_FILENAME,
    checkpoint_dir,
    directory_bytes,
    model_sharded_state_dict,
    select,
)
from megatron.training.initialize import is_rank_zero
from megatron.training.lora_base import LORA_BASE_KEY
from megatron.training.rng_state import rng_object


def save_checkpoint(
    save_dir: str,
    iteration: int,
    model: List[torch.nn.Module],
    optimizer,
    opt_param_scheduler=None,
    layout: Optional[Dict[str, Any]] = None,
    consumed_samples: int = 0,
    run_settings: Optional[Dict[str, Any]] = None,
    trainable_only: bool = False,
    lora_base: Optional[Dict[str, str]] = None,
) -> Path:
    """Collective: write ``save_dir/iter_<iteration>`` and then point the tracker at it.

    ``trainable_only`` (``--save-trainable-params-only``): only the LoRA adapters of the
    model (and the optimizer state, which is theirs alone); the frozen base is not written.
    ``lora_base``: a LoRA run's base (``lora_base.lora_base_record``), recorded for the
    resume check and the PEFT export. A save refused before anything was written removes the
    directory it created.

    ``model``: this rank's chunks (DDP-wrapped or not). ``optimizer``: anything with
    ``sharded_state_dict(model_sharded_state_dict)``. ``layout`` and ``run_settings`` are
    plain dicts kept in the common state (for the RNG decision and for the comparison on
    resume). Rank 0 prints one line: iteration, directory, size and time.
    """
    started = time.perf_counter()
    directory = checkpoint_dir(save_dir, iteration)
    created = is_rank_zero() and not directory.exists()
    if is_rank_zero():
        directory.mkdir(parents=True, exist_ok=True)
    barrier(world_group())
    try:
        _write_checkpoint(
            directory, model, optimizer, opt_param_scheduler, trainable_only,
            dict(iteration=iteration, consumed_samples=consumed_samples,
                 layout=dict(layout or {}), run_settings=dict(run_settings or {})),
            lora_base,
        )  # fmt: skip
    except BaseException:
        # a save refused before anything was written leaves no empty iter_*; what a save
        # that died while writing left stays, as after a kill (load refuses it by name)
        if created and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
        raise
    if is_rank_zero():
        tracker = Path(save_dir) / TRACKER_FILENAME
        tmp = tracker.with_name(tracker.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, tracker)
    barrier(world_group())
    if is_rank_zero():
        tqdm.write(
            f"saved checkpoint at iteration {iteration} to {directory} "
            f"({directory_bytes(directory) / 1e6:.1f} MB, {time.perf_counter() - started:.2f} s)"
        )
    return directory


def _write_checkpoint(
    directory, model, optimizer, opt_param_scheduler, trainable_only, records, lora_base
) -> None:
    """``dist_checkpointing.save`` of the model (or its adapters), the optimizer, the
    scheduler and the common ``records`` into ``directory`` (collective)."""
    model_state = model_sharded_state_dict(model)
    if trainable_only:
        model_state = select(model_state, adapters=True)
    state = {
        **model_state,
        "trainable_params_only": trainable_only,
        "optimizer": optimizer.sharded_state_dict(model_state),
        **records,
        "rng_state": rng_object(),
        "checkpoint_version": 3.0,
    }
    if lora_base is not None:
        state[LORA_BASE_KEY] = dict(lora_base)
    if opt_param_scheduler is not None:
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    dist_checkpointing.save(state, str(directory))
