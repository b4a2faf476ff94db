"""Parts shared by megatron models (embeddings)."""
