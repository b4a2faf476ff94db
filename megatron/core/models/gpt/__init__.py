"""A small GPT for pipeline- and context-parallel training."""

from megatron.core.models.gpt.gpt_model import GPTModel

__all__ = ["GPTModel"]
