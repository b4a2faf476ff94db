"""megatron.core.tokenizers: ``MegatronTokenizer.from_pretrained`` and the tokenizer base.

Libraries available here: ``null`` (also ``null-text``; whitespace-separated integer ids),
``byte-level`` (UTF-8 bytes, no file) and ``huggingface`` backed by a HuggingFace
``tokenizers`` JSON file (``pip install tokenizers``; only needed for that library).
"""

from megatron.core.tokenizers.base_tokenizer import MegatronTokenizerBase
from megatron.core.tokenizers.megatron_tokenizer import MegatronTokenizer

__all__ = ["MegatronTokenizerBase", "MegatronTokenizer"]
