"""Validation of the valid-token counts that three-value loss callbacks return.

A count must be a one-element, finite, non-negative, real-valued tensor. Its type, shape and
dtype are checked at once. Its value is read at once when it lives on the CPU. A count on
an accelerator is read without a host sync per microbatch while a schedule collects counts
(``with DeferredCountChecks()``): it is copied to the host asynchronously, and all of a
step's copies are checked when the schedule finishes, before gradients are finalized.
"""

import math
from contextvars import ContextVar, Token
from typing import List, Optional, Tuple

import torch

EXPECTED = "expected a finite scalar tensor (integer or float) >= 0"


def check_num_tokens(num_tokens) -> None:
    """Raise unless ``num_tokens`` is a valid count (type, shape, dtype, then its value).

    An accelerator count inside ``with DeferredCountChecks()`` is handed to that
    collector, whose ``verify`` checks its value; any other count is read now.
    """
    if not isinstance(num_tokens, torch.Tensor):
        raise TypeError(
            f"loss_func returned num_tokens={num_tokens!r} "
            f"({type(num_tokens).__name__}); {EXPECTED}"
        )
    if num_tokens.numel() != 1:
        raise ValueError(
            f"loss_func returned num_tokens of shape {tuple(num_tokens.shape)}; {EXPECTED}"
        )
    if num_tokens.dtype == torch.bool or num_tokens.is_complex():
        raise TypeError(f"loss_func returned num_tokens of dtype {num_tokens.dtype}; {EXPECTED}")
    collector = _COLLECTOR.get()
    if collector is not None and num_tokens.device.type != "cpu":
        collector.add(num_tokens)
    else:
        _check_value(num_tokens.item(), "")


class DeferredCountChecks:
    """The accelerator counts of one schedule run, copied to the host without waiting.

    ``with collector:`` routes counts here (one block per forward step); ``verify()`` waits
    for the copies (each is ready as soon as the loss that produced it is) and raises for
    the first invalid one.
    """

    def __init__(self) -> None:
        self._pending: List[Tuple[torch.Tensor, Optional[torch.Event]]] = []
        self._token: Optional[Token] = None

    def __enter__(self) -> "DeferredCountChecks":
        """Within the block, accelerator counts go to this collector."""
        self._token = _COLLECTOR.set(self)
        return self

    def __exit__(self, *exc_info) -> None:
        """Stop collecting (also when the block raised)."""
        _COLLECTOR.reset(self._token)
        self._token = None

    def add(self, num_tokens: torch.Tensor) -> None:
        """Start an asynchronous copy of ``num_tokens`` to the host."""
        host = num_tokens.detach().to("cpu", non_blocking=True, copy=True)
        event = None
        if num_tokens.device.type != "cpu":
            event = torch.Event(device=num_tokens.device)
            event.record()
        self._pending.append((host, event))

    def verify(self) -> None:
        """Check every collected count, in the order they came (= microbatch order)."""
        pending, self._pending = self._pending, []
        for microbatch, (host, event) in enumerate(pending):
            if event is not None:
                event.synchronize()
            _check_value(
                host.item(),
                f" (microbatch {microbatch} of this rank's last stage; accelerator counts "
                "are checked when the schedule finishes)",
            )


def _check_value(value, where: str) -> None:
    """Raise ValueError unless ``value`` is finite and >= 0; ``where`` joins the message."""
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"loss_func returned num_tokens={value}{where}; {EXPECTED}")


_COLLECTOR: ContextVar[Optional[DeferredCountChecks]] = ContextVar(
    "deferred_count_checks", default=None
)
