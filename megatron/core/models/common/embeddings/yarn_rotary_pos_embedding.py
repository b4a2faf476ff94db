"""megatron-core's path for ``YarnRotaryEmbedding`` (YaRN angles and cos/sin scale), which
lives in ``megatron.core.rope`` (below the attention layers that hold it)."""

from megatron.core.rope import YarnRotaryEmbedding

__all__ = ["YarnRotaryEmbedding"]
