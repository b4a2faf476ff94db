"""megatron.core: parallel state, schedules, data parallelism and models.

A drop-in for scripts written against megatron-core 0.16.1's public API. The names below
are loaded on first use, so that torch-free modules (``megatron.core.config_rules``) can be
imported without loading torch.
"""

import importlib

# megatron-core's legacy name of parallel_state is ``mpu``.
_LAZY = {
    "parallel_state": ("megatron.core.parallel_state", None),
    "mpu": ("megatron.core.parallel_state", None),
    "utils": ("megatron.core.utils", None),
    "DistributedDataParallel": ("megatron.core.distributed", "DistributedDataParallel"),
    "ModelParallelConfig": ("megatron.core.model_parallel_config", "ModelParallelConfig"),
    "is_torch_min_version": ("megatron.core.utils", "is_torch_min_version"),
}

__all__ = [
    "parallel_state",
    "mpu",
    "utils",
    "DistributedDataParallel",
    "ModelParallelConfig",
    "is_torch_min_version",
]


def __getattr__(name: str):
    """Import ``name`` (one of ``__all__``) on first access and keep it."""
    if name not in _LAZY:
        raise AttributeError(f"module 'megatron.core' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
