"""The trainer in bf16/fp16 (``--bf16``, ``--fp16``): half-precision weights and activations,
fp32 main_grad and main parameters, and ``--compare-single-process`` with a tolerance
derived from bf16's own rounding (three times the largest difference between the
one-process run in bf16 and in fp32).

Distributed cases: ``torchrun --nproc-per-node 4 -m pytest
tests/unit_tests/training/test_trainer_mixed_precision.py``.
"""

import math

import pytest
import torch
import torch.distributed as dist

from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.training import TrainingConfig, validate_config
from megatron.training.cli import main as cli_main
from megatron.training.errors import TrainingStopped
from megatron.training.metrics import read_jsonl
from megatron.training.training import (
    RECENT_STEPS,
    check_recent_steps,
    check_step,
    pretrain,
    train,
)
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout


def _bf16_cp2_pp2(**changes) -> TrainingConfig:
    settings = dict(
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        train_iters=3,
        bf16=True,
        compare_single_process=True,
        progress=False,
    )
    return TrainingConfig(**{**settings, **changes})


@pytest.mark.world(4)
def test_bf16_cp2_pp2_follows_the_one_process_bf16_run():
    """CP = 2, PP = 2 in bf16 stays within the derived tolerance of the one-process bf16 run;
    the tolerance is bf16's (between 1e-6 and 1e-2 for this model), not fp32's."""
    with fresh_layout():
        result = pretrain(_bf16_cp2_pp2())
    failures = [] if result.passed else ["the bf16 comparison failed"]
    if dist.get_rank() == 0:
        tolerance = result.comparison.tolerance
        if not 1e-6 < tolerance < 1e-2:
            failures.append(f"derived tolerance {tolerance:.2e} is not bf16-sized")
    assert_no_failures(failures)


@pytest.mark.world(4)
def test_negative_control_per_shard_normalization_fails_the_bf16_comparison():
    """megatron-core 0.16.1's per-shard objective in bf16 leaves the band: the derived
    tolerance is tight enough to catch the CP normalization bug."""
    with fresh_layout():
        result = pretrain(_bf16_cp2_pp2(train_iters=2, per_shard_loss_normalization=True))
    failures = [] if not result.passed else ["the per-shard bf16 run passed the comparison"]
    if dist.get_rank() == 0:
        comparison = result.comparison
        print(
            f"per-shard drift {comparison.max_difference:.2e}, tolerance {comparison.tolerance:.2e}"
        )
    assert_no_failures(failures)


HALF = {"bf16": {"bf16": True}, "fp16": {"fp16": True, "initial_loss_scale": 1024.0}}


@pytest.mark.world(1)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_process_half_precision_trains(precision, capsys):
    """bf16 / fp16 (dynamic loss scaling from 1024) on one process: the loss falls and stays
    within a few bf16/fp16 rounding steps of the fp32 run's. On the CPU the half-precision
    run (not the fp32 one) warns once that it is slower there."""
    runs = {
        name: pretrain(TrainingConfig(train_iters=4, progress=False, **flags)).records
        for name, flags in (("fp32", {}), (precision, HALF[precision]))
    }
    losses = [r["loss"] for r in runs[precision]]
    assert losses[-1] < losses[0]
    fp32 = [r["loss"] for r in runs["fp32"]]
    assert losses == pytest.approx(fp32, abs=2e-2)
    assert losses != fp32  # it really ran in half precision
    assert runs[precision][-1]["skipped_iterations"] == 0  # a normal run skips nothing
    if not torch.cuda.is_available():
        out = capsys.readouterr().out
        assert out.count(f"warning: --{precision} on the CPU is slower than fp32") == 1, out


@pytest.mark.world(1)
def test_fp16_skips_overflowing_steps_as_megatron_does():
    """megatron's default first scale, 2^32, overflows fp16 gradients: those steps are
    skipped (no update, no gradient norm) and counted while the scale backs off (hysteresis
    2: halved at the second overflow). A run that ends there applied no update: it is
    refused at the end (check_recent_steps), naming the iterations and the scale."""
    config = TrainingConfig(train_iters=2, progress=False, fp16=True)
    records = train(config, validate_config(config, 1), None)
    assert [r["grad_norm"] for r in records] == [None, None]
    assert [r["skipped_iterations"] for r in records] == [1, 2]
    assert [r["loss_scale"] for r in records] == [2.0**32, 2.0**31]
    with pytest.raises(TrainingStopped, match=r"iterations 1-2 \(the last 2 of this run\): "
                       r"every step was skipped.*loss scale 2147483648"):  # fmt: skip
        check_recent_steps(records)


def _record(iteration, skipped, loss=1.0):
    return {"iteration": iteration, "loss": loss, "skipped_iterations": skipped, "loss_scale": 8.0}


