"""Module specifications: which class builds each part of a model, and with what arguments.

A ``ModuleSpec`` names a class (or a ``(module path, class name)`` pair imported on demand), the
keyword arguments it is built with and, for composite modules, a dataclass of its submodule
specs. ``build_module(spec, *args, **kwargs)`` instantiates it; this is how
``get_gpt_layer_local_spec`` describes a transformer layer (megatron-core 0.16.1's API).
"""

import importlib
import types
from dataclasses import dataclass, field
from typing import Any, Tuple, Union


@dataclass
class ModuleSpec:
    """What to build: ``module`` (a class, a function, or ``(module path, name)``), the
    keyword ``params`` it is built with, its ``submodules`` (passed as ``submodules=``) and
    free-form ``metainfo``."""

    module: Union[Tuple, type]
    params: dict = field(default_factory=dict)
    submodules: object = None
    metainfo: dict = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``build_module(self, *args, **kwargs)``."""
        return build_module(self, *args, **kwargs)


def import_module(module_path: Tuple[str]):
    """The object ``name`` of module ``path`` for ``module_path = (path, name)``."""
    base_path, name = module_path
    return getattr(importlib.import_module(base_path), name)


def get_module(spec_or_module: Union[ModuleSpec, type], **additional_kwargs):
    """The class or function a spec names (imported when given as a path), not built."""
    if isinstance(spec_or_module, (type, types.FunctionType)):
        return spec_or_module
    if isinstance(spec_or_module.module, (type, types.FunctionType)):
        return spec_or_module.module
    return import_module(spec_or_module.module)


def build_module(spec_or_module: Union[ModuleSpec, type], *args, **kwargs):
    """Instantiate a spec or class: ``module(*args, **spec.params, **kwargs)``, with
    ``submodules=spec.submodules`` when the spec has submodules.

    A function (bare or as a spec's module) is returned as is, not called.
    """
    if isinstance(spec_or_module, types.FunctionType):
        return spec_or_module
    module = get_module(spec_or_module)
    if isinstance(module, types.FunctionType):
        return module
    params = dict(getattr(spec_or_module, "params", None) or {})
    submodules = getattr(spec_or_module, "submodules", None)
    if submodules is not None:
        kwargs["submodules"] = submodules
    try:
        return module(*args, **params, **kwargs)
    except Exception as error:
        raise type(error)(f"{error} when instantiating {module.__name__}").with_traceback(
            error.__traceback__
        ) from None
