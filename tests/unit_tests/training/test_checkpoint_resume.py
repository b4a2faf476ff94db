"""Resuming the trainer (``--save`` / ``--load`` / ``--save-interval``).

N iterations, save, resume for N more (N = 4 in the default run, 10 in the slow one): the
per-iteration losses equal the 2N-iteration run bit for bit at the same layout, and within
1e-6 when the resumed run uses another layout (the checkpoint reshards; a different split
changes float rounding). A save killed mid-write (a rank exits while DCP writes) leaves the
tracker on the previous checkpoint; the incomplete directory is refused by
``dist_checkpointing.load`` and skipped by the trainer.
"""

import shutil
import tempfile
from pathlib import Path
from typing import List

import pytest
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.training import TrainingConfig
from megatron.training.checkpointing import (
    TRACKER_FILENAME,
    find_latest_checkpoint,
    load_checkpoint,
)
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout
from tests.unit_tests.launch import run_torchrun

SMALL = dict(num_layers=4, hidden_size=16, seq_length=16, global_batch_size=8, progress=False)


def _run(**changes) -> List[float]:
    with fresh_layout():
        result = pretrain(TrainingConfig(**SMALL, **changes))
    return [r["loss"] for r in result.records]


def _shared_dir() -> str:
    path = [tempfile.mkdtemp(prefix="resume-test-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


RESUME_CASES = [
    pytest.param(
        dict(context_parallel_size=2),
        dict(tensor_model_parallel_size=2),
        4,
        marks=pytest.mark.world(2),
        id="cp2-then-tp2-4+4",
    ),
    pytest.param(
        dict(context_parallel_size=2, pipeline_model_parallel_size=2),
        dict(tensor_model_parallel_size=2),
        10,
        marks=[pytest.mark.world(4), pytest.mark.slow],
        id="cp2-pp2-then-tp2-dp2-10+10",
    ),
    pytest.param(
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        10,
        marks=[pytest.mark.world(4), pytest.mark.slow],
        id="tp2-pp2-then-pp2-vpp2-dp2-10+10",
    ),
]


@pytest.mark.parametrize("layout, other, half", RESUME_CASES)
def test_resume_equals_the_uninterrupted_run_same_layout_bitwise_other_layout_1e6(
    layout, other, half
):
    """``half`` iterations saved (at half / 2 and at the end), then resumed to 2 * half."""
    directory = _shared_dir()
    straight = _run(train_iters=2 * half, **layout)
    first = _run(train_iters=half, save=directory, save_interval=half // 2, **layout)
    resumed = _run(train_iters=2 * half, load=directory, **layout)
    elsewhere = _run(train_iters=2 * half, load=directory, **other)
    failures = []
    if first != straight[:half]:
        failures.append(f"first {half} iterations differ: {first} vs {straight[:half]}")
    if resumed != straight[half:]:
        failures.append(f"resumed at the same layout: {resumed} vs {straight[half:]} (bitwise)")
    worst = max(abs(a - b) for a, b in zip(elsewhere, straight[half:]))
    if len(elsewhere) != half or not worst <= 1e-6:
        failures.append(f"resumed at {other}: max difference {worst:.3e} > 1e-6")
    if dist.get_rank() == 0:
        saved = sorted(p.name for p in Path(directory).glob("iter_*"))
        if saved != [f"iter_{half // 2:07d}", f"iter_{half:07d}"]:
            failures.append(f"checkpoints written: {saved}")
        print(f"resume: same layout bitwise, other layout max |diff| {worst:.2e}")
    assert_no_failures(failures)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.world(1)
def test_load_from_a_missing_or_empty_directory_starts_from_scratch(tmp_path):
    """Megatron's auto-resume (``--load DIR --save DIR``): no checkpoint yet is no error."""
    iteration, _, notes = load_checkpoint(str(tmp_path / "not-yet"), [], None)
    assert iteration == 0 and "no such directory yet" in notes[0]
    (tmp_path / "iter_0000004").mkdir()  # a save that never finished
    iteration, _, notes = load_checkpoint(str(tmp_path), [], None)
    assert iteration == 0 and any("iter_0000004 is incomplete" in n for n in notes), notes
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        load_checkpoint(str(tmp_path / "file"), [], None)


KILL_SCRIPT = "tests.unit_tests.training.fault_scripts.killed_save"


@pytest.mark.world(1)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_save_killed_mid_write_is_never_loaded(tmp_path):
    """2 ranks train 6 iterations saving every 3; at the second save rank 1 dies inside
    DCP's write. The launch fails; iteration 3 stays the newest complete checkpoint, the
    iteration-6 directory is refused by load, and a resumed run (one process, another
    layout) continues from iteration 3 with the uninterrupted run's losses."""
    code, output, _ = run_torchrun(
        2, ["-m", KILL_SCRIPT], limit_s=240, env={"CKPT_TEST_DIR": str(tmp_path)}
    )
    assert code != 0, output[-3000:]
    assert "rank 1 dies while writing" in output, output[-3000:]
    assert (tmp_path / TRACKER_FILENAME).read_text().strip() == "3"
    assert (tmp_path / "iter_0000006").is_dir()
    with pytest.raises(dist_checkpointing.CheckpointingException, match="interrupted"):
        dist_checkpointing.load_common_state_dict(str(tmp_path / "iter_0000006"))
    (tmp_path / TRACKER_FILENAME).unlink()  # the trainer also skips it without the tracker
    iteration, notes = find_latest_checkpoint(str(tmp_path))
    assert iteration == 3 and any("iter_0000006 is incomplete" in n for n in notes), notes
    resumed = pretrain(TrainingConfig(**SMALL, train_iters=6, load=str(tmp_path))).records
    straight = pretrain(TrainingConfig(**SMALL, train_iters=6)).records
    assert [r["iteration"] for r in resumed] == [4, 5, 6]
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed, straight[3:]))
    assert worst <= 1e-6, f"resumed from iteration 3 differs by {worst:.3e}"
