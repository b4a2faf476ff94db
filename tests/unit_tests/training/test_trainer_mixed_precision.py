"""The trainer in bf16/fp16 (``--bf16``, ``--fp16``): half-precision weights and activations,
fp32 main_grad and main parameters, and ``--compare-single-process`` with a tolerance
derived from bf16's own rounding (three times the largest difference between the
one-process run in bf16 and in fp32).

Distributed cases: ``torchrun --nproc-per-node 4 -m pytest
tests/unit_tests/training/test_trainer_mixed_precision.py``.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.training import TrainingConfig, validate_config
from megatron.training.training import pretrain
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
def test_one_process_half_precision_trains(precision):
    """bf16 / fp16 (dynamic loss scaling from 1024) on one process: the loss falls and stays
    within a few bf16/fp16 rounding steps of the fp32 run's."""
    runs = {
        name: pretrain(TrainingConfig(train_iters=4, progress=False, **flags)).records
        for name, flags in (("fp32", {}), (precision, HALF[precision]))
    }
    losses = [r["loss"] for r in runs[precision]]
    assert losses[-1] < losses[0]
    fp32 = [r["loss"] for r in runs["fp32"]]
    assert losses == pytest.approx(fp32, abs=2e-2)
    assert losses != fp32  # it really ran in half precision


@pytest.mark.world(1)
def test_fp16_skips_overflowing_steps_as_megatron_does():
    """megatron's default first scale, 2^32, overflows fp16 gradients: those steps are
    skipped (no update, no gradient norm) while the scale backs off."""
    records = pretrain(TrainingConfig(train_iters=2, progress=False, fp16=True)).records
    assert [r["grad_norm"] for r in records] == [None, None]


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
        (dict(fp16=True, loss_scale=0.0), "--loss-scale must be > 0, got 0.0"),
        (dict(fp16=True, min_loss_scale=8.0, initial_loss_scale=4.0), "--min-loss-scale"),
        (dict(compare_tolerance=-1.0), "--compare-tolerance must be >= 0"),
    ],
)
def test_bad_precision_flags_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        validate_config(TrainingConfig(**changes), 1)


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
