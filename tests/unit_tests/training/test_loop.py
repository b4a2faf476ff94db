"""The loop's extension point (issue 37 item 2): ``loop.AFTER_STEP_HOOKS`` runs in order
after each ``step``; a hook may extend the record (the sinks after it see the field) and stop
the run (``run.exits.stopped``)."""

import pytest

from megatron.training import TrainingConfig, loop
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
