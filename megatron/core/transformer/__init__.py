"""Transformer configuration (and, under models/, the layers built from it)."""

from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["TransformerConfig"]
