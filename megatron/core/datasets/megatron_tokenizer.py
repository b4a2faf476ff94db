"""The legacy tokenizer base that megatron-LM's training tokenizers (``_NullTokenizer``, ...)
derive from; the dataset index cache keys on its ``unique_identifiers``."""

import json
from collections import OrderedDict
from typing import Any, List


class MegatronLegacyTokenizer:
    """Base of the training tokenizers: ``unique_identifiers`` names the tokenizer (the
    dataset index cache keys on it); ``tokenize``/``detokenize`` and the ids come from the
    subclass."""

    def __init__(self, *tokenizer_paths: str, **tokenizer_options: Any) -> None:
        self.unique_identifiers: "OrderedDict[str, Any]" = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = list(tokenizer_paths)
        for key, value in tokenizer_options.items():
            self.unique_identifiers[key] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError

    def detokenize(self, ids: List[int]) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no method 'detokenize'")

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def vocab(self):
        raise NotImplementedError

    @property
    def inv_vocab(self):
        raise NotImplementedError

    @property
    def eod(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'eod'")

    @property
    def pad(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'pad'")
