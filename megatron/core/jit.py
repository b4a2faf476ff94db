"""``jit_fuser``: how megatron-core fuses small elementwise functions (``torch.compile`` on
the torch versions this core supports, as megatron-core 0.16.1 does from torch 2.2).

The ``torch.compile`` call itself is made on the first call of the function: creating it
imports ``torch._dynamo`` and ``torch._inductor`` (seconds of CPU), which a process that
never runs the function (``--help``, an export, generation without the fused paths) should
not pay at import time."""

import functools
from typing import Callable, Optional

import torch


def jit_fuser(function: Callable, *, dynamic: Optional[bool] = None) -> Callable:
    """``torch.compile(function, dynamic=dynamic)``, created on the first call and compiled
    then, once per input signature (``dynamic`` None: shapes that change are then compiled
    as dynamic; True: dynamic from the first call, for a function called at many shapes,
    whose shape-specialized first graphs would spend dynamo's recompile limit of 8 graphs
    per function, after which its new signatures run eagerly). Called inside a
    graph being compiled (``torch.compile`` of a layer), ``function`` is traced into that
    graph and the lazy compiled function is not read: a graph that read it while unset
    guarded on it and was compiled again once an eager call had set it."""
    compiled = None

    @functools.wraps(function)
    def fused(*args, **kwargs):
        nonlocal compiled
        if torch.compiler.is_compiling():
            return function(*args, **kwargs)
        if compiled is None:
            options = {} if dynamic is None else {"dynamic": dynamic}
            compiled = torch.compile(function, **options)
        return compiled(*args, **kwargs)

    return fused
