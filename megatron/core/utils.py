"""Helpers for reaching through model wrappers (DDP, Float16Module, ...)."""

from typing import Any


def get_attr_wrapped_model(
    model, attr: str, allow_none: bool = True, return_model_obj: bool = False
) -> Any:
    """Follow ``.module`` until an object has ``attr`` (non-None unless ``allow_none``).

    Returns the attribute, or the object holding it with ``return_model_obj``.
    """
    if isinstance(model, list):
        raise RuntimeError("get_attr_wrapped_model given a list of models")

    def missing(obj) -> bool:
        return not hasattr(obj, attr) if allow_none else getattr(obj, attr, None) is None

    while missing(model):
        if not hasattr(model, "module"):
            raise RuntimeError(f"get_attr_wrapped_model couldn't find attribute {attr!r}")
        model = model.module
    return model if return_model_obj else getattr(model, attr)


def get_model_config(model) -> Any:
    """The ``config`` of a (possibly wrapped) model chunk."""
    return get_attr_wrapped_model(model, "config", allow_none=False)
