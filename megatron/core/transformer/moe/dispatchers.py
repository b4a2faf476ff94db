"""The token dispatchers, each registered once under its ``moe_token_dispatcher_type`` name.

To add one: its ``MoETokenDispatcher`` subclass (``token_dispatcher.py``, or a module of its
own), one entry below, its name in ``megatron.core.config_rules.MOE_TOKEN_DISPATCHERS`` (the
torch-free list ``TransformerConfig`` and the trainer's ``--moe-token-dispatcher-type``
check against; checked equal here, at import) and its tests (docs/architecture.md, "A MoE
token dispatcher").
"""

from typing import Dict, Mapping, Sequence, Type

from megatron.core.config_rules import MOE_TOKEN_DISPATCHERS
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
    MoETokenDispatcher,
)

DISPATCHERS: Dict[str, Type[MoETokenDispatcher]] = {
    "allgather": MoEAllGatherTokenDispatcher,
    "alltoall": MoEAlltoAllTokenDispatcher,
}


def check_registry(registry: Mapping[str, object], choices: Sequence[str], option: str) -> None:
    """Raise ``ImportError`` unless ``registry`` holds exactly ``choices``, in their order
    (an accepted ``option`` value without an implementation, or the reverse)."""
    if tuple(registry) != tuple(choices):
        raise ImportError(
            f"{option}: the registry holds {tuple(registry)} but the accepted values are "
            f"{tuple(choices)}; register each accepted value once (and only those)"
        )


check_registry(DISPATCHERS, MOE_TOKEN_DISPATCHERS, "moe_token_dispatcher_type")
