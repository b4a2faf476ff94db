"""megatron-core's path for ``RotaryEmbedding`` (RoPE angles) and the Llama 3.x frequency
scaling, which live in ``megatron.core.rope`` (below the attention layers that hold them)."""

from megatron.core.rope import RotaryEmbedding, llama3_scaled_inv_freq

__all__ = ["RotaryEmbedding", "llama3_scaled_inv_freq"]
