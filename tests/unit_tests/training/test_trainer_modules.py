"""The trainer's modules (issue 37 item 2): the loop's extension point,
``loop.AFTER_STEP_HOOKS``, runs in order after each ``step`` (a hook may extend the record, and
the sinks after it see the field, and stop the run through ``run.exits.stopped``); the split
checkpoint modules keep every name ``megatron.training.checkpointing`` exported before."""

import pytest

from megatron.training import TrainingConfig, checkpointing, loop
from megatron.training.metrics import read_jsonl
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import fresh_layout

pytestmark = pytest.mark.world(1)

TINY = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8)
TINY.update(global_batch_size=1, micro_batch_size=1, progress=False)


def test_an_after_step_hook_extends_the_record_and_can_stop_the_run(tmp_path, monkeypatch):
    def mark(run, record):
        record["marked"] = record["iteration"] * 10

    def stop_after_two(run, record):
        if record["iteration"] == 2:
            run.exits.stopped = "stopped by a test hook"

    hooks = list(loop.AFTER_STEP_HOOKS)
    hooks.insert(hooks.index(loop.log_step), mark)
    monkeypatch.setattr(loop, "AFTER_STEP_HOOKS", hooks + [stop_after_two])
    with fresh_layout():
        result = pretrain(TrainingConfig(train_iters=4, save_metrics=str(tmp_path), **TINY))
    assert [r["marked"] for r in result.records] == [10, 20]
    assert result.stopped == "stopped by a test hook"
    assert [r["marked"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [10, 20]


# The public names checkpointing.py defined before its split (tests, docs and callers import
# them from there).
CHECKPOINTING_NAMES = (
    "TRACKER_FILENAME checkpoint_dir save_checkpoint find_latest_checkpoint load_checkpoint "
    "resolve_checkpoint MODEL_SETTINGS DATA_SETTINGS OPTIMIZER_SETTINGS LORA_SETTINGS "
    "compare_run_settings SCHEDULE APPLIED FRESH_ONLY OPTIMIZER_RESUME_RULES "
    "compare_optimizer_settings apply_optimizer_settings OPTIMIZER_KEY_PREFIX RNG_KEY_PREFIX "
    "base_weights"
).split()


def test_checkpointing_still_exports_every_public_name():
    missing = [name for name in CHECKPOINTING_NAMES if not hasattr(checkpointing, name)]
    assert not missing, f"megatron.training.checkpointing no longer exports {missing}"
