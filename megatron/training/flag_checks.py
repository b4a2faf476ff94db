"""The helpers the flag rules share (``validation.py``, ``run_checks.py``): refuse with a
``UsageError``, a field's flag and declared default, and whether the run sets a field. No torch.
"""

from dataclasses import fields
from typing import Any, Collection, Optional

from megatron.training.errors import UsageError
from megatron.training.options import option_of

# A ``megatron.training.arguments.TrainingConfig`` (not imported: ``arguments`` re-exports
# ``validation``'s names, and the rules need only its fields).
Config = Any


class Given:
    """``given(name)``: whether the run sets field ``name`` (``validate_config``'s
    ``explicit``)."""

    def __init__(self, c: Config, explicit: Optional[Collection[str]]) -> None:
        self.c, self.explicit = c, frozenset(explicit or ())

    def __call__(self, name: str) -> bool:
        return name in self.explicit or getattr(self.c, name) != default(self.c, name)


def flag(c: Config, name: str) -> str:
    """The flag naming field ``name`` of ``c`` in messages (e.g. ``--tp``)."""
    return option_of(_field(c, name)).flag


def default(c: Config, name: str) -> Any:
    """The declared default of field ``name`` of ``c``."""
    return _field(c, name).default


def _field(c: Config, name: str):
    return next(f for f in fields(c) if f.name == name)


def require(condition: bool, message: str) -> None:
    """Raise UsageError(message) (a ValueError) unless ``condition``."""
    if not condition:
        raise UsageError(message)
