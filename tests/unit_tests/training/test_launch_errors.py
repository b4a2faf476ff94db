"""Errors in a launch are said once (SPEC section 8): a known error is one line naming the
flag or file, printed by the rank that found it (by the launcher for the self-launch), and the
launch exits non-zero without a wall of tracebacks; a bug keeps its traceback; ``--debug``
shows tracebacks of known errors too."""

import os
import signal
import subprocess
import sys

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megatron.training.cli import _report_failed_launch
from megatron.training.errors import (
    LAUNCHER_REPORTS_VARIABLE,
    UsageError,
    another_rank_reported,
    is_usage_error,
    lost_peer,
    one_line,
    report_error,
)
from tests.unit_tests.launch import LAUNCHER_VARS, ROOT, run_torchrun
from tests.unit_tests.training.fault_scripts.data_error_on_one_rank import MESSAGE

pytestmark = pytest.mark.world(1)

FAULT = "tests.unit_tests.training.fault_scripts.data_error_on_one_rank"
SMALL = ["--num-layers", "2", "--hidden-size", "16", "--seq-length", "16", "--no-progress"]
LIMIT_S = 120


def _run(args, env=None, limit_s=LIMIT_S):
    """``python ARGS`` from the repository root, without the enclosing launch's variables;
    (exit code, stdout + stderr)."""
    full_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    full_env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    full_env.pop("MEGATRON_DEBUG", None)
    done = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=limit_s,
    )
    return done.returncode, done.stdout + done.stderr


def test_a_bad_flag_is_one_line_before_anything_starts():
    """A mistyped flag and an impossible layout for --nproc-per-node 2: exit 2, one line."""
    for args, expected in [
        (["--nproc-per-node", "2", "--cp", "2", "--seq-lenght", "8"], "--seq-lenght"),
        (["--nproc-per-node", "2", "--cp", "2", "--seq-length", "6"], "--seq-length 6"),
    ]:
        code, output = _run(["-m", "megatron.training", *args])
        assert code == 2, output
        assert output.count(expected) == 1 and len(output.strip().splitlines()) == 1, output
        assert output.startswith("megatron.training: error: ")


@pytest.mark.timeout(LIMIT_S + 30)
def test_a_data_error_on_one_rank_of_a_self_launch_is_one_line():
    """Self-launch on 2 ranks; rank 1's data raises: the launcher prints rank 1's line once,
    no traceback, exit 1 (rank 0, waiting in a collective, is stopped)."""
    code, output = _run(["-m", FAULT, "--nproc-per-node", "2", "--cp", "2", *SMALL])
    assert code == 1, output
    assert output.count(MESSAGE) == 1, output
    assert f"megatron.training: error on rank 1: {MESSAGE}" in output, output
    assert "Traceback" not in output and "error_file" not in output, output
    assert len(output.strip().splitlines()) <= 3, output  # the header line, the error


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 30)
def test_a_data_error_under_torchrun_is_printed_once_by_the_rank_that_found_it():
    """Bare torchrun on 2 ranks: rank 1 prints its line once (torchrun's own summary, which
    we do not control, names it as the root cause instead of "error_file: <N/A>")."""
    code, output, _ = run_torchrun(2, ["-m", FAULT, "--cp", "2", *SMALL], limit_s=LIMIT_S)
    assert code != 0, output
    assert output.count(f"megatron.training: error on rank 1: {MESSAGE}") == 1, output
    assert "[rank0]" not in output and "[rank1]" not in output, output  # no worker traceback
    assert output.count("Traceback") <= 1, output  # torchrun's own, at most


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 30)
def test_a_missing_data_file_is_refused_before_any_rank_starts_and_debug_shows_tracebacks(tmp_path):
    """A missing --data-path is found before any rank starts (the launcher's preflight): one
    line without a rank, exit 2 like any refused command line; with --debug the traceback
    is shown."""
    missing = str(tmp_path / "missing.jsonl")
    args = ["-m", "megatron.training", "--nproc-per-node", "2", "--cp", "2", *SMALL]
    code, output = _run([*args, "--data-path", missing])
    assert code == 2, output
    errors = [line for line in output.splitlines() if line.startswith("megatron.training: error")]
    assert len(errors) == 1 and missing in errors[0] and " on rank " not in errors[0], output
    assert "Traceback" not in output and "error_file" not in output, output
    code, output = _run([*args, "--data-path", missing, "--debug"])
    assert code == 1 and "FileNotFoundError" in output and "Traceback" in output, output


def test_which_errors_are_one_line():
    """Usage errors, argument checks, refused settings and missing files are one line; other
    exceptions are bugs (their traceback is kept)."""
    for known in (
        UsageError("x"),
        ValueError("x"),
        NotImplementedError("x"),
        FileNotFoundError(2, "No such file or directory", "d.jsonl"),
    ):
        assert is_usage_error(known)
    for bug in (TypeError("x"), IndexError("x"), KeyError("x"), RuntimeError("x")):
        assert not is_usage_error(bug)
    assert one_line(FileNotFoundError(2, "No such file or directory", "d.jsonl")) == (
        "No such file or directory: d.jsonl"
    )
    assert one_line(ValueError("first\n  second\n")) == "first; second"


def test_a_lost_peer_is_recognised(monkeypatch, tmp_path):
    """gloo's "Connection closed by peer" is the consequence of another rank's exit; another
    local rank's recorded usage error is found through torchrun's error files."""
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5007")
    assert lost_peer(closed) and not lost_peer(RuntimeError("shape mismatch"))
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert not another_rank_reported(0.0)
    mine, other = tmp_path / "0" / "error.json", tmp_path / "1" / "error.json"
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(other))
    monkeypatch.setenv(LAUNCHER_REPORTS_VARIABLE, "1")  # record only, print nothing
    report_error("--data-path x: line 3: bad")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(mine))
    assert another_rank_reported(0.0)
    other.write_text('{"message": "a bug"}')  # not a usage error
    assert not another_rank_reported(0.0)


@pytest.mark.parametrize(
    "exits, named",
    [
        ({0: -signal.SIGTERM, 1: -signal.SIGABRT, 2: -signal.SIGTERM}, "rank 1 exited with status signal SIGABRT"),  # noqa: E501
        ({0: -signal.SIGTERM, 1: 3, 3: -signal.SIGKILL}, "rank 1 exited with status 3"),
        ({2: -signal.SIGTERM, 0: -signal.SIGTERM}, "rank 0 exited with status signal SIGTERM"),
    ],
    ids=["aborted-rank", "exit-code", "terminated-from-outside"],
)  # fmt: skip
def test_a_failed_launch_names_the_rank_that_failed_not_one_the_agent_stopped(capsys, exits, named):
    """torchrun's agent stops the other workers with SIGTERM once one fails and records them
    too: the line names the rank that failed on its own (a SIGTERM from outside reaches every
    rank: then the lowest)."""
    failures = {
        rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
        for rank, code in exits.items()
    }
    assert _report_failed_launch(ChildFailedError("megatron.training", failures), False) == 1
    err = capsys.readouterr().err
    assert named in err and err.count("exited with status") == 1, err
