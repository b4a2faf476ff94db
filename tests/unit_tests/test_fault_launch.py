"""A rank that fails mid-schedule ends the whole torchrun launch (SPEC section 8).

Launches ``tests/unit_tests/fault_scripts/forward_raises_mid_schedule.py`` on 4 ranks
(PP=2, CP=2, rank 1 raises inside ``forward_step_func`` at microbatch 2) and checks that the
launch exits non-zero, well within its time limit, with the raised message in its output.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit_tests.fault_scripts.forward_raises_mid_schedule import (
    FAULT_MICROBATCH,
    FAULT_RANK,
    MESSAGE,
)

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 120  # the launch is killed after this; it must end long before
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def _launch(module: str, nproc: int):
    """Run ``torchrun --nproc-per-node nproc -m module``; returns (exit code, output, s).

    The launch gets its own session so that, past ``LIMIT_S``, it is killed with all its
    workers."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS + ("MASTER_PORT",)}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), "-m", module]
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the launch still ran after {LIMIT_S} s:\n{output[-4000:]}")
    return proc.returncode, output, time.monotonic() - start


@pytest.mark.world(1)
@pytest.mark.timeout(LIMIT_S + 30)
def test_a_rank_raising_in_forward_step_func_ends_the_launch_non_zero_and_quickly():
    code, output, seconds = _launch("tests.unit_tests.fault_scripts.forward_raises_mid_schedule", 4)
    print(f"fault launch ended with exit code {code} after {seconds:.1f} s")
    expected = MESSAGE.format(rank=FAULT_RANK, microbatch=FAULT_MICROBATCH)
    assert code != 0, output[-4000:]
    assert expected in output, output[-4000:]
    assert f"rank {FAULT_RANK}: step finished" not in output
    assert seconds < LIMIT_S / 2, f"the launch took {seconds:.1f} s"
