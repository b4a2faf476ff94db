"""megatron-core 0.16.1's old name of the static key/value cache."""

from megatron.core.inference.contexts import StaticInferenceContext as InferenceParams  # noqa: F401
