"""TensorBoard and W&B mirrors of metrics.jsonl (``--tensorboard-dir``, ``--log-interval``,
``--wandb-project``; SPEC section 19), tokens/s of the data, and metrics that continue
across a resume.

TensorBoard's own event reader reads the files back; every logged scalar must equal the
metrics.jsonl value (as float32, TensorBoard's scalar type) at its step.
"""

import os
from pathlib import Path

import numpy
import pytest
import torch.distributed as dist

from megatron.training import TrainingConfig, validate_config
from megatron.training.data import SFTDataset
from megatron.training.errors import UsageError
from megatron.training.metrics import read_jsonl
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout

NAMES = {
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "iteration_time_s": "iteration-time",
    "tokens_per_s": "tokens-per-second",
    "valid_loss": "lm loss validation",
    "valid_ppl": "lm loss validation ppl",
}


def _events(directory: str) -> dict:
    """{tag: {step: value}} of every event file under ``directory``."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    values = {}
    for path in sorted(Path(directory).rglob("events.out.tfevents.*")):
        reader = accumulator.EventAccumulator(str(path), size_guidance={"scalars": 0})
        reader.Reload()
        for tag in reader.Tags()["scalars"]:
            values.setdefault(tag, {}).update({e.step: e.value for e in reader.Scalars(tag)})
    return values


def _mismatches(events: dict, records: list, log_interval: int) -> list:
    # log_interval: the run's --tensorboard-log-interval
    """Every metrics.jsonl value TensorBoard should hold, compared (float32)."""
    failures = []
    for record in records:
        for key, tag in NAMES.items():
            logged_step = key.startswith("valid") or record["iteration"] % log_interval == 0
            if key not in record or not logged_step:
                continue
            held = events.get(tag, {}).get(record["iteration"])
            if held != numpy.float32(record[key]):
                failures.append(f"{tag} at {record['iteration']}: {held} vs {record[key]}")
    unexpected = [
        (tag, step)
        for tag, steps in events.items()
        for step in steps
        if not tag.startswith("lm loss validation") and step % log_interval
    ]
    if unexpected:
        failures.append(f"scalars outside --tensorboard-log-interval {log_interval}: {unexpected}")
    return failures


@pytest.mark.world(1)
def test_tensorboard_holds_the_metrics_values(tmp_path):
    """3 iterations, validation at 2 and 3, --tensorboard-log-interval 2: TensorBoard holds
    metrics.jsonl's
    values at steps 2 (training and validation) and 3 (validation only); tokens/s counts
    the data's tokens (2L + 2 per generated sample), not padding."""
    config = TrainingConfig(
        train_iters=3,
        eval_interval=2,
        eval_iters=1,
        tensorboard_log_interval=2,  # megatron's flag (was --log-interval's job)
        tensorboard_dir=str(tmp_path / "tb"),
        save_metrics=str(tmp_path / "m"),
        progress=False,
    )
    pretrain(config)
    records = read_jsonl(tmp_path / "m" / "metrics.jsonl")
    events = _events(str(tmp_path / "tb"))
    assert not _mismatches(events, records, 2), _mismatches(events, records, 2)
    assert set(events["lm loss"]) == {2} and set(events["lm loss validation"]) == {2, 3}
    data = SFTDataset(32, 64, config.seed)
    for record in records:
        start = (record["iteration"] - 1) * 8
        expected = sum(
            int(data[i]["loss_mask"].nonzero().max()) + 1 for i in range(start, start + 8)
        )
        assert record["data_tokens"] == expected
        assert record["padding_tokens"] == 8 * 32 - expected
        assert record["tokens_per_s"] == pytest.approx(expected / record["iteration_time_s"])


@pytest.mark.slow  # wandb starts a service process: seconds of CPU
@pytest.mark.world(1)
def test_wandb_offline_writes_its_run_directory(tmp_path, monkeypatch):
    """WANDB_MODE=offline: the run directory appears under --wandb-save-dir."""
    pytest.importorskip("wandb", reason="wandb is not installed (the 'wandb' extra)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = TrainingConfig(
        train_iters=1,
        wandb_project="sft-test",
        wandb_exp_name="run-1",
        wandb_save_dir=str(tmp_path / "wb"),
        log_interval=1,
        progress=False,
    )
    pretrain(config)
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb")), os.listdir(tmp_path / "wb")


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "flag, package", [("tensorboard_dir", "tensorboard"), ("wandb_project", "wandb")]
)
def test_missing_logging_package_is_one_line_naming_the_extra(monkeypatch, flag, package):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a)
    )
    with pytest.raises(
        UsageError,
        match=rf"needs the '{package}' package, which is not installed: "
        rf"pip install -e '\.\[{package}\]'",
    ):
        validate_config(TrainingConfig(**{flag: "x"}), 1)


@pytest.mark.world(1)
def test_wandb_details_need_a_project():
    with pytest.raises(UsageError, match="--wandb-exp-name run needs --wandb-project"):
        validate_config(TrainingConfig(wandb_exp_name="run"), 1)


@pytest.mark.world(1)
def test_metrics_continue_across_a_resume(tmp_path):
    """2 iterations saved, resumed to 4 into the same --save-metrics folder: metrics.jsonl
    holds iterations 1-4 (the first two from the first run), and loss.png is rewritten."""
    common = dict(save=str(tmp_path / "ckpt"), save_metrics=str(tmp_path / "m"), progress=False)
    first = pretrain(TrainingConfig(train_iters=2, **common)).records
    pretrain(TrainingConfig(train_iters=4, load=str(tmp_path / "ckpt"), **common))
    history = read_jsonl(tmp_path / "m" / "metrics.jsonl")
    assert [r["iteration"] for r in history] == [1, 2, 3, 4]
    assert history[:2] == first
    assert (tmp_path / "m" / "loss.png").exists()


@pytest.mark.world(4)
def test_exactly_one_writer_under_pipeline_parallelism(tmp_path_factory):
    """cp2-pp2 with --tensorboard-dir: one event file (the last rank's), holding the
    records' values."""
    path = [str(tmp_path_factory.mktemp("tb")) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    config = TrainingConfig(
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        train_iters=2,
        eval_interval=2,
        eval_iters=1,
        log_interval=1,
        tensorboard_dir=path[0],
        progress=False,
    )
    with fresh_layout():
        result = pretrain(config)
    dist.barrier()
    failures = []
    if dist.get_rank() == 0:
        files = list(Path(path[0]).rglob("events.out.tfevents.*"))
        if len(files) != 1:
            failures.append(f"{len(files)} event files: {files}")
        failures += _mismatches(_events(path[0]), result.records, 1)
    assert_no_failures(failures)
