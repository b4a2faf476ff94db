"""Training-side tokenizers (megatron-LM's ``megatron.training.tokenizer``) and the
HuggingFace tokenizer loader ``load_hf_tokenizer`` (a folder or a ``tokenizer.json``, with its
chat template)."""

from megatron.training.tokenizer.hf_tokenizer import HuggingFaceTokenizer, load_hf_tokenizer
from megatron.training.tokenizer.tokenizer import build_tokenizer

__all__ = ["build_tokenizer", "load_hf_tokenizer", "HuggingFaceTokenizer"]
