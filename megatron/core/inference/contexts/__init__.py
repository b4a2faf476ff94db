"""``StaticInferenceContext``: megatron-core 0.16.1's name and attributes."""

from megatron.core.inference.contexts.static_context import StaticInferenceContext

__all__ = ["StaticInferenceContext"]
