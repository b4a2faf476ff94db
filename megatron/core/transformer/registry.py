"""The transformer's extension-point registries (the CP exchange strategies, the MoE token
dispatchers): one entry per accepted option value, checked against that value list at
import."""

from typing import Dict, Iterable, Mapping, Sequence, TypeVar

T = TypeVar("T")


def by_name(entries: Iterable[T], key: str) -> Dict[str, T]:
    """``entries`` keyed by their ``key`` attribute, in order; a ``ValueError`` naming a key
    that two entries share."""
    registry: Dict[str, T] = {}
    for entry in entries:
        name = getattr(entry, key)
        if name in registry:
            raise ValueError(f"{key} {name!r} is registered twice; expected one entry per {key}")
        registry[name] = entry
    return registry


def check_registry(registry: Mapping[str, object], choices: Sequence[str], option: str) -> None:
    """Raise ``ImportError`` unless ``registry`` holds exactly ``choices``, in their order
    (an accepted ``option`` value without an implementation, or the reverse)."""
    if tuple(registry) != tuple(choices):
        raise ImportError(
            f"{option}: the registry holds {tuple(registry)} but the accepted values are "
            f"{tuple(choices)}; register each accepted value once (and only those)"
        )
