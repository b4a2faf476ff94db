"""A GPT built from megatron-core layer specs, for tensor-, sequence-, context-, pipeline- and
data-parallel training."""

from megatron.core.models.gpt.gpt_model import GPTModel

__all__ = ["GPTModel"]
