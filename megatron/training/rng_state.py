"""Each rank's random-number generator states in a checkpoint: Python, NumPy, torch (CPU and
CUDA) and the model-parallel RNG tracker, stored as one ``ShardedObject`` per global rank and
restored only at the same layout (at another one the ranks do not correspond; the trainer
draws no random numbers after building the model, whose weights are seeded per parameter).
"""

import random
from typing import Any, Dict

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import ShardedObject

RNG_KEY_PREFIX = "rng_state/"


def rng_object(data: Any = "current") -> ShardedObject:
    """This rank's RNG states as a ShardedObject at its global rank (written by every rank)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if data == "current":
        data = rng_state()
    return ShardedObject("rng_state", data, (world,), (rank,), replica_id=0)


def rng_state() -> Dict[str, Any]:
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


def set_rng_state(saved: Dict[str, Any]) -> None:
    """Restore the states ``rng_state`` returned."""
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
