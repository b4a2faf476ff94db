"""What an exchange strategy is: a ``Strategy`` (run + validate) receiving an ``AttentionCall``.

A strategy brings the keys to the queries over the CP group (``cp_comm_type``). It is
registered once in ``registry.STRATEGIES`` under its megatron-core name.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron.core.transformer.cp_attention.kernels import Kernel


@dataclass(frozen=True)
class AttentionCall:
    """The settings of one ``context_parallel_attention`` call that every strategy receives:
    how blocks are computed, the packed-sequence parameters (None: dense), how many K/V
    head groups the all-gather uses (None: its default) and the attention sinks of the
    query heads given (``sinks``; None: none)."""

    kernel: Kernel
    packed: Optional[object] = None
    num_head_groups: Optional[int] = None
    sink: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Strategy:
    """One ``cp_comm_type``.

    ``run(query, key, value, cp_group, call)`` returns the attention output of this rank's
    shard; it is called with a CP group of at least two ranks (C = 1 is plain local
    attention), except for strategies with ``group_pair`` (given [all-to-all group, ring
    group]), which get every call. ``validate(query, key, cp_group)`` raises a ValueError
    naming what does not fit, before any collective. ``sliding_window``: the strategy
    computes ``window_size`` exactly at C > 1 (every strategy does at C = 1).
    """

    name: str
    run: Callable[..., torch.Tensor]
    validate: Callable[[torch.Tensor, torch.Tensor, object], None]
    group_pair: bool = False
    sliding_window: bool = False
