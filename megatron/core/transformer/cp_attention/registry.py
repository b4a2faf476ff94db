"""The exchange strategies, each registered once under its ``cp_comm_type`` name.

To add one: a module with its ``Strategy`` (run + validate), one entry below, its name in
``megatron.core.config_rules.CP_COMM_TYPES`` (the torch-free list the config and the trainer
check against; checked equal here, at import) and its test.
"""

from typing import Dict

from megatron.core.config_rules import CP_COMM_TYPES, WINDOWED_CP_COMM_TYPES
from megatron.core.transformer.cp_attention import all_gather, all_to_all, ring
from megatron.core.transformer.cp_attention.strategy import Strategy
from megatron.core.transformer.registry import by_name, check_registry

STRATEGIES: Dict[str, Strategy] = by_name(
    (all_gather.STRATEGY, ring.STRATEGY, all_to_all.STRATEGY, all_to_all.HIERARCHICAL), "name"
)

check_registry(STRATEGIES, CP_COMM_TYPES, "cp_comm_type")
# the strategies that compute a sliding window at CP > 1 are config_rules' list (the trainer
# refuses the others on windowed layers before any worker starts)
_WINDOWED = tuple(name for name, strategy in STRATEGIES.items() if strategy.sliding_window)
if _WINDOWED != WINDOWED_CP_COMM_TYPES:
    raise ImportError(
        f"config_rules.WINDOWED_CP_COMM_TYPES is {WINDOWED_CP_COMM_TYPES} but the strategies "
        f"with sliding_window are {_WINDOWED}; expected the same names"
    )
