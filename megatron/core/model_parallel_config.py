"""Parallelism and pipeline-schedule settings shared by models, schedules and DDP."""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron.core import config_rules


@dataclass
class ModelParallelConfig:
    """The fields of megatron-core's ModelParallelConfig that this core reads.

    ``microbatch_group_size_per_vp_stage`` defaults to the pipeline size (depth-first order).
    ``hierarchical_context_parallel_sizes`` (ints >= 1 whose product is
    ``context_parallel_size``) are the group sizes of the levels of hierarchical context
    parallelism, level 0 (runs of consecutive ranks of a context-parallel group) first;
    ``parallel_state.initialize_model_parallel`` builds the groups.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    hierarchical_context_parallel_sizes: Optional[list[int]] = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    perform_initialization: bool = True
    use_cpu_initialization: bool = False
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    timers: Optional[Callable] = None
    finalize_model_grads_func: Optional[Callable] = None
    grad_scale_func: Optional[Callable] = None
    no_sync_func: Optional[Callable] = None
    grad_sync_func: Optional[Callable] = None
    param_sync_func: Optional[Callable] = None
    enable_autocast: bool = False
    autocast_dtype: Optional[torch.dtype] = None
    num_microbatches_with_partial_activation_checkpoints: Optional[int] = None
    gradient_accumulation_fusion: bool = False
    pipeline_dtype: torch.dtype = None
    variable_seq_lengths: bool = False
    overlap_p2p_comm: bool = False
    batch_p2p_comm: bool = True
    batch_p2p_sync: bool = True
    deallocate_pipeline_outputs: bool = False
    microbatch_group_size_per_vp_stage: Optional[int] = None

    def __post_init__(self) -> None:
        """Fill derived defaults and reject settings this core does not implement."""
        if not config_rules.sequence_parallel_allowed(
            self.sequence_parallel, self.tensor_model_parallel_size
        ):
            raise ValueError(
                "sequence_parallel=True requires tensor_model_parallel_size > 1, got "
                f"tensor_model_parallel_size={self.tensor_model_parallel_size}"
            )
        if self.hierarchical_context_parallel_sizes is not None:
            self._check_hierarchical_context_parallel_sizes()
        if self.overlap_p2p_comm and self.batch_p2p_comm:
            raise ValueError("Can not use both overlap_p2p_comm and batch_p2p_comm")
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        if self.microbatch_group_size_per_vp_stage is None:
            self.microbatch_group_size_per_vp_stage = self.pipeline_model_parallel_size

    def _check_hierarchical_context_parallel_sizes(self) -> None:
        """``ValueError`` unless the sizes are ints >= 1 multiplying to the context-parallel
        size (an empty list means none, as in ``initialize_model_parallel``)."""
        sizes, cp = self.hierarchical_context_parallel_sizes, self.context_parallel_size
        if not config_rules.hierarchical_sizes_valid(sizes):
            raise ValueError(
                f"hierarchical_context_parallel_sizes must be a list of ints >= 1, got {sizes!r}"
            )
        total = config_rules.hierarchical_sizes_product(sizes)
        if sizes and total != cp:
            raise ValueError(
                f"hierarchical_context_parallel_sizes={list(sizes)} multiply to {total}, but "
                f"context_parallel_size is {cp}; their product must equal it"
            )
