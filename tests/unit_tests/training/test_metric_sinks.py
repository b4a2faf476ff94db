"""A run can be watched while it runs (issue 38 item 7, issue 37 item 5): every record goes to
every sink of ``loggers.SINKS`` as its iteration ends -- metrics.jsonl appended and flushed
(a crash or a kill leaves the finished iterations; a resumed run continues the file),
TensorBoard / W&B every ``--tensorboard-log-interval`` (megatron's flag, default 1), the
router losses and tokens per expert included."""

import json

import pytest

from megatron.training import TrainingConfig, loop
from megatron.training.errors import UsageError
from megatron.training.loggers import SINKS, JsonlSink, MetricSink, Ranks
from megatron.training.metrics import read_jsonl
from megatron.training.training import pretrain
from megatron.training.validation import validate_config
from tests.unit_tests.dist_utils import fresh_layout

pytestmark = pytest.mark.world(1)

SMALL = dict(num_layers=2, seq_length=16, global_batch_size=2, micro_batch_size=1, progress=False)


class _Watcher(MetricSink):
    """A sink added in one place (``SINKS``) that reads metrics.jsonl at each record, as
    ``tail -f`` would."""

    name = "watcher"
    seen = []  # (iteration of the record, iterations metrics.jsonl holds then)
    path = None

    @classmethod
    def create(cls, config, ranks):
        return cls() if config.save_metrics else None

    def log(self, record):
        held = read_jsonl(self.path) if self.path.exists() else []
        self.seen.append((record["iteration"], [r["iteration"] for r in held]))


def test_metrics_jsonl_is_written_as_the_run_goes_and_survives_a_crash(tmp_path, monkeypatch):
    """A sink registered in SINKS gets every record, and metrics.jsonl (the sink before it)
    already holds that record; the run crashes in iteration 3: metrics.jsonl holds 1 and 2
    (it was written only at the end of a run, so a crash or a kill lost it)."""
    _Watcher.seen, _Watcher.path = [], tmp_path / "m" / "metrics.jsonl"
    monkeypatch.setitem(SINKS, _Watcher.name, _Watcher.create)
    original = loop.logged_loss

    def crash_at_3(reported, groups):
        if len(_Watcher.seen) == 2:
            raise RuntimeError("killed in iteration 3")
        return original(reported, groups)

    monkeypatch.setattr(loop, "logged_loss", crash_at_3)
    with fresh_layout(), pytest.raises(RuntimeError, match="killed in iteration 3"):
        pretrain(TrainingConfig(train_iters=4, save_metrics=str(tmp_path / "m"), **SMALL))
    assert _Watcher.seen == [(1, [1]), (2, [1, 2])], _Watcher.seen
    assert [r["iteration"] for r in read_jsonl(tmp_path / "m" / "metrics.jsonl")] == [1, 2]


def test_a_resumed_run_continues_a_killed_runs_file(tmp_path):
    """A killed run left iterations 1-5 and half of 6; the resume from the checkpoint of 3
    rewrites the history before 4 and appends 4, 5 as they come (no duplicate, no torn
    line)."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"iteration": i, "loss": 5.0 - i}) for i in range(1, 6)]
    path.write_text("\n".join(lines) + '\n{"iteration": 6, "lo')
    sink = JsonlSink.create(
        TrainingConfig(save_metrics=str(tmp_path)), Ranks(first=True, last=False)
    )
    try:
        sink.log({"iteration": 4, "loss": 0.5})
        assert [r["iteration"] for r in read_jsonl(path)] == [1, 2, 3, 4]
        sink.log({"iteration": 5, "loss": 0.4})  # appended and flushed, the sink still open
        assert [r["loss"] for r in read_jsonl(path)] == [4.0, 3.0, 2.0, 0.5, 0.4]
    finally:
        sink.close()
    assert JsonlSink.create(TrainingConfig(save_metrics=str(tmp_path)), Ranks(False, True)) is None


def test_tensorboard_gets_every_iteration_and_the_router_metrics(tmp_path):
    """A 2-iteration MoE run with the default --log-interval 100: TensorBoard has the
    training scalars of both iterations (--tensorboard-log-interval 1, megatron's default;
    it had none), the router losses under megatron's names and the tokens per expert, each
    equal to metrics.jsonl's value."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    config = TrainingConfig(
        train_iters=2,
        num_experts=4,
        disable_bias_linear=True,
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001,
        tensorboard_dir=str(tmp_path / "tb"),
        save_metrics=str(tmp_path / "m"),
        **SMALL,
    )
    with fresh_layout():
        pretrain(config)
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    reader = accumulator.EventAccumulator(str(events), size_guidance={"scalars": 0})
    reader.Reload()
    held = {tag: {e.step: e.value for e in reader.Scalars(tag)} for tag in reader.Tags()["scalars"]}
    records = read_jsonl(tmp_path / "m" / "metrics.jsonl")
    pairs = [("loss", "lm loss"), ("moe_load_balancing_loss", "load_balancing_loss")]
    pairs.append(("moe_z_loss", "z_loss"))
    for key, tag in pairs:
        want = {r["iteration"]: pytest.approx(r[key], rel=1e-6) for r in records}
        assert held.get(tag) == want, (tag, held.get(tag), want)
    tokens = held["moe/tokens_per_expert/layer_1_expert_3"]
    assert tokens == {r["iteration"]: r["moe_tokens_per_expert"][1][3] for r in records}


def test_tensorboard_log_interval_needs_a_scalar_logger():
    """--tensorboard-log-interval without --tensorboard-dir or --wandb-project is refused,
    naming the flag and what it needs."""
    with pytest.raises(UsageError, match="--tensorboard-log-interval 5 .* --tensorboard-dir"):
        validate_config(TrainingConfig(tensorboard_log_interval=5), 1)


def test_console_prints_megatrons_line_every_log_interval(capsys):
    """--no-progress --log-interval 2: a line for iteration 2 only, with the router losses
    under megatron's names; with the progress bar, no console sink."""
    config = TrainingConfig(progress=False, log_interval=2, train_iters=3)
    sink = SINKS["console"](config, Ranks(first=True, last=False))
    base = dict(loss=2.0, lr=1e-3, grad_norm=1.0, iteration_time_s=0.1, tokens_per_s=10.0)
    for iteration in (1, 2, 3):
        sink.log({"iteration": iteration, "moe_load_balancing_loss": 1.25, **base})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(" iteration 2/3 | lm loss: 2.000000E+00")
    assert "load_balancing_loss: 1.250000E+00" in lines[0], lines
    assert SINKS["console"](TrainingConfig(), Ranks(first=True, last=True)) is None
