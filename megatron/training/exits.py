"""Leaving a run early, resumably: megatron's ``--exit-signal-handler`` (``--exit-signal``),
``--exit-duration-in-mins`` and ``--exit-interval``.

Each rank records what it sees (``ExitConditions``): the signal, caught by a handler that
only sets a flag (whichever process it reaches: every rank when the launcher forwards it,
as torchrun's agent and our launcher do, or one rank alone); the minutes since the run
started; the iteration count. At every step boundary the ranks agree with one all-reduce
(MAX) of one integer over the whole world (skipped when only ``--exit-interval`` is given:
the iteration count is the same everywhere), so every rank stops after the same iteration,
saves the same checkpoint and returns; the trainer then exits 0 with a one-line message.
The validation pass asks the same question before each of its batches (``stop_check``).

The checkpoint is the ordinary one (``checkpointing.save_checkpoint``: the tracker moves only
after every rank has finished writing), holding the RNG states and the data position, so a
``--load`` continues as if the run had not stopped.
"""

import os
import signal
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.core.communication import all_reduce_, world_group
from megatron.core.device import comm_device
from megatron.training.errors import STOPPED_FILE_VARIABLE

# Reasons, by priority in the agreement (the largest code any rank reports wins).
_REASONS = {
    1: "--exit-interval {interval}",
    2: "--exit-duration-in-mins {minutes:g}",
    3: "{signal} received (--exit-signal-handler)",
}


class ExitConditions:
    """The exit conditions of one run on this rank (see the module docstring); a context
    manager that installs the signal handler and restores the previous one."""

    def __init__(self, config: Any) -> None:
        self.signal_name = config.exit_signal if config.exit_signal_handler else None
        self.interval = config.exit_interval
        self.minutes = config.exit_duration_in_mins
        self.received = False
        self.stopped: Optional[str] = None  # the agreed reason, once the run stopped
        self._started = time.monotonic()
        self._previous = None

    @property
    def active(self) -> bool:
        """Whether any exit condition is configured."""
        return bool(self.signal_name or self.interval or self.minutes)

    def __enter__(self) -> "ExitConditions":
        self._started = time.monotonic()
        if self.signal_name:
            number = signal.Signals[self.signal_name]
            self._previous = signal.signal(number, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self.signal_name and self._previous is not None:
            signal.signal(signal.Signals[self.signal_name], self._previous)
            self._previous = None

    def _on_signal(self, signum, frame) -> None:
        self.received = True

    def _local_code(self, iteration: Optional[int]) -> int:
        if self.received:
            return 3
        if self.minutes is not None and time.monotonic() - self._started >= 60 * self.minutes:
            return 2
        if iteration is not None and self.interval and iteration % self.interval == 0:
            return 1
        return 0

    def agreed(self, iteration: Optional[int]) -> Optional[str]:
        """Collective when a signal or a duration is configured (every rank calls it at
        the same point): the reason every rank stops after ``iteration``, or None.
        ``iteration`` None: inside the validation pass (the interval does not count)."""
        if not self.active:
            return None
        code = self._local_code(iteration)
        if (self.signal_name or self.minutes) and dist.is_initialized():
            flag = torch.tensor([code], dtype=torch.int32, device=comm_device())
            all_reduce_(flag, world_group(), dist.ReduceOp.MAX)
            code = int(flag.item())
        if not code:
            return None
        return _REASONS[code].format(
            interval=self.interval, minutes=self.minutes or 0, signal=self.signal_name
        )

    def stop_check(self) -> bool:
        """The validation pass's per-batch hook: True on every rank when the run must stop
        (a signal or the duration; collective like ``agreed``)."""
        return self.agreed(None) is not None


def exit_message(reason: str, iteration: int, save_dir: str) -> str:
    """The one line printed when a run stops early; on rank 0 of a self-launch it also
    tells the launcher (``STOPPED_FILE_VARIABLE``) that the checkpoint is saved, before
    the rest of the shutdown, which the launcher's agent may cut short."""
    line = (
        f"{reason}: saved iteration {iteration} to {save_dir} and stopped; resume with "
        f"--load {save_dir}"
    )
    marker = os.environ.get(STOPPED_FILE_VARIABLE)
    if marker and (not dist.is_initialized() or dist.get_rank() == 0):
        with open(marker, "w") as f:
            f.write(line)
    return line
