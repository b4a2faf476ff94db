"""What a red team of bad command lines found (issue 38): each is refused by name before
anything trains, never overwritten silently, ignored silently, found only after training or
reported as a traceback. In-process: the trainer's ``main`` with training replaced by a
failure (``_run``), or the checks it calls."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.training import cli, preflight
from megatron.training.arguments import TrainingConfig, validate_config
from megatron.training.checkpointing import TRACKER_FILENAME
from megatron.training.errors import ERROR_FILE_VARIABLE, LAUNCHER_REPORTS_VARIABLE, UsageError
from megatron.training.hf import __main__ as hf_cli
from megatron.training.hf.families import REGISTRY
from tests.unit_tests.launch import LAUNCHER_VARS, ROOT

pytestmark = pytest.mark.world(1)
MOE = dict(num_experts=4, disable_bias_linear=True)
LLAMA_MOE = [
    "--num-experts", "4", "--disable-bias-linear", "--normalization", "RMSNorm", "--swiglu",
    "--position-embedding-type", "rope",
]  # fmt: skip


def _refused(capsys, *argv: str) -> str:
    """The one line ``main(argv)`` is refused with (exit 2, before training)."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(list(argv))
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def _fake_checkpoints(folder, iterations=(2, 4)):
    """A --save folder as the trainer leaves it (complete iter_N folders, the tracker)."""
    for i in iterations:
        (folder / f"iter_{i:07d}").mkdir(parents=True)
        (folder / f"iter_{i:07d}" / "metadata.json").write_text("{}")
    (folder / TRACKER_FILENAME).write_text(str(iterations[-1]))
    return folder


# ----------------------------------------------------------------------------- overwrites


def test_a_fresh_run_into_another_runs_save_folder_is_refused(tmp_path, capsys, no_training):
    ck = _fake_checkpoints(tmp_path / "ck")
    err = _refused(capsys, "--save", str(ck), "--train-iters", "1")
    assert f"--save {ck} already holds checkpoints" in err
    assert "names iteration 4" in err and f"resume them with --load {ck}" in err
    assert not no_training
    # Positive controls: an empty or new folder, and no --save at all, train.
    (tmp_path / "empty").mkdir()
    for save in (tmp_path / "empty", tmp_path / "new"):
        assert cli.main(["--save", str(save), "--train-iters", "1"]) == 0
    assert len(no_training) == 2


def test_finetuning_into_the_folder_it_starts_from_is_refused(
    tmp_path, capsys, monkeypatch, no_training
):
    ck = _fake_checkpoints(tmp_path / "ck")
    # The fake checkpoint holds no state to read: the settings are taken as they are.
    monkeypatch.setattr(cli, "adopt_checkpoint_settings", lambda config, explicit: (config, []))
    monkeypatch.setattr(cli, "check_input_paths", lambda config, adopted: None)
    err = _refused(capsys, "--load", str(ck), "--save", str(ck), "--finetune")
    assert f"--finetune --load {ck} --save {ck}: a fine-tuning run starts again at iter" in err
    assert not no_training and (ck / TRACKER_FILENAME).read_text() == "4"


@pytest.mark.parametrize(
    "load, finetune, message",
    [
        ("{ck}", True, r"--finetune --load .*ck --save .*ck: a fine-tuning run starts again"),
        ("{ck}/iter_0000002", True, r"--finetune .*overwrite the ones it starts from"),
        ("{other}", False, r"--save .*ck already holds .* --load .*other does not resume them"),
        ("{other}", True, r"--save .*ck already holds .* --load .*other does not resume them"),
        ("{ck}", False, None),  # the auto-resume idiom resumes them
        ("{ck}/iter_0000002", False, None),  # megatron's rewind to an earlier iteration
    ],
)
def test_save_writes_over_checkpoints_only_when_it_resumes_them(tmp_path, load, finetune, message):
    ck, other = _fake_checkpoints(tmp_path / "ck"), _fake_checkpoints(tmp_path / "other", [1])
    load = load.format(ck=ck, other=other)
    config = TrainingConfig(save=str(ck), load=load, finetune=finetune)
    if message is None:
        preflight.check_save_target(config)
        return
    with pytest.raises(UsageError, match=message):
        preflight.check_save_target(config)
    # --skip-train writes no checkpoint: nothing to refuse.
    preflight.check_save_target(TrainingConfig(save=str(ck), load=load, skip_train=True))