@pytest.mark.world(1)
def test_only_a_final_streak_of_skipped_or_nan_steps_fails_the_run():
    """check_recent_steps: skipped steps that the scaler recovered from pass; the last
    RECENT_STEPS (or all, when fewer) skipped, or all with a NaN loss, fail."""
    n = RECENT_STEPS
    recovered = [_record(i, min(i, n)) for i in range(1, n + 3)]  # n skipped, then 2 updates
    check_recent_steps(recovered)
    stalled = [_record(i, max(0, i - 2)) for i in range(1, n + 3)]  # 2 updates, then n skipped
    with pytest.raises(TrainingStopped, match=f"iterations 3-{n + 2} .*every step was skipped"):
        check_recent_steps(stalled)
    check_recent_steps(stalled[:-1])  # negative control: one updated step in the window
    with pytest.raises(TrainingStopped, match=r"iteration 1 \(the last\): every step"):
        check_recent_steps([_record(1, 1)])
    nan = [_record(1, 0), _record(2, 0, float("nan")), _record(3, 0, float("inf"))]
    check_recent_steps(nan)  # the first loss was finite: not every loss of this short run
    with pytest.raises(TrainingStopped, match="iterations 2-3 .*every loss was NaN or inf"):
        check_recent_steps(nan[1:])
    check_recent_steps([])


@pytest.mark.world(1)
def test_a_loss_scale_that_overflows_every_step_ends_the_run_non_zero(tmp_path, capsys):
    """``--fp16 --loss-scale 1e38``: every step overflows; the progress line and the
    summary count the skipped steps, metrics.jsonl records them, and the run exits 1 with
    one line naming the cause."""
    status = cli_main(["--fp16", "--loss-scale", "1e38", "--train-iters", "2", "--no-progress",
                       "--save-metrics", str(tmp_path)])  # fmt: skip
    out, err = capsys.readouterr()
    assert status == 1
    records = read_jsonl(tmp_path / "metrics.jsonl")
    # the fault took effect: no step had a gradient norm, both were skipped
    assert [(r["grad_norm"], r["skipped_iterations"]) for r in records] == [(None, 1), (None, 2)]
    assert "over 2 iterations" in out and "2 skipped (fp16 overflow)" in out
    lines = err.strip().splitlines()
    assert lines == [
        "megatron.training: error: iterations 1-2 (the last 2 of this run): every step was "
        "skipped, no update applied: the scaled fp16 gradients overflowed (loss scale "
        f"{torch.tensor(1e38).item()}); lower --loss-scale, or --initial-loss-scale for dynamic "
        "scaling (--bf16 needs no loss scaling)"
    ]


@pytest.mark.world(1)
def test_a_nan_loss_stops_the_run_at_its_iteration(capsys):
    """--check-for-nan-in-loss-and-grad (default): weights of std 1e30 overflow the
    activations, the first loss is NaN and the run stops naming iteration 1 (exit 1, one
    line). With --no-check-for-nan-in-loss-and-grad it trains on, the losses really are NaN,
    and a run whose every loss is NaN still fails at the end."""
    status = cli_main(["--init-method-std", "1e30", "--train-iters", "1", "--no-progress"])
    assert status == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "megatron.training: error: iteration 1: the loss is nan; stopped by "
        "--check-for-nan-in-loss-and-grad (on by default; --no-check-for-nan-in-loss-and-grad "
        "trains on)"
    ]
    config = TrainingConfig(
        train_iters=2, init_method_std=1e30, check_for_nan_in_loss_and_grad=False, progress=False
    )
    records = train(config, validate_config(config, 1), None)
    assert all(math.isnan(r["loss"]) for r in records)  # the fault took effect
    with pytest.raises(TrainingStopped, match="every loss was NaN or inf"):
        check_recent_steps(records)


@pytest.mark.world(1)
def test_a_nan_gradient_norm_stops_the_run():
    """A step applied with a NaN/inf gradient norm (no loss scaler to skip it) stops the
    run; a step the scaler skipped (norm None) and finite values do not."""
    check_step(3, 2.5, 1.0)
    check_step(3, 2.5, None)
    with pytest.raises(TrainingStopped, match="iteration 3: the gradient norm is nan"):
        check_step(3, 2.5, float("nan"))
    with pytest.raises(TrainingStopped, match="iteration 4: the loss is inf"):
        check_step(4, float("inf"), 1.0)


