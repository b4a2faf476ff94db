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


def is_torch_min_version(version, check_equality=True):
    """Whether the installed torch is ``version`` or newer (strictly newer without
    ``check_equality``); local tags such as ``+cpu`` are ignored."""
    import torch

    found = torch.torch_version.TorchVersion(torch.__version__.split("+")[0])
    return found >= version if check_equality else found > version


def is_te_min_version(version, check_equality=True):
    """Whether Transformer Engine is installed at ``version`` or newer (strictly newer
    without ``check_equality``); False when it is not installed, as this core never uses it."""
    try:
        import transformer_engine as te
    except ImportError:
        return False
    from importlib.metadata import version as installed_version

    from packaging.version import Version

    found = Version(
        str(getattr(te, "__version__", None) or installed_version("transformer-engine"))
    )
    return found >= Version(version) if check_equality else found > Version(version)


def get_pg_size(group=None):
    """Size of ``group``; 1 when it is None or torch.distributed is not initialized."""
    import torch.distributed as dist

    return 1 if group is None or not dist.is_initialized() else group.size()


def get_pg_rank(group=None):
    """Rank in ``group``; 0 when it is None or torch.distributed is not initialized."""
    import torch.distributed as dist

    return 0 if group is None or not dist.is_initialized() else group.rank()


def get_model_config(model) -> Any:
    """The ``config`` of a (possibly wrapped) model chunk."""
    return get_attr_wrapped_model(model, "config", allow_none=False)