def test_hf_import_into_a_folder_holding_checkpoints_needs_overwrite(tmp_path, capsys):
    ck = _fake_checkpoints(tmp_path / "ck")
    missing = str(tmp_path / "no-model")
    assert hf_cli.main(["import", "--hf", missing, "--out", str(ck)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatron.training.hf: error: --out {ck} already holds checkpoints")
    assert "pass --overwrite" in err and (ck / TRACKER_FILENAME).read_text() == "4"
    # With --overwrite the import goes on (and here stops at the missing model).
    assert hf_cli.main(["import", "--hf", missing, "--out", str(ck), "--overwrite"]) == 2
    assert "no-model' does not exist" in capsys.readouterr().err


def test_the_tracker_names_agree_with_the_checkpointing_module():
    from megatron.core.dist_checkpointing.core import CONFIG_FNAME

    assert preflight.TRACKER_FILENAME == TRACKER_FILENAME
    assert preflight.CHECKPOINT_METADATA == CONFIG_FNAME


# ----------------------------------------------------------------------------- outputs


@pytest.mark.parametrize(
    "flag, what",
    [
        ("--save", "the checkpoints"),
        ("--save-metrics", "metrics.jsonl"),
        ("--tensorboard-dir", "TensorBoard event files"),
    ],
)
def test_an_output_folder_that_is_a_file_is_refused_before_training(
    tmp_path, capsys, no_training, flag, what
):
    afile = tmp_path / "afile"
    afile.write_text("x")
    err = _refused(capsys, flag, str(afile))
    assert f"{flag} {afile} is a file; expected a folder" in err and what in err
    err = _refused(capsys, flag, str(afile / "sub"))
    assert f"{flag} {afile / 'sub'}: {afile} is a file" in err
    assert not no_training


def test_an_export_no_huggingface_family_writes_is_refused_before_training(
    tmp_path, capsys, no_training
):
    out = tmp_path / "hf"
    err = _refused(
        capsys, *LLAMA_MOE, "--moe-router-score-function", "sigmoid", "--export-hf", str(out)
    )
    assert f"--export-hf {out}: the trained model would be written there after training" in err
    assert "matches no HuggingFace family we write" in err and not no_training
    # Positive control: softmax routing is Mixtral's.
    assert cli.main([*LLAMA_MOE, "--export-hf", str(out)]) == 0 and len(no_training) == 1


# ----------------------------------------------------------------------------- ignored flags


@pytest.mark.parametrize(
    "changes, explicit, message",
    [
        (dict(moe_router_topk=4), (), r"--moe-router-topk 4 needs --num-experts"),
        (dict(), ["moe_router_topk"], r"--moe-router-topk 2 needs --num-experts"),
        (dict(moe_layer_freq=2), (), r"--moe-layer-freq 2 needs --num-experts"),
        (dict(moe_layer_freq=[1, 0, 1, 0]), (), r"--moe-layer-freq 1 0 1 0 needs --num-exp"),
        (
            dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.01, **MOE),
            (),
            r"--moe-aux-loss-coeff 0.01 weighs .* --moe-router-load-balancing-type none",
        ),
        (
            dict(moe_router_load_balancing_type="none", **MOE),
            ["moe_aux_loss_coeff"],
            r"--moe-aux-loss-coeff 0.0 weighs",
        ),
        (
            dict(moe_router_bias_update_rate=0.01, **MOE),
            (),
            r"--moe-router-bias-update-rate 0.01 is the step of the expert bias, which is off",
        ),
        (
            dict(eval_interval=5, eval_iters=0),
            (),
            r"--eval-interval 5 asks for validation, but --eval-iters 0 turns it off",
        ),
        (
            dict(skip_train=True, load="ck", export_hf="out"),
            (),
            r"--skip-train trains nothing, so --export-hf out would write nothing",
        ),
    ],
)
def test_a_flag_the_run_would_ignore_is_refused(changes, explicit, message):
    with pytest.raises(UsageError, match=message):
        validate_config(TrainingConfig(**changes), 1, *([explicit] if explicit else []))


@pytest.mark.parametrize(
    "changes",
    [
        dict(),
        dict(moe_router_load_balancing_type="none", **MOE),
        dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid", **MOE),
        dict(eval_interval=5),
        dict(eval_iters=0, data_path="d.jsonl", split="9,1"),
    ],
)
def test_defaults_and_used_flags_are_not_refused(changes):
    """Negative controls: the defaults a run did not pass are never 'given'."""
    validate_config(TrainingConfig(**changes), 1, [])


def test_a_dense_models_expert_layout_typed_at_its_no_op_value_is_not_refused():
    """Megatron scripts pass ``--expert-model-parallel-size 1`` for dense models too; a
    value that would matter is refused (the control)."""
    typed = ["expert_model_parallel_size", "expert_tensor_parallel_size"]
    typed.append("moe_token_dispatcher_type")
    validate_config(TrainingConfig(expert_tensor_parallel_size=1), 1, typed)
    with pytest.raises(UsageError, match="--expert-model-parallel-size 2 needs --num-experts"):
        validate_config(TrainingConfig(expert_model_parallel_size=2), 2, typed)


# ----------------------------------------------------------------------------- unclear


@pytest.mark.parametrize("split", ["inf,1", "1,inf", "1e308,1e308,1"])
def test_a_split_with_an_infinite_weight_names_the_flag(split):
    config = TrainingConfig(data_path="d.jsonl", split=split)
    with pytest.raises(UsageError, match=rf"--split '{re.escape(split)}': expected .* finite"):
        validate_config(config, 1)


@pytest.mark.parametrize("name", ["SIGKILL", "SIGSTOP"])
def test_an_exit_signal_no_handler_can_catch_is_refused_with_the_choices(name):
    config = TrainingConfig(exit_signal_handler=True, exit_signal=name, save="ck")
    with pytest.raises(UsageError, match=rf"--exit-signal must be .*SIGTERM.*got '{name}'"):
        validate_config(config, 1)
    with pytest.raises(OSError):  # what the handler's installation would have said
        signal.signal(signal.Signals[name], lambda *a: None)
    validate_config(TrainingConfig(exit_signal_handler=True, exit_signal="SIGUSR1", save="ck"), 1)


def test_ctrl_c_in_a_rank_ends_it_with_one_line_and_status_130(tmp_path, capsys, monkeypatch):
    def interrupted(config, _source=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", interrupted)
    try:
        status = cli.main(["--train-iters", "1"])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt escaped main (a traceback)")
    err = capsys.readouterr().err
    assert status == 130 and err.startswith("megatron.training: error: interrupted (SIGINT")
    assert len(err.strip().splitlines()) == 1, err
    # Under a launcher: the line goes to torchrun's error file, where the launcher and the
    # other ranks (which lost their peer) find it.
    error_file = tmp_path / "0" / "error.json"
    monkeypatch.setenv(ERROR_FILE_VARIABLE, str(error_file))
    monkeypatch.setenv(LAUNCHER_REPORTS_VARIABLE, "1")
    assert cli.main(["--train-iters", "1"]) == 130
    assert "interrupted (SIGINT" in json.loads(error_file.read_text())["message"]["message"]


# ----------------------------------------------------------------------------- --help


def test_help_shows_the_defaults_and_every_huggingface_family(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert stopped.value.code == 0
    assert "seed of the weights and of the generated data (default: 1234)" in out
    assert "(default: SIGTERM)" in out
    hf_help = out[out.index("--hf-model DIR start") :][:400]
    assert all(model_type in hf_help for model_type in REGISTRY), hf_help


def test_the_hf_tool_prefixes_its_errors_with_its_name_and_shows_its_defaults(tmp_path, capsys):
    assert hf_cli.main(["export", "--load", str(tmp_path / "nope"), "--out", "x"]) == 2
    assert capsys.readouterr().err.startswith("megatron.training.hf: error: ")
    from megatron.training.hf.checkpoint import DEFAULT_MAX_SHARD_SIZE

    export = hf_cli.build_parser().parse_args(["export", "--load", "ck", "--out", "x"])
    assert export.max_shard_size == DEFAULT_MAX_SHARD_SIZE


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_to_one_rank_of_a_launch_ends_it_with_one_line(tmp_path):
    """SIGINT to one worker of a 2-rank self-launch: the launch ends with that rank's one
    line and no traceback (before: rank 1's KeyboardInterrupt traceback, ~100 lines)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1")
    log = tmp_path / "log"
    command = [sys.executable, "-m", "megatron.training", "--nproc-per-node", "2", "--cp", "2"]
    command += ["--train-iters", "100000", "--no-progress", "--log-interval", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and "iteration 2/" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-4000:]
            time.sleep(0.5)
        children = [
            int(p)
            for task in Path(f"/proc/{proc.pid}/task").glob("*")
            for p in (task / "children").read_text().split()
        ]
        assert len(children) == 2, (children, log.read_text()[-4000:])
        os.kill(max(children), signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text()
    assert proc.returncode == 1 and "Traceback" not in output, output[-4000:]
    assert output.count("megatron.training: error") == 1, output[-4000:]
    assert "error on rank 1: interrupted (SIGINT, Ctrl-C)" in output, output[-4000:]
