"""Launching ``torchrun`` from a test: one place that starts it, bounds it and collects it."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Variables of the launch running this test; a nested launch must not inherit them.
LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def run_torchrun(
    nproc: int,
    target: List[str],
    *,
    limit_s: float,
    cwd: Optional[Path] = None,
    env: Optional[Dict[str, str]] = None,
) -> Tuple[int, str, float]:
    """``torchrun --standalone --nproc-per-node nproc TARGET...``; (exit code, output, seconds).

    ``target`` is ``["-m", module, args...]`` or ``[script, args...]``. The launch runs in its
    own session with one intra-op thread per process and ``env`` added; past ``limit_s`` it is
    killed with all its workers and the test fails with the output's tail.
    """
    full_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    full_env.update(OMP_NUM_THREADS="1", **(env or {}))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), *target]
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=cwd or ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the launch still ran after {limit_s} s:\n{output[-4000:]}")
    return proc.returncode, output, time.monotonic() - start


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the rendezvous endpoint)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_torchrun_nodes(
    nnodes: int,
    nproc: int,
    target: List[str],
    *,
    limit_s: float,
    cwd: Optional[Path] = None,
) -> List[Tuple[int, str]]:
    """``nnodes`` torchrun agents on this machine, as on ``nnodes`` nodes of ``nproc`` processes:
    c10d rendezvous on 127.0.0.1, the agents started apart as a cluster's would be; each
    agent's (exit code, output), agent 0 first. Past ``limit_s`` every agent is killed and the
    test fails with the outputs' tails."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1")
    endpoint = f"127.0.0.1:{free_port()}"
    agents = []
    for node in range(nnodes):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes)]
        command += ["--nproc-per-node", str(nproc), "--rdzv-backend", "c10d"]
        command += ["--rdzv-endpoint", endpoint, "--rdzv-id", f"test-{os.getpid()}"]
        command += ["--node-rank", str(node), *target]  # c10d ignores it; SLURM scripts pass it
        agents.append(
            subprocess.Popen(
                command,
                cwd=cwd or ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + limit_s
    results = []
    for agent in agents:
        try:
            output, _ = agent.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for other in agents:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            output, _ = agent.communicate()
            pytest.fail(f"the {nnodes}-node launch still ran after {limit_s} s:\n{output[-4000:]}")
        results.append((agent.returncode, output))
    return results
