"""Models built on megatron.core: a small GPT (``megatron.core.models.gpt``)."""
