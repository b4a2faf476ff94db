"""Settings of data-parallel gradient reduction."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class DistributedDataParallelConfig:
    """The fields of megatron-core's DistributedDataParallelConfig this core reads.

    ``bucket_size=None`` lets DDP choose (one bucket per dtype without overlap).
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    bucket_size: Optional[int] = None
    pad_buckets_for_high_nccl_busbw: bool = False
    average_in_collective: bool = False
