"""The base class every megatron-core tokenizer object derives from."""

from abc import ABC, abstractmethod
from typing import Any, List, Optional


class MegatronTokenizerBase(ABC):
    """A tokenizer restored from a path and a metadata dict (``library``, ``model_type``,
    ``chat_template``, ...). Subclasses implement ``tokenize``/``detokenize`` and the ids."""

    def __init__(self, path: Optional[str], config: dict, **kwargs: Any) -> None:
        self.path = path
        self.config = config
        self.library = config.get("library")
        self.model_type = config.get("model_type")
        self.metadata_path = config.get("metadata_path")
        self.class_name = config.get("class_name")
        self.class_path = config.get("class_path")

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Text -> ids."""

    @abstractmethod
    def detokenize(self, ids: List[int]) -> str:
        """Ids -> text."""
