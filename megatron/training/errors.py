"""Errors a user can fix (a flag, a file, the data) and how a launch reports them.

A known error is printed once, as one line, and the run exits non-zero without a
traceback; any other exception is a bug and keeps its traceback. ``--debug`` (or
``MEGATRON_DEBUG=1``) shows the traceback of known errors too.

Under torchrun each failing rank writes its line to torchrun's per-process error file
(``TORCHELASTIC_ERROR_FILE``, read by torchrun's failure summary). The self-launch
(``python -m megatron.training --nproc-per-node N``) prints the line of the lowest failing
rank once the launch has ended; under a bare torchrun, the lowest-numbered local rank that
failed prints it. This module imports no torch.
"""

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

DEBUG_VARIABLE = "MEGATRON_DEBUG"
# Set by the self-launch for its workers: the launcher prints the line, not the worker.
LAUNCHER_REPORTS_VARIABLE = "MEGATRON_TRAINING_LAUNCHER_REPORTS"
ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"
# Set by the self-launch for its workers: rank 0 writes this file once the run has saved and
# stopped on purpose (--exit-signal-handler, ...), so the launcher exits 0 on the signal.
STOPPED_FILE_VARIABLE = "MEGATRON_TRAINING_STOPPED_FILE"
_MARK = "megatron_usage_error"
_SETTLE_SECONDS = 0.5  # bare torchrun: how long failing ranks wait to see each other's files
# What gloo and NCCL say when a collective's peer process has ended.
_LOST_PEER_SIGNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
)


class UsageError(ValueError):
    """A problem with what the user gave: a flag, a combination of flags, a file or its
    contents. Reported as one line naming the flag or file, without a traceback."""


class SettingsConflict(UsageError):
    """A usage error listing several conflicting settings: its first line says what, each
    further line names one setting with both values (kept as lines when reported)."""


class TrainingStopped(RuntimeError):
    """The run went wrong in a way the user must act on (a NaN loss, every recent fp16
    step overflowing): reported as one line naming the iteration and the cause; the
    launch exits 1."""


_KNOWN = (
    ValueError,  # UsageError, and the library's argument checks
    TrainingStopped,
    NotImplementedError,  # a setting this core refuses by name
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)


def is_usage_error(exc: BaseException) -> bool:
    """True for errors reported as one line: ``UsageError``, ``ValueError`` (the library's
    argument checks), ``TrainingStopped``, ``NotImplementedError``, a missing or unreadable
    file, a missing optional package (an ``ImportError`` whose message says what to ``pip
    install``, as ``missing_package`` writes it) and ``dist_checkpointing``'s
    ``CheckpointingException``."""
    if isinstance(exc, _KNOWN):
        return True
    if isinstance(exc, ImportError) and "pip install" in str(exc):
        return True
    checkpointing = sys.modules.get("megatron.core.dist_checkpointing.core")
    return checkpointing is not None and isinstance(exc, checkpointing.CheckpointingException)


def missing_package(package: str, extra: str, needed_for: str) -> ImportError:
    """The error for an optional package that is not installed: names what needs it and the
    extra that installs it (reported as one line)."""
    return ImportError(
        f"{needed_for} needs the '{package}' package, which is not installed: "
        f"pip install -e '.[{extra}]' (or pip install {package})"
    )


def run_tool(main: Callable[[Optional[Sequence[str]]], Any], prog: str, argv=None) -> int:
    """Run a command-line tool's ``main(argv)``; returns the exit status. A known error
    (``is_usage_error``) is printed as one line, ``prog: error: message``, with status 1;
    ``MEGATRON_DEBUG=1`` shows its traceback instead."""
    try:
        main(argv)
    except Exception as exc:
        if debug_requested() or not is_usage_error(exc):
            raise
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr, flush=True)
        return 1
    return 0


def debug_requested(argv: Sequence[str] = ()) -> bool:
    """``--debug`` among the arguments, or ``MEGATRON_DEBUG`` set to 1/true/yes."""
    env = os.environ.get(DEBUG_VARIABLE, "").strip().lower()
    return "--debug" in argv or env in ("1", "true", "yes", "on")


