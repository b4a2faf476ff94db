"""``python -m megatron.training`` / ``megatron-train``: parse, adopt a ``--load``
checkpoint's recorded settings, check the layout and every input path (``preflight``), then
run here (one process, or one rank under torchrun) or launch ``--nproc-per-node`` processes.

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
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron.training.arguments import explicit_options, parse_args, validate_config
from megatron.training.config_errors import name_the_flags
from megatron.training.errors import (
    LAUNCHER_REPORTS_VARIABLE,
    STOPPED_FILE_VARIABLE,
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
from megatron.training.hf.families import REGISTRY  # no torch
from megatron.training.hf_settings import resolve_hf_model
from megatron.training.preflight import (
    adopt_checkpoint_settings,
    adoption_note,
    check_dpo_reference,
    check_input_paths,
    check_output_paths,
)

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
VERDICT_FILE_VARIABLE = "MEGATRON_TRAINING_VERDICT_FILE"
COMMAND_LINE_ERROR_STATUS = 2
INTERRUPTED_STATUS = 130  # 128 + SIGINT, the shell's status of a Ctrl-C
PEER_FAILURE_WAIT_S = 30.0
# With --exit-signal-handler: how long torchrun's agent lets the workers save and end after
# passing a signal on (its default is 30 s; TORCH_ELASTIC_SHUTDOWN_TIMEOUT overrides both).
EXIT_SHUTDOWN_TIMEOUT_S = 300


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit status (1 when the one-process comparison
    fails or a run stops on an error). A command line refused before anything started
    ends with ``SystemExit(2)``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    under_torchrun = "WORLD_SIZE" in os.environ
    try:
        parsed = parse_args(argv, tuple(REGISTRY))  # first: --help shows the defaults
        explicit = explicit_options(argv)
        config, adopted = adopt_checkpoint_settings(parsed, explicit)
        dpo_source = check_input_paths(config, adopted)
        config = resolve_hf_model(config, explicit)
        world_size = _world_size(config.nproc_per_node, under_torchrun)
        validate_config(config, world_size, explicit)
        check_dpo_reference(config)
        check_output_paths(config)
    except Exception as exc:
        if debug or not is_usage_error(exc):
            raise
        report_error(one_line(exc))
        raise SystemExit(COMMAND_LINE_ERROR_STATUS) from None
    note = adoption_note(adopted, config.load)
    if (
        note
        and os.environ.get("RANK", "0") == "0"
        and not os.environ.get(LAUNCHER_REPORTS_VARIABLE)
    ):
        print(note, flush=True)  # once: by the launcher, or by rank 0 under torchrun
    if not under_torchrun and world_size > 1:
        return launch(argv, world_size, debug=debug)
    try:
        return _run(config, dpo_source)
    except KeyboardInterrupt:
        if debug:
            raise
        report_error(
            "interrupted (SIGINT, Ctrl-C): the run stopped where it was "
            "(--exit-signal-handler --exit-signal SIGINT saves a checkpoint first)"
        )
        return INTERRUPTED_STATUS
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
    forwarded = _forward_exit_signal(argv)
    if parse_args(argv).exit_signal_handler:  # time for the workers to save after a signal
        os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(EXIT_SHUTDOWN_TIMEOUT_S))
    try:
        with tempfile.TemporaryDirectory(prefix="megatron-train-") as scratch:
            verdict = Path(scratch) / "verdict"
            stopped_file = Path(scratch) / "stopped"
            os.environ[STOPPED_FILE_VARIABLE] = str(stopped_file)
            os.environ[VERDICT_FILE_VARIABLE] = str(verdict)
            try:
                run(get_args_parser().parse_args(launch_command(argv, nproc)[3:]))
            except ChildFailedError as failed:
                return _report_failed_launch(failed, debug)
            except KeyboardInterrupt:
                return 130
            except SignalException as stopped:  # SIGTERM/SIGINT/... to the launcher
                if stopped_file.exists():
                    return 0  # --exit-signal-handler: the workers saved and said so
                print(format_line(f"stopped by {stopped.sigval.name}"), file=sys.stderr)
                return 128 + int(stopped.sigval)
            return 1 if verdict.exists() and verdict.read_text() == "failed" else 0
    finally:
        if forwarded is not None:
            signal.signal(*forwarded)
        os.environ.clear()
        os.environ.update(saved)
        if quiet is not None:
            _restore_levels(quiet)


# Signals torchrun's agent passes on to the workers itself (then stops them).
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def _forward_exit_signal(argv: Sequence[str]):
    """With ``--exit-signal-handler --exit-signal S`` where S is not one torchrun's agent
    passes on (SIGUSR1, ...): pass S on to this launcher's child processes (the workers)
    instead of dying of it. Returns (signal, previous handler) to restore, or None."""
    config = parse_args(argv)
    if not config.exit_signal_handler or config.exit_signal in _AGENT_SIGNALS:
        return None
    number = signal.Signals[config.exit_signal]

    def forward(signum, frame):
        for pid in _child_pids():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    return number, signal.signal(number, forward)


def _child_pids() -> List[int]:
    """The process ids of this process's children (Linux: /proc)."""
    pids = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return pids


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


def _run(config, dpo_source: Optional[dict] = None) -> int:
    """Train here (``dpo_source``: the DPO reference's source the command line checked); the
    exit status (the verdict goes to the launcher when self-launched)."""
    from megatron.training.training import pretrain  # torch and the model: only when running

    result = pretrain(config, dpo_source=dpo_source)
    passed = result.passed
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
        rank, failure = _first_failure(failed.failures)
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"{failure.exitcode}"
        print(
            format_line(f"rank {rank} exited with status {how} (its output is above)"),
            file=sys.stderr,
            flush=True,
        )
    return 1


def _first_failure(failures: Dict[int, Any]) -> Tuple[int, Any]:
    """The rank whose failure stopped the launch: torchrun's agent, once one worker fails,
    stops the others with SIGTERM (SIGKILL after its timeout) and records them too, after
    the ones that failed on their own. The lowest rank among those not stopped that way,
    else the lowest rank (a SIGTERM from outside, as SLURM sends it, reaches every rank)."""
    stopping = {-signal.SIGTERM, -signal.SIGKILL}
    own = {rank: f for rank, f in failures.items() if f.exitcode not in stopping}
    return min((own or failures).items(), key=lambda item: item[0])


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
