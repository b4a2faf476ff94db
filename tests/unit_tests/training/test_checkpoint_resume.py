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
from megatron.core.dist_checkpointing import CheckpointingException
from megatron.training import TrainingConfig, checkpointing
from megatron.training.checkpointing import (
    TRACKER_FILENAME,
    find_latest_checkpoint,
    resolve_checkpoint,
)
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout
from tests.unit_tests.launch import run_torchrun

SMALL = dict(num_layers=4, hidden_size=16, seq_length=16, global_batch_size=8, progress=False)
TINY = dict(SMALL, num_layers=2, global_batch_size=4)


def _run(**changes) -> List[float]:
    with fresh_layout():
        result = pretrain(TrainingConfig(**{**SMALL, **changes}))
    return [r["loss"] for r in result.records]


def _tiny(**changes) -> List[float]:
    """A smaller run for the checks of what --load accepts (2 layers, 4 sequences)."""
    return _run(**{**TINY, **changes})


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
def test_load_without_a_checkpoint_is_an_error_except_the_auto_resume_idiom(tmp_path):
    """A mistyped --load is an error naming the flag and path; --load = --save (megatron's
    auto-resume) starts from scratch and says so once."""
    missing = str(tmp_path / "not-yet")
    with pytest.raises(ValueError, match=f"--load {missing}: no such directory"):
        resolve_checkpoint(missing)
    with pytest.raises(ValueError, match=f"--load {missing}: no such directory"):
        resolve_checkpoint(missing, save_dir=str(tmp_path / "other"))
    directory, notes = resolve_checkpoint(missing, save_dir=missing + "/")
    assert directory is None and len(notes) == 1 and "starting from scratch" in notes[0]
    with pytest.raises(ValueError, match="no such directory.*--exit-on-missing-checkpoint"):
        resolve_checkpoint(missing, save_dir=missing, exit_on_missing_checkpoint=True)
    with pytest.raises(ValueError, match=f"--load {tmp_path}: no complete checkpoint"):
        resolve_checkpoint(str(tmp_path))
    (tmp_path / "iter_0000004").mkdir()  # a save that never finished
    with pytest.raises(ValueError, match="iter_0000004 is incomplete"):
        resolve_checkpoint(str(tmp_path))
    directory, notes = resolve_checkpoint(str(tmp_path), save_dir=str(tmp_path))
    assert directory is None and "iter_0000004 is incomplete" in notes[0], notes
    assert "starting from scratch" in notes[-1]
    with pytest.raises(ValueError, match="no complete checkpoint.*--exit-on-missing-checkpoint"):
        resolve_checkpoint(str(tmp_path), save_dir=str(tmp_path), exit_on_missing_checkpoint=True)
    with pytest.raises(ValueError, match="iter_0000004: an incomplete checkpoint"):
        resolve_checkpoint(str(tmp_path / "iter_0000004"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        resolve_checkpoint(str(tmp_path / "file"))


@pytest.fixture(scope="module")
def saved_run():
    """One process, 2 iterations saved at 1 and 2: (directory, losses of 4 straight
    iterations). Shared by the world-1 tests below (each only reads it)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        pytest.skip("world-1 fixture")
    directory = tempfile.mkdtemp(prefix="resume-test-")
    straight = _tiny(train_iters=4)
    _tiny(train_iters=2, save=directory, save_interval=1)
    yield directory, straight
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.world(1)
def test_an_iteration_directory_or_ckpt_step_loads_that_iteration(saved_run, capsys):
    directory, straight = saved_run
    own = f"{directory}/iter_0000001"
    assert _tiny(train_iters=4, load=own) == straight[1:], "--load DIR/iter_0000001"
    out = capsys.readouterr().out
    assert f"loaded checkpoint of iteration 1 from {own}" in out and "scratch" not in out
    assert _tiny(train_iters=4, load=directory, ckpt_step=1) == straight[1:], "--ckpt-step 1"
    assert _tiny(train_iters=4, load=directory) == straight[2:], "newest"
    with pytest.raises(ValueError, match="--ckpt-step 3: .*iter_0000003 is not a complete.*"):
        _tiny(train_iters=4, load=directory, ckpt_step=3)
    with pytest.raises(ValueError, match="--ckpt-step 2 contradicts"):
        _tiny(train_iters=4, load=own, ckpt_step=2)


@pytest.mark.world(1)
def test_resuming_with_settings_that_change_the_model_is_refused_naming_each_flag(saved_run):
    directory, _ = saved_run
    with pytest.raises(ValueError) as refused:
        _tiny(
            train_iters=4, load=directory, normalization="RMSNorm", position_embedding_type="rope"
        )
    message = str(refused.value)
    assert "--normalization 'LayerNorm' when saved, 'RMSNorm' now" in message, message
    assert "--position-embedding-type 'learned_absolute' when saved, 'rope' now" in message
    with pytest.raises(ValueError, match="--seq-length 16 when saved, 32 now"):
        _tiny(train_iters=4, load=directory, seq_length=32)
    with pytest.raises(ValueError, match="--hidden-size 16 when saved, 32 now"):
        _tiny(train_iters=4, load=directory, hidden_size=32, finetune=True)


@pytest.mark.world(1)
def test_without_the_settings_check_the_key_check_still_refuses_dropped_tensors(
    saved_run, monkeypatch
):
    """Negative control of the settings comparison, positive test of the key check: with
    the comparison switched off, the LayerNorm checkpoint loaded into an RMSNorm / RoPE
    model is still refused because its norm biases and position embeddings would be
    dropped (they were silently before)."""
    directory, _ = saved_run
    monkeypatch.setattr(checkpointing, "compare_run_settings", lambda *args, **kwargs: None)
    with pytest.raises(CheckpointingException, match="does not fit this model") as refused:
        _tiny(
            train_iters=4, load=directory, normalization="RMSNorm", position_embedding_type="rope"
        )
    message = str(refused.value)
    assert "embedding.position_embeddings.weight" in message and "layer_norm_bias" in message
    assert "would be dropped" in message


@pytest.mark.world(1)
def test_a_checkpoint_beyond_train_iters_is_named_and_one_at_it_trains_nothing(saved_run):
    directory, _ = saved_run
    with pytest.raises(ValueError, match="is at iteration 2, beyond --train-iters 1"):
        _tiny(train_iters=1, load=directory)
    assert _tiny(train_iters=2, load=directory) == []


@pytest.mark.world(1)
def test_finetune_and_no_load_optim(saved_run, capsys):
    """--finetune: the saved weights, iteration 1 onwards (its first loss is the loss of the
    iteration-2 weights on batch 0, not the fresh model's). --no-load-optim: the weights
    (iteration 3 equals the straight run, its loss is taken before the step) but fresh Adam
    moments (iteration 4 differs)."""
    directory, straight = saved_run
    tuned = _tiny(train_iters=2, load=directory, finetune=True)
    assert len(tuned) == 2 and tuned[0] != straight[0]
    assert "--finetune: model weights only" in capsys.readouterr().out
    fresh_adam = _tiny(train_iters=4, load=directory, no_load_optim=True)
    assert fresh_adam[0] == straight[2] and fresh_adam[1] != straight[3], (fresh_adam, straight)


@pytest.mark.world(1)
def test_another_precision_is_refused_while_the_optimizer_state_is_loaded(tmp_path):
    """A --bf16 checkpoint holds fp32 main parameters an fp32 run's optimizer has no place
    for: resuming without --bf16 names the flag; --no-load-optim loads the weights."""
    _tiny(train_iters=1, save=str(tmp_path), bf16=True)
    with pytest.raises(ValueError, match="--bf16 True when saved, False now: .*--no-load-optim"):
        _tiny(train_iters=2, load=str(tmp_path))
    assert len(_tiny(train_iters=2, load=str(tmp_path), no_load_optim=True)) == 1


@pytest.mark.world(1)
def test_resuming_without_the_saved_data_path_names_the_flag(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text('{"prompt": "ab", "response": "ba"}\n{"prompt": "xyz", "response": "zyx"}\n')
    _tiny(train_iters=1, save=str(tmp_path / "ck"), data_path=str(data))
    with pytest.raises(ValueError, match=f"--data-path '{data}' when saved, not given now"):
        _tiny(train_iters=2, load=str(tmp_path / "ck"))
    other = tmp_path / "other.jsonl"
    other.write_text(data.read_text())
    with pytest.raises(ValueError, match=f"--data-path '{data}' when saved, '{other}' now"):
        _tiny(train_iters=2, load=str(tmp_path / "ck"), data_path=str(other))
    assert (
        len(_tiny(train_iters=1, load=str(tmp_path / "ck"), data_path=str(other), finetune=True))
        == 1
    )


@pytest.mark.world(2)
def test_load_errors_are_raised_on_every_rank(tmp_path):
    """2 ranks: a mistyped --load and a settings mismatch end every rank with the error
    (no rank left waiting in a collective)."""
    directory = _shared_dir()
    with pytest.raises(ValueError, match="no such directory"):
        _tiny(train_iters=2, load=directory + "-typo", context_parallel_size=2)
    _tiny(train_iters=1, save=directory, context_parallel_size=2)
    with pytest.raises(ValueError, match="--num-layers 2 when saved, 4 now"):
        _tiny(train_iters=2, load=directory, num_layers=4, tensor_model_parallel_size=2)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)


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


def _records(**changes) -> List[dict]:
    with fresh_layout():
        return pretrain(TrainingConfig(**{**TINY, **changes})).records


@pytest.mark.world(1)
def test_a_changed_learning_rate_on_resume_is_refused_or_applied_or_kept_by_name(saved_run, capsys):
    """megatron's scheduler semantics: another --lr is refused naming both values;
    --override-opt_param-scheduler trains with it (the logged rate and the losses change),
    --use-checkpoint-opt_param-scheduler keeps the saved one; each said once."""
    directory, straight = saved_run
    with pytest.raises(ValueError, match=r"(?s)another learning-rate schedule.*--lr 0.003 when"):
        _tiny(train_iters=4, load=directory, lr=0.03)
    new = _records(train_iters=4, load=directory, lr=0.03, override_opt_param_scheduler=True)
    assert [r["lr"] for r in new] == [0.03, 0.03]
    out = capsys.readouterr().out
    assert out.count("--lr 0.003 when saved, 0.03 now: the new value takes effect") == 1, out
    kept = _records(train_iters=4, load=directory, lr=0.03, use_checkpoint_opt_param_scheduler=True)
    assert [r["lr"] for r in kept] == [0.003, 0.003]
    assert [r["loss"] for r in kept] == straight[2:]  # the saved schedule, bit for bit
    assert [r["loss"] for r in new][1] != straight[3], "the new rate did not reach the update"
    assert "the saved schedule is kept" in capsys.readouterr().out


@pytest.mark.world(1)
def test_a_changed_adam_beta_on_resume_takes_effect(saved_run, capsys, monkeypatch):
    """--adam-beta2 on resume is applied (the loaded optimizer state carries the saved
    betas: without ``apply_optimizer_settings`` the run equals the unchanged resume, the
    silent bug this guards)."""
    directory, straight = saved_run
    changed = _tiny(train_iters=4, load=directory, adam_beta2=0.9)
    assert "--adam-beta2 0.999 when saved, 0.9 now: the new value takes effect" in (
        capsys.readouterr().out
    )
    assert changed[1] != straight[3]
    monkeypatch.setattr(checkpointing, "apply_optimizer_settings", lambda *args: None)
    assert _tiny(train_iters=4, load=directory, adam_beta2=0.9) == straight[2:]


def test_every_optimizer_setting_has_a_resume_rule_and_the_rules_hold():
    """Each ``kind=OPTIMIZER`` field is applied, scheduled or refused on resume; a fresh
    loss scale and a fixed/dynamic switch are refused, a constant rate ignores
    --train-iters."""
    from megatron.training.checkpointing import (
        OPTIMIZER_RESUME_RULES,
        compare_optimizer_settings,
    )
    from megatron.training.options import OPTIMIZER, fields_of_kind

    assert set(fields_of_kind(TrainingConfig, OPTIMIZER)) == set(OPTIMIZER_RESUME_RULES)
    saved = dict(TrainingConfig().__dict__)
    where = Path("ck/iter_0000002")
    assert compare_optimizer_settings(saved, {**saved, "train_iters": 99}, where) == []
    with pytest.raises(ValueError, match="--train-iters 20 when saved, 99 now"):
        compare_optimizer_settings(
            {**saved, "lr_decay_style": "linear"},
            {**saved, "lr_decay_style": "linear", "train_iters": 99},
            where,
        )
    for change in (dict(initial_loss_scale=1024.0), dict(loss_scale=8.0)):
        with pytest.raises(ValueError, match="--no-load-optim"):
            compare_optimizer_settings(saved, {**saved, **change}, where, True)
    notes = compare_optimizer_settings(
        {**saved, "loss_scale": 4.0}, {**saved, "loss_scale": 8.0, "clip_grad": 0.5}, where
    )
    assert [n.split(":")[-1] for n in notes] == [" the new value takes effect"] * 2
