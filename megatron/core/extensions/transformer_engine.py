"""megatron-core's ``megatron.core.extensions.transformer_engine``, importable without
Transformer Engine (TE), as megatron-core's is.

This core does not wrap TE: its layers are the local ones (``tensor_parallel``,
``transformer``; ``get_gpt_layer_local_spec``). Importing this module always works and
``HAVE_TE`` is False; building any of the TE layer names below (or calling
``te_checkpoint``) raises ``ImportError`` naming the class and what to use instead, whether
or not the ``transformer_engine`` package is installed.
"""

import importlib.util
from typing import Any, NoReturn

HAVE_TE = False  # no TE layer is provided by this core (see the module docstring)

__all__ = [
    "HAVE_TE",
    "TEColumnParallelGroupedLinear",
    "TEColumnParallelLinear",
    "TECudaRNGStatesTracker",
    "TEDelayedScaling",
    "TEDotProductAttention",
    "TEGroupedLinear",
    "TELayerNormColumnParallelLinear",
    "TELinear",
    "TENorm",
    "TERowParallelGroupedLinear",
    "TERowParallelLinear",
    "te_checkpoint",
]


def _refuse(name: str) -> NoReturn:
    installed = importlib.util.find_spec("transformer_engine") is not None
    reason = (
        "this core does not wrap Transformer Engine (it is installed but unused)"
        if installed
        else "Transformer Engine is not installed, and this core does not wrap it"
    )
    raise ImportError(
        f"megatron.core.extensions.transformer_engine.{name}: {reason}; use the local "
        "layers (megatron.core.tensor_parallel / megatron.core.transformer, "
        "get_gpt_layer_local_spec) instead"
    )


class _Unavailable:
    """A TE layer name: constructing it raises ``ImportError`` (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse(type(self).__name__)


class TENorm(_Unavailable):
    """TE's LayerNorm / RMSNorm (not provided: the local spec uses ``torch_norm``)."""


class TELinear(_Unavailable):
    """TE's linear layer (not provided)."""


class TEColumnParallelLinear(TELinear):
    """TE's column-parallel linear (not provided: ``tensor_parallel.ColumnParallelLinear``)."""


class TERowParallelLinear(TELinear):
    """TE's row-parallel linear (not provided: ``tensor_parallel.RowParallelLinear``)."""


class TELayerNormColumnParallelLinear(_Unavailable):
    """TE's fused norm + column-parallel linear (not provided)."""


class TEDotProductAttention(_Unavailable):
    """TE's attention (not provided: ``transformer.DotProductAttention``)."""


class TEGroupedLinear(_Unavailable):
    """TE's grouped (MoE) linear (not provided)."""


class TEColumnParallelGroupedLinear(TEGroupedLinear):
    """TE's column-parallel grouped linear (not provided)."""


class TERowParallelGroupedLinear(TEGroupedLinear):
    """TE's row-parallel grouped linear (not provided)."""


class TEDelayedScaling(_Unavailable):
    """TE's fp8 delayed-scaling recipe (not provided: fp8 is not implemented)."""


class TECudaRNGStatesTracker(_Unavailable):
    """TE's RNG tracker (not provided: ``tensor_parallel.random``'s tracker)."""


def te_checkpoint(*args: Any, **kwargs: Any) -> NoReturn:
    """TE's activation checkpointing (not provided: ``tensor_parallel.checkpoint``)."""
    _refuse("te_checkpoint")
