"""Pipeline-parallel schedules and the point-to-point messages between stages."""

from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
