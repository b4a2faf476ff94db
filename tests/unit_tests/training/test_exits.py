"""Leaving a run early and resumably (``--exit-signal-handler``, ``--exit-duration-in-mins``,
``--exit-interval``): every rank stops after the same iteration, saves it, the run ends
normally (exit 0) with one line, and a ``--load`` continues with the uninterrupted run's
losses bit for bit (the data position and RNG states are in the checkpoint).

Default run: the interval and the duration on one process, a signal delivered to one rank
of two (in-process). Slow: SIGTERM to the launcher and to one rank of a 4-rank cp2-pp2 run
under ``python -m megatron.training --nproc-per-node 4``. The kill during a save is
``test_checkpoint_resume.py::test_a_save_killed_mid_write_is_never_loaded``.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

import pytest
import torch.distributed as dist

from megatron.training import TrainingConfig, loop
from megatron.training.checkpointing import TRACKER_FILENAME
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout
from tests.unit_tests.launch import LAUNCHER_VARS, ROOT

TINY = dict(num_layers=2, hidden_size=16, seq_length=16, global_batch_size=4, progress=False)


def _run(**changes):
    with fresh_layout():
        return pretrain(TrainingConfig(**{**TINY, **changes}))


def _losses(result) -> List[float]:
    return [r["loss"] for r in result.records]


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "exit_setting, stop",
    [(dict(exit_interval=2), 2), (dict(exit_duration_in_mins=1e-6), 1)],
    ids=["exit-interval-2", "exit-duration"],
)
def test_an_exit_condition_saves_stops_and_the_resume_equals_the_straight_run(
    tmp_path, capsys, exit_setting, stop
):
    straight = _losses(_run(train_iters=4))
    save = str(tmp_path / "ck")
    stopped = _run(train_iters=4, save=save, **exit_setting)
    out = capsys.readouterr().out
    assert stopped.stopped is not None and len(stopped.records) == stop, out
    assert _losses(stopped) == straight[:stop]
    assert f"saved iteration {stop} to {save} and stopped; resume with --load {save}" in out
    assert (Path(save) / TRACKER_FILENAME).read_text().strip() == str(stop)
    resumed = _run(train_iters=4, load=save)
    assert _losses(resumed) == straight[stop:], "the resume is not the uninterrupted run"


@pytest.mark.world(2)
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_iteration(monkeypatch, capsys):
    """SIGUSR1 reaches rank 1 alone during iteration 2: both ranks save iteration 2 and
    stop; the resume continues bit for bit (cp2)."""
    directory = [tempfile.mkdtemp(prefix="exit-test-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    save = directory[0]
    layout = dict(context_parallel_size=2)
    straight = _losses(_run(train_iters=4, **layout))
    calls = []
    original = loop.logged_loss

    def signal_rank_one_at_iteration_two(*args, **kwargs):
        calls.append(1)
        if dist.get_rank() == 1 and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return original(*args, **kwargs)

    monkeypatch.setattr(loop, "logged_loss", signal_rank_one_at_iteration_two)
    stopped = _run(
        train_iters=4, save=save, exit_signal_handler=True, exit_signal="SIGUSR1", **layout
    )
    monkeypatch.setattr(loop, "logged_loss", original)
    failures = []
    if [r["iteration"] for r in stopped.records] != [1, 2]:
        failures.append(f"rank {dist.get_rank()} stopped after {len(stopped.records)}")
    if stopped.stopped != "SIGUSR1 received (--exit-signal-handler)":
        failures.append(f"reason {stopped.stopped!r}")
    dist.barrier()
    if (Path(save) / TRACKER_FILENAME).read_text().strip() != "2":
        failures.append("iteration 2 is not the saved one")
    resumed = _run(train_iters=4, load=save, **layout)
    if _losses(stopped) + _losses(resumed) != straight:
        failures.append(f"stopped + resumed {_losses(stopped) + _losses(resumed)} != {straight}")
    assert_no_failures(failures)


# ----------------------------------------------------------------------------- launches

ARGS = ["--cp", "2", "--pp", "2", "--num-layers", "2", "--hidden-size", "16"]
ARGS += ["--seq-length", "16", "--global-batch-size", "4", "--no-progress"]


def _launch(log: Path, *args: str) -> subprocess.Popen:
    """``python -m megatron.training --nproc-per-node 4 ARGS...``, its output into ``log``."""
    full_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    full_env.update(OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "megatron.training", "--nproc-per-node", "4", *ARGS, *args]
    with open(log, "w") as out:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


def _finish(proc: subprocess.Popen, log: Path, limit_s: float = 400) -> str:
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the launch still ran after {limit_s} s:\n{log.read_text()[-4000:]}")
    return log.read_text()


def _descendants(pid: int) -> List[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            out += [child, *_descendants(child)]
    return out


def _metrics(directory: Path) -> List[float]:
    lines = (directory / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"loss"' in line]


@pytest.mark.world(1)
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("target", ["launcher", "one-rank"])
def test_sigterm_to_the_launcher_or_one_rank_of_a_cp2_pp2_run_saves_exits_0_and_resumes_bitwise(
    tmp_path, target
):
    """SIGTERM after the first iterations (to the launcher, as SLURM sends it, or to one
    worker): every rank saves the same iteration, the launch exits 0 with the one line, and
    the resume's losses equal an uninterrupted run's bit for bit."""
    save, first, log = tmp_path / "ck", tmp_path / "first", tmp_path / "first.log"
    proc = _launch(
        log, "--train-iters", "100000", "--exit-signal-handler", "--save", str(save),
        "--save-metrics", str(first),
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if "SFT of a GPT" in log.read_text():  # every rank has its handler: training
            break
        time.sleep(1)
    time.sleep(10)  # a few iterations
    workers = _descendants(proc.pid)
    assert proc.poll() is None and len(workers) >= 4, log.read_text()[-4000:]
    os.kill(proc.pid if target == "launcher" else workers[-1], signal.SIGTERM)
    output = _finish(proc, log)
    assert proc.returncode == 0, output[-4000:]
    found = re.findall(r"SIGTERM received \(--exit-signal-handler\): saved iteration (\d+)", output)
    assert len(found) == 1, output[-4000:]
    stop = int(found[0])
    assert (save / TRACKER_FILENAME).read_text().strip() == str(stop)
    before = _metrics(first)
    assert len(before) == stop
    runs = {}
    for name, extra in (("resumed", ["--load", str(save)]), ("straight", [])):
        proc = _launch(
            tmp_path / f"{name}.log", "--train-iters", str(stop + 3), *extra,
            "--save-metrics", str(tmp_path / name),
        )  # fmt: skip
        output = _finish(proc, tmp_path / f"{name}.log")
        assert proc.returncode == 0, output[-4000:]
        runs[name] = _metrics(tmp_path / name)
    assert before + runs["resumed"][-3:] == runs["straight"]
