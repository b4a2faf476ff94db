"""megatron.core: parallel state, schedules, data parallelism and models.

A drop-in for scripts written against megatron-core 0.16.1's public API.
"""

from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig

__all__ = ["parallel_state", "ModelParallelConfig"]
