"""Distributed checkpoints that load at any parallel layout (megatron-core 0.16.1's API).

``save(sharded_state_dict, checkpoint_dir)`` / ``load(sharded_state_dict, checkpoint_dir)``
with ``ShardedTensor`` (a box of a global tensor), ``ShardedObject`` and
``LocalNonpersistentObject``; storage is ``torch.distributed.checkpoint``. See
docs/checkpoints.md.
"""

from megatron.core.dist_checkpointing.core import (
    CheckpointingException,
    check_is_distributed_checkpoint,
)
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
)
from megatron.core.dist_checkpointing.serialization import (
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_tensors_metadata,
    save,
)

__all__ = [
    "save",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_tensors_metadata",
    "check_is_distributed_checkpoint",
    "CheckpointingException",
    "ShardedTensor",
    "ShardedObject",
    "LocalNonpersistentObject",
]
