"""A validation-only run (``--skip-train --valid-data-path V``) needs no training data and
shows no training bar (issue 38 item 11); validation asked of a --data-path without a
validation part is refused up front, not a raw traceback."""

import dataclasses
import json

import pytest

from megatron.training import TrainingConfig, validate_config
from megatron.training.errors import UsageError
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import fresh_layout

pytestmark = pytest.mark.world(1)

SMALL = dict(num_layers=2, seq_length=32, global_batch_size=2, micro_batch_size=1)


def _write(path, first, count):
    with open(path, "w") as handle:
        for i in range(first, first + count):
            handle.write(json.dumps({"prompt": f"say {i}: ", "completion": str(i)[::-1]}) + "\n")


def test_skip_train_evaluates_valid_data_path_without_training_data(tmp_path, capsys):
    """A checkpoint of a --data-path run evaluated with --skip-train --valid-data-path: no
    --data-path is demanded, the training data file is not read (deleted), the validation
    loss is the training run's own on the same file, and no training bar ('0/1') shows."""
    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    _write(train, 0, 8)
    _write(valid, 50, 3)
    common = dict(valid_data_path=str(valid), eval_iters=-1, **SMALL)
    with fresh_layout():
        trained = pretrain(
            TrainingConfig(
                data_path=str(train), train_iters=1, eval_interval=1, save=str(tmp_path / "ck"),
                progress=False, **common,
            )
        ).records[-1]  # fmt: skip
    train.unlink()  # nothing may read the training data now
    capsys.readouterr()
    # --data-path as the command line's --load adopts it from the checkpoint; the file is gone
    ckpt = dict(load=str(tmp_path / "ck"), data_path=str(train))
    config = TrainingConfig(skip_train=True, train_iters=1, **ckpt, **common)
    validate_config(dataclasses.replace(config, data_path=None), 1)  # it was refused
    with fresh_layout():
        (record,) = pretrain(config).records
    output = capsys.readouterr()
    assert record["valid_loss"] == pytest.approx(trained["valid_loss"], rel=1e-6)
    assert "0/1" not in output.err + output.out, output.err
    assert f"on {valid} (byte-level tokenizer)" in output.out, output.out


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(eval_interval=2), "--eval-interval 2 validates, but --data-path 'd.jsonl' has no"),
        (dict(skip_train=True, load="ck"), "--skip-train validates, but --data-path 'd.jsonl'"),
    ],
)
def test_validation_of_data_path_without_a_validation_part_is_refused(changes, message):
    """--eval-interval (or --skip-train) with --data-path but neither --split nor
    --valid-data-path ended in AttributeError: 'NoneType' object has no attribute
    'replace' inside the validation set; now a UsageError before anything runs."""
    with pytest.raises(UsageError, match=message):
        validate_config(TrainingConfig(data_path="d.jsonl", **changes), 1)
    validate_config(TrainingConfig(data_path="d.jsonl", split="9,1", **changes), 1)
