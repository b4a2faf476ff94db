"""The token dispatchers, each registered once under its ``moe_token_dispatcher_type`` name.

To add one: its ``MoETokenDispatcher`` subclass (``token_dispatcher.py``, or a module of its
own), one entry below, its name in ``megatron.core.config_rules.MOE_TOKEN_DISPATCHERS`` (the
torch-free list ``TransformerConfig`` and the trainer's ``--moe-token-dispatcher-type``
check against; checked equal here, at import) and its tests (docs/architecture.md, "A MoE
token dispatcher").
"""

from typing import Dict, Type

from megatron.core.config_rules import MOE_TOKEN_DISPATCHERS
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
    MoETokenDispatcher,
)
from megatron.core.transformer.registry import check_registry

DISPATCHERS: Dict[str, Type[MoETokenDispatcher]] = {
    "allgather": MoEAllGatherTokenDispatcher,
    "alltoall": MoEAlltoAllTokenDispatcher,
}


check_registry(DISPATCHERS, MOE_TOKEN_DISPATCHERS, "moe_token_dispatcher_type")