def one_line(exc: BaseException) -> str:
    """The error as one line: an OSError's reason and file, else its message with its
    lines joined by "; " (a ``SettingsConflict`` keeps one line per setting)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.strerror}: {exc.filename}"
    text = str(exc) or type(exc).__name__
    if isinstance(exc, SettingsConflict):
        return "\n".join(line.rstrip() for line in text.splitlines() if line.strip())
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def report_error(message: str, prog: str = "megatron.training") -> None:
    """Print ``message`` once, as one line on stderr, as ``prog: error: message`` (see the
    module docstring for who prints in a multi-process launch)."""
    error_file = os.environ.get(ERROR_FILE_VARIABLE)
    if error_file:
        _write_error_file(Path(error_file), message)
        if os.environ.get(LAUNCHER_REPORTS_VARIABLE):
            return
        if not _lowest_local_reporter(Path(error_file)):
            return
    print(f"{_prefix(prog)}{message}", file=sys.stderr, flush=True)


def lost_peer(exc: BaseException) -> bool:
    """True when ``exc`` says a collective's peer is gone (its process ended): torch's
    ``DistNetworkError``, or gloo/NCCL's connection errors."""
    if type(exc).__name__ in ("DistNetworkError",):
        return True
    text = str(exc)
    return any(sign in text for sign in _LOST_PEER_SIGNS)


def another_rank_reported(timeout_s: float) -> bool:
    """Under torchrun, after a lost peer: wait up to ``timeout_s`` (the launcher normally
    stops this process first) and say whether another local rank recorded a usage error,
    which is then the one reported. False at once outside torchrun."""
    error_file = os.environ.get(ERROR_FILE_VARIABLE)
    if not error_file:
        return False
    time.sleep(timeout_s)
    return bool(_usage_errors_of_siblings(Path(error_file)))


def usage_error_of_failure(error_file_data: object) -> Optional[str]:
    """The line a worker recorded with ``report_error`` (torchrun's error-file data of a
    failed process), or None when it failed otherwise."""
    if isinstance(error_file_data, dict) and error_file_data.get(_MARK):
        message = error_file_data.get("message")
        return str(message.get("message") if isinstance(message, dict) else message)
    return None


def format_line(message: str, rank: Optional[int] = None, prog: str = "megatron.training") -> str:
    """``megatron.training: error[ on rank R]: message`` (``prog``: the tool's name)."""
    where = "" if rank is None else f" on rank {rank}"
    return f"{prog}: error{where}: {message}"


def _prefix(prog: str = "megatron.training") -> str:
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    rank = os.environ.get("RANK")
    return format_line("", int(rank) if world > 1 and rank is not None else None, prog)


def _write_error_file(path: Path, message: str) -> None:
    """torchrun's error-file format (what its ``ErrorHandler`` writes, with the one line as
    the call stack), marked as ours."""
    extra = {"py_callstack": message, "timestamp": str(int(time.time()))}
    data = {"message": {"message": message, "extraInfo": extra}, _MARK: True}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
    except OSError:
        pass  # the line is still printed (or the launcher reports the exit status)


def _lowest_local_reporter(error_file: Path) -> bool:
    """Bare torchrun: after a short wait, True when no lower local rank recorded a usage
    error."""
    time.sleep(_SETTLE_SECONDS)
    mine = int(os.environ.get("LOCAL_RANK", "0"))
    return not any(rank < mine for rank in _usage_errors_of_siblings(error_file))


def _usage_errors_of_siblings(error_file: Path) -> List[int]:
    """The other local ranks that recorded a usage error (torchrun keeps each local rank's
    file in ``<attempt>/<local rank>/error.json``)."""
    mine = int(os.environ.get("LOCAL_RANK", "0"))
    ranks = []
    for sibling in error_file.parent.parent.glob(f"*/{error_file.name}"):
        try:
            rank = int(sibling.parent.name)
            data = json.loads(sibling.read_text())
        except (ValueError, OSError):
            continue
        if rank != mine and usage_error_of_failure(data) is not None:
            ranks.append(rank)
    return ranks
