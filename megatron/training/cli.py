"""``python -m megatron.training`` / ``megatron-train``: parse, check the layout, then run
here (one process, or one rank under torchrun) or launch ``--nproc-per-node`` processes.

Self-launch: without torchrun's WORLD_SIZE and with N > 1 processes, this process runs
torch.distributed.run's launcher in-process, as ``torchrun --standalone --nproc-per-node N
-m megatron.training ...`` would. The workers end with status 0 after a failed comparison
and rank 0 leaves the verdict in a file for the launcher, which exits 1: a failed
comparison reads as a verdict, not as a crashed launch.

Errors (``megatron.training.errors``): a known error (a flag, a file, the data) is printed
once, as one line, and the launch exits non-zero (2 for a command line refused before
anything started, 1 after); a bug keeps its traceback; ``--debug`` or ``MEGATRON_DEBUG=1``
shows tracebacks of known errors too. A rank whose collective fails because a peer is gone
(another rank stopped on its error) waits up to ``PEER_FAILURE_WAIT_S`` for that rank's
report and the launcher's stop, and then ends without a traceback: the root cause is the one
error reported.
"""

import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megatron.training.arguments import explicit_options, parse_args, validate_config
from megatron.training.config_errors import name_the_flags
from megatron.training.errors import (
    LAUNCHER_REPORTS_VARIABLE,
    UsageError,
    another_rank_reported,
    debug_requested,
    format_line,
    is_usage_error,
    lost_peer,
    one_line,
    report_error,
    usage_error_of_failure,
)
from megatron.training.hf_settings import resolve_hf_model

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
VERDICT_FILE_VARIABLE = "MEGATRON_TRAINING_VERDICT_FILE"
COMMAND_LINE_ERROR_STATUS = 2
PEER_FAILURE_WAIT_S = 30.0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit status (1 when the one-process comparison
    fails or a run stops on an error). A command line refused before anything started
    ends with ``SystemExit(2)``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    under_torchrun = "WORLD_SIZE" in os.environ
    try:
        config = resolve_hf_model(parse_args(argv), explicit_options(argv))
        world_size = _world_size(config.nproc_per_node, under_torchrun)
        validate_config(config, world_size)
    except Exception as exc:
        if debug or not is_usage_error(exc):
            raise
        report_error(one_line(exc))
        raise SystemExit(COMMAND_LINE_ERROR_STATUS) from None
    if not under_torchrun and world_size > 1:
        return launch(argv, world_size, debug=debug)
    try:
        return _run(config)
    except Exception as exc:
        if not debug and is_usage_error(exc):
            report_error(name_the_flags(one_line(exc), config))
            return 1
        if world_size > 1 and lost_peer(exc) and another_rank_reported(PEER_FAILURE_WAIT_S):
            return 1  # the consequence of another rank's error, which is the one reported
        raise


def launch(argv: Sequence[str], nproc: int, debug: bool = False) -> int:
    """Run ``argv`` on ``nproc`` local processes with torch.distributed.run's launcher.

    Returns 0, 1 when rank 0 reported a failed comparison, or 1 when a process failed: the
    one line of the lowest rank that stopped on a known error is printed here (its own
    traceback above for any other failure). Each process gets ``OMP_NUM_THREADS =
    cpu_count // nproc`` (at least 1) unless set. torchrun's own failure report is shown
    only with ``debug``.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    saved = dict(os.environ)
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ[LAUNCHER_REPORTS_VARIABLE] = "1"
    quiet = None if debug else _quiet_torch_launcher()
    try:
        with tempfile.TemporaryDirectory(prefix="megatron-train-") as scratch:
            verdict = Path(scratch) / "verdict"
            os.environ[VERDICT_FILE_VARIABLE] = str(verdict)
            try:
                run(get_args_parser().parse_args(launch_command(argv, nproc)[3:]))
            except ChildFailedError as failed:
                return _report_failed_launch(failed, debug)
            except KeyboardInterrupt:
                return 130
            except SignalException as stopped:  # SIGTERM/SIGINT/... to the launcher
                print(format_line(f"stopped by {stopped.sigval.name}"), file=sys.stderr)
                return 128 + int(stopped.sigval)
            return 1 if verdict.exists() and verdict.read_text() == "failed" else 0
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if quiet is not None:
            _restore_levels(quiet)


def launch_command(argv: Sequence[str], nproc: int) -> List[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m
    megatron.training <argv>``: the launch, as a command line."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "megatron.training",
        *argv,
    ]


def _run(config) -> int:
    """Train here; the exit status (the verdict goes to the launcher when self-launched)."""
    from megatron.training.training import pretrain  # torch and the model: only when running

    passed = pretrain(config).passed
    verdict_file = os.environ.get(VERDICT_FILE_VARIABLE)
    if verdict_file:  # self-launched: the launcher turns the verdict into its status
        if os.environ.get("RANK", "0") == "0":
            Path(verdict_file).write_text("passed" if passed else "failed")
        return 0
    return 0 if passed else 1


def _report_failed_launch(failed, debug: bool) -> int:
    """Print the one line of the lowest rank that stopped on a known error, else which
    rank failed and how; returns 1."""
    if debug:
        print(failed.format_msg(), file=sys.stderr, flush=True)
    known = {}
    for rank, failure in failed.failures.items():
        message = usage_error_of_failure(failure.error_file_data)
        if message is not None:
            known[rank] = message
    if known:
        rank = min(known)
        everyone = len(known) == len(failed.failures) and 0 in known
        print(format_line(known[rank], None if everyone else rank), file=sys.stderr, flush=True)
    else:
        rank, failure = min(failed.failures.items())
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"{failure.exitcode}"
        print(
            format_line(f"rank {rank} exited with status {how} (its output is above)"),
            file=sys.stderr,
            flush=True,
        )
    return 1


def _quiet_torch_launcher() -> Dict[str, int]:
    """Keep torch.distributed's launcher logs (worker exit codes, closing signals) to
    critical messages; returns each logger's previous level (``_restore_levels``)."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed")]
    saved = {}
    for name in ["torch.distributed", *names]:
        logger = logging.getLogger(name)
        saved[name] = logger.level
        logger.setLevel(logging.CRITICAL)
    return saved


def _restore_levels(levels: Dict[str, int]) -> None:
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def _world_size(nproc_per_node: Optional[int], under_torchrun: bool) -> int:
    """The run's process count: torchrun's WORLD_SIZE, else ``--nproc-per-node`` (1).

    Under torchrun an explicit ``--nproc-per-node`` must match LOCAL_WORLD_SIZE.
    """
    if not under_torchrun:
        return 1 if nproc_per_node is None else nproc_per_node
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if nproc_per_node is not None and nproc_per_node != local:
        raise UsageError(
            f"--nproc-per-node {nproc_per_node} but torchrun started {local} processes per "
            "node; leave --nproc-per-node out under torchrun"
        )
    return int(os.environ["WORLD_SIZE"])
