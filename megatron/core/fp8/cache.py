"""A step's FP8 weights kept across its microbatches (megatron-core's ``is_first_microbatch``,
Transformer Engine's FP8 weight cache).

The weights change only at the optimizer step, so their amaxes, casts and FP8 transposes are
the same for every microbatch of a step. An FP8 module (the FP8 linears, the FP8 experts)
holds ``is_first_microbatch``: None (the default) casts its weights at every call; True casts
them and keeps the result (``fp8_weight_cache``); False uses the kept result. The forward sets
it False once it ran; ``MegatronModule.set_is_first_microbatch`` sets it True (the schedules
call it on the first microbatch of each model chunk). The cache is also refilled when it is
empty, after any ``torch.optim`` optimizer step (a global step hook marks every cache
stale: megatron's optimizers step a torch optimizer, then copy into the model weights through
``.data``, which no version counter sees), after ``load_state_dict`` and, run eagerly, when a
weight's ``_version`` moved (an in-place write) or it got new storage. Under ``torch.compile``
only the flag is read (a version is a runtime value: comparing it would break the graph), so
a graph holds two variants per module, fill and reuse. The kept operands are bitwise those a
call would compute: the same amax (MAX-reduced over the same ranks), scale and cast.

Traced by ``torch.compile`` (the trainer's ``--compile``) the cache is used the same way
(``CACHE_WHEN_COMPILED``; False: a compiled linear casts its weight at every call). On an
H200 (torch 2.11, inductor; ``tests/benchmarks/fp8_gpu_check.py``) the compiled and cached
steps are bitwise the eager uncached ones, and the 1.1B trainer's FP8 step took 441-444 ms
against 448-458 ms without it.
"""

import weakref
from typing import Any, Callable, Optional, Sequence

import torch

CACHE_WHEN_COMPILED = True  # module docstring
_MODULES: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_STEP_HOOK: list = []


def init_weight_cache(module: torch.nn.Module) -> None:
    """Give ``module`` an empty FP8 weight cache (``is_first_microbatch`` None: not used)."""
    module.is_first_microbatch = None
    module.fp8_weight_cache = None
    module.fp8_weight_versions = None
    _MODULES.add(module)
    module.register_load_state_dict_post_hook(_after_load)
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEP_HOOK.append(register_optimizer_step_post_hook(_after_optimizer_step))


def cached_operands(
    module: torch.nn.Module, weights: Sequence[torch.Tensor], fill: Callable[[], Any]
) -> Optional[Any]:
    """The FP8 operands of ``module``'s ``weights`` for this call: None when the module does
    not cache (``is_first_microbatch`` None), else its cache, refilled with ``fill()`` where
    the module docstring says."""
    flag = getattr(module, "is_first_microbatch", None)
    if flag is None or (torch.compiler.is_compiling() and not CACHE_WHEN_COMPILED):
        return None
    if flag or module.fp8_weight_cache is None or _moved(module, weights):
        module.fp8_weight_cache = fill()
        module.fp8_weight_versions = _versions(weights)
    module.is_first_microbatch = False
    return module.fp8_weight_cache


def mark_stale(module: torch.nn.Module) -> None:
    """Refill ``module``'s cache at its next call (if it caches)."""
    if module.is_first_microbatch is False:
        module.is_first_microbatch = True


def _after_load(module: torch.nn.Module, incompatible_keys: Any) -> None:
    mark_stale(module)


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    for module in list(_MODULES):
        mark_stale(module)


def _versions(weights: Sequence[torch.Tensor]) -> Optional[tuple]:
    """The weights' version counters and data pointers (a weight given new storage, as
    ``param.data = ...`` or ``module.to`` do); None under ``torch.compile`` (not read there)."""
    if torch.compiler.is_compiling():
        return None
    return tuple((w._version, w.data_ptr()) for w in weights)


def _moved(module: torch.nn.Module, weights: Sequence[torch.Tensor]) -> bool:
    """Whether a weight was written in place since the fill (eager only; a fill under
    ``torch.compile`` recorded no versions, so the next eager call refills)."""
    if torch.compiler.is_compiling():
        return False
    return module.fp8_weight_versions != _versions(weights)
