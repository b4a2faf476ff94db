"""What the command line settles before any worker starts: ``--load`` adopts the model and
data settings its checkpoint recorded (resuming a ``--hf-model`` run needs only ``--load``),
a contradicting flag is refused naming both values on its own line, and every input path is
checked (exit 2 before anything trains)."""

import json
import re
from pathlib import Path

import pytest

from megatron.training import preflight
from megatron.training.cli import main as train_cli
from tests.unit_tests.dist_utils import fresh_layout
from tests.unit_tests.hf.hf_models import LLAMA_CONFIG, write_random_hf_model

pytestmark = pytest.mark.world(1)
BATCH = ["--global-batch-size", "4", "--micro-batch-size", "1", "--no-progress"]


def _cli(*argv: str) -> int:
    with fresh_layout():
        return train_cli(list(argv))


def _losses(directory: Path):
    lines = (directory / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"loss"' in line]


def test_resuming_an_hf_model_run_needs_only_load(tmp_path, capsys, monkeypatch):
    hf = write_random_hf_model(tmp_path / "hf", LLAMA_CONFIG)
    ck, straight, resumed = tmp_path / "ck", tmp_path / "straight", tmp_path / "resumed"
    first = ["--hf-model", str(hf), "--seq-length", "16", *BATCH]
    assert _cli(*first, "--train-iters", "3", "--save-metrics", str(straight)) == 0
    assert _cli(*first, "--train-iters", "2", "--save", str(ck)) == 0
    capsys.readouterr()
    assert (
        _cli("--load", str(ck), "--train-iters", "3", *BATCH, "--save-metrics", str(resumed)) == 0
    )
    out = capsys.readouterr().out
    assert f"--load {ck}: the checkpoint's recorded settings are used for" in out
    assert "--hf-model" in out and "--num-layers" in out
    assert _losses(resumed)[-1:] == _losses(straight)[-1:], "the resume is not the straight run"
    # A flag contradicting the checkpoint: refused before anything trains, one per line.
    with pytest.raises(SystemExit) as stopped:
        _cli("--load", str(ck), "--train-iters", "3", *BATCH, "--num-layers", "4")
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "\n  --num-layers 2 when saved, 4 now" in err, err
    # Negative control: without the adoption the bare --load is refused (the old behaviour).
    monkeypatch.setattr(preflight, "ADOPTED", ())
    with pytest.raises(SystemExit):
        _cli("--load", str(ck), "--train-iters", "3", *BATCH)
    assert "was saved with other settings" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data-path", "{tmp}/missing.jsonl"], r"--data-path '.*missing.jsonl': no such file"),
        (["--data-path", "{tmp}"], r"--data-path '.*' is a folder"),
        (
            ["--data-path", "{tmp}/d.jsonl", "--valid-data-path", "{tmp}/nope.jsonl"],
            r"--valid-data-path '.*nope.jsonl': no such file",
        ),
        (
            ["--data-path", "{tmp}/d.jsonl", "--tokenizer", "{tmp}/tok.json"],
            r"--tokenizer '.*tok.json': no such file or folder",
        ),
        (["--hf-model", "{tmp}/d.jsonl"], r"--hf-model .*d.jsonl is a file; expected the model"),
        (["--load", "{tmp}/ck"], r"--load .*ck: no such directory"),
    ],
    ids=["data", "data-folder", "valid-data", "tokenizer", "hf-model-file", "load"],
)
def test_every_input_path_is_checked_before_the_workers_start(tmp_path, capsys, argv, message):
    (tmp_path / "d.jsonl").write_text('{"text": "ab"}\n')
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as stopped:
        _cli(*argv, "--nproc-per-node", "4", "--cp", "2", "--pp", "2")  # would launch 4
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
