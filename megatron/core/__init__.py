"""megatron.core: parallel state, schedules, data parallelism and models.

A drop-in for scripts written against megatron-core 0.16.1's public API.
"""

from megatron.core import parallel_state, utils
from megatron.core.distributed import DistributedDataParallel
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.utils import is_torch_min_version

# megatron-core's legacy name of parallel_state
mpu = parallel_state

__all__ = [
    "parallel_state",
    "mpu",
    "utils",
    "DistributedDataParallel",
    "ModelParallelConfig",
    "is_torch_min_version",
]
