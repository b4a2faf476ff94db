"""Training-side tokenizers (megatron-LM's ``megatron.training.tokenizer``)."""

from megatron.training.tokenizer.tokenizer import build_tokenizer

__all__ = ["build_tokenizer"]
