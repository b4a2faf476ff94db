"""``python -m megatron.training`` / ``megatron-train``: parse, check the layout, then run
here (one process, or one rank under torchrun) or launch ``--nproc-per-node`` processes.

Self-launch: without torchrun's WORLD_SIZE and with N > 1 processes, the same command line
is re-run as ``python -m torch.distributed.run --standalone --nproc-per-node N -m
megatron.training ...``. The workers then end with status 0 after a failed comparison and
rank 0 leaves the verdict in a file for the launcher, which exits 1: a failed comparison
reads as a verdict, not as a crashed launch.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

from megatron.training.arguments import (
    build_parser,
    explicit_options,
    parse_args,
    validate_config,
)
from megatron.training.hf.config import resolve_hf_model

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
VERDICT_FILE_VARIABLE = "MEGATRON_TRAINING_VERDICT_FILE"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit status (2 for a bad command line, 1 when the
    one-process comparison fails)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config = parse_args(argv)
    under_torchrun = "WORLD_SIZE" in os.environ
    try:
        config = resolve_hf_model(config, explicit_options(argv))
        world_size = _world_size(config.nproc_per_node, under_torchrun)
        validate_config(config, world_size)
    except (ValueError, FileNotFoundError) as exc:
        build_parser().error(str(exc))
    if not under_torchrun and world_size > 1:
        return launch(argv, world_size)

    from megatron.training.training import pretrain  # torch and the model: only when running

    passed = pretrain(config).passed
    verdict_file = os.environ.get(VERDICT_FILE_VARIABLE)
    if verdict_file:  # self-launched: the launcher turns the verdict into its status
        if os.environ.get("RANK", "0") == "0":
            Path(verdict_file).write_text("passed" if passed else "failed")
        return 0
    return 0 if passed else 1


def launch(argv: Sequence[str], nproc: int) -> int:
    """Run ``argv`` on ``nproc`` local processes with torch.distributed.run.

    Returns the launch's status, or 1 when it succeeded but rank 0 reported a failed
    comparison. Each process gets ``OMP_NUM_THREADS = cpu_count // nproc`` (at least 1)
    unless set.
    """
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    with tempfile.TemporaryDirectory(prefix="megatron-train-") as scratch:
        verdict = Path(scratch) / "verdict"
        env[VERDICT_FILE_VARIABLE] = str(verdict)
        try:
            status = subprocess.call(launch_command(argv, nproc), env=env)
        except KeyboardInterrupt:
            return 130
        if status == 0 and verdict.exists() and verdict.read_text() == "failed":
            return 1
        return status


def launch_command(argv: Sequence[str], nproc: int) -> List[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m
    megatron.training <argv>``."""
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


def _world_size(nproc_per_node: Optional[int], under_torchrun: bool) -> int:
    """The run's process count: torchrun's WORLD_SIZE, else ``--nproc-per-node`` (1).

    Under torchrun an explicit ``--nproc-per-node`` must match LOCAL_WORLD_SIZE.
    """
    if not under_torchrun:
        return 1 if nproc_per_node is None else nproc_per_node
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if nproc_per_node is not None and nproc_per_node != local:
        raise ValueError(
            f"--nproc-per-node {nproc_per_node} but torchrun started {local} processes per "
            "node; leave --nproc-per-node out under torchrun"
        )
    return int(os.environ["WORLD_SIZE"])