@pytest.mark.world(1)
def test_half_precision_model_and_optimizer_state():
    """``build_model`` wraps the GPT in Float16Module inside DDP: bf16 weights, fp32
    main_grad; the optimizer steps fp32 copies."""
    from megatron.training.model import build_model
    from megatron.training.training import build_optimizer

    config = TrainingConfig(bf16=True, progress=False)
    chunks = build_model(config, validate_config(config, 1), None)
    optimizer, _ = build_optimizer(config, chunks, None)
    params = list(chunks[0].module.parameters())
    assert type(chunks[0].module).__name__ == "Float16Module"
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert {p.main_grad.dtype for p in params} == {torch.float32}
    assert {p.dtype for p in optimizer.get_parameters()} == {torch.float32}


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(bf16=True, fp16=True), "--bf16 and --fp16 were both given"),
        (dict(bf16=True, hysteresis=4), "--hysteresis set the dynamic loss scaling of --fp16"),
        (dict(fp16=True, loss_scale=0.0), "--loss-scale must be a number > 0 .*, got 0.0"),
        (dict(fp16=True, loss_scale=float("inf")), "--loss-scale must be a number > 0 .*inf"),
        (dict(fp16=True, loss_scale=1e39), "--loss-scale must be .*finite in float32.*1e\\+39"),
        (dict(fp16=True, initial_loss_scale=float("inf")), "--initial-loss-scale must be"),
        (dict(fp16=True, min_loss_scale=float("nan")), "--min-loss-scale must be"),
        (dict(fp16=True, min_loss_scale=8.0, initial_loss_scale=4.0), "--min-loss-scale"),
        (dict(compare_tolerance=-1.0), "--compare-tolerance must be a finite number >= 0"),
    ],
)
def test_bad_precision_flags_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        validate_config(TrainingConfig(**changes), 1)


@pytest.mark.world(1)
def test_library_loss_scales_must_be_finite_and_positive():
    """OptimizerConfig and the grad scalers refuse an inf/NaN/0 scale, or one float32 rounds
    to inf; float32's largest finite value is accepted (the positive control)."""
    largest = torch.finfo(torch.float32).max
    for bad in (float("inf"), float("nan"), 0.0, -1.0, 1e39):
        for name in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
            with pytest.raises(ValueError, match=f"OptimizerConfig: {name}=.*finite in float32"):
                OptimizerConfig(fp16=True, **{name: bad})
        with pytest.raises(ValueError, match="initial_scale=.*finite in float32"):
            ConstantGradScaler(bad)
        with pytest.raises(ValueError, match="initial_scale=|min_scale="):
            DynamicGradScaler(bad, 1.0, 2.0, 0.5, 10, 2)
        with pytest.raises(ValueError, match="min_scale="):
            DynamicGradScaler(8.0, bad, 2.0, 0.5, 10, 2)
    OptimizerConfig(fp16=True, loss_scale=largest, initial_loss_scale=largest)
    assert torch.isfinite(ConstantGradScaler(largest).scale).all()
    assert torch.isinf(torch.tensor([1e39], dtype=torch.float32)).all()  # why 1e39 is refused


# ----------------------------------------------------------------------------- device


@pytest.mark.world(1)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_one_process_without_a_gpu_stays_on_the_cpu_and_nccl_is_refused(capsys):
    """No GPU: ``auto`` trains on the CPU without torch.distributed (the header says so);
    ``--distributed-backend nccl`` is refused by name instead of silently using the CPU."""
    with fresh_layout():
        pretrain(TrainingConfig(train_iters=1, progress=False))
    assert "(no torch.distributed, cpu)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--distributed-backend nccl needs a CUDA GPU"):
        pretrain(TrainingConfig(train_iters=1, progress=False, distributed_backend="nccl"))


@pytest.mark.world(1)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine)")
@pytest.mark.skipif(dist.is_initialized(), reason="checks a run without torchrun")
def test_one_process_with_a_gpu_trains_on_it_without_torchrun(capsys):
    """A GPU and no torchrun: ``auto`` starts a one-process nccl group and trains on cuda:0
    (the header names the device); bf16 there follows the fp32 run within bf16 rounding."""
    runs = {}
    for name, flags in (("fp32", {}), ("bf16", {"bf16": True})):
        with fresh_layout():
            runs[name] = pretrain(TrainingConfig(train_iters=3, progress=False, **flags)).records
        assert not dist.is_initialized()  # the group it started is gone
    output = capsys.readouterr().out
    assert "(nccl, cuda:0 (" in output, output
    bf16, fp32 = ([r["loss"] for r in runs[k]] for k in ("bf16", "fp32"))
    assert bf16 == pytest.approx(fp32, abs=2e-2) and bf16 != fp32


@pytest.mark.world(1)
@pytest.mark.skipif(dist.is_initialized(), reason="checks runs that start their own group")
def test_two_runs_in_one_process_each_start_their_own_group(monkeypatch):
    """Two one-process runs that each start (and destroy) a default group, as two runs on a
    GPU without torchrun do: the second must not reuse the first one's dead groups (found on
    the H200: parallel_state cached them across the restart)."""
    from megatron.training import training

    def gloo_group(config):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return True

    monkeypatch.setattr(training, "initialize_single_gpu", gloo_group)
    losses = []
    for _ in range(2):
        with fresh_layout():
            losses.append([r["loss"] for r in pretrain(TrainingConfig(train_iters=2)).records])
        assert not dist.is_initialized()
    assert losses[0] == losses[1]
