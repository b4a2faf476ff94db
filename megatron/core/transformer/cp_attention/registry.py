"""The exchange strategies, each registered once under its ``cp_comm_type`` name.

To add one: a module with its ``Strategy`` (run + validate), one entry below, its name in
``megatron.core.config_rules.CP_COMM_TYPES`` (the torch-free list the config and the trainer
check against; asserted equal here) and its test.
"""

from typing import Dict

from megatron.core.config_rules import CP_COMM_TYPES, WINDOWED_CP_COMM_TYPES
from megatron.core.transformer.cp_attention import all_gather, all_to_all, ring
from megatron.core.transformer.cp_attention.strategy import Strategy

# The HF families' registry (training/hf/families) has this same shape on purpose: one
# module per entry, one line each.
STRATEGIES: Dict[str, Strategy] = {
    strategy.name: strategy
    for strategy in (
        all_gather.STRATEGY,
        ring.STRATEGY,
        all_to_all.STRATEGY,
        all_to_all.HIERARCHICAL,
    )
}

assert tuple(STRATEGIES) == CP_COMM_TYPES, (tuple(STRATEGIES), CP_COMM_TYPES)
windowed = tuple(name for name, strategy in STRATEGIES.items() if strategy.sliding_window)
assert windowed == WINDOWED_CP_COMM_TYPES, (windowed, WINDOWED_CP_COMM_TYPES)
