"""A resumed SFT / pretraining run keeps the ``--seed`` its checkpoint was written with: the
generated samples (and a data file's per-epoch shuffle) are drawn from it, so ``--load``
adopts the recorded seed, and another ``--seed`` is refused naming both values (as for DPO,
``test_dpo_resume.py``); ``--finetune`` starts new data with any seed."""

import dataclasses

import pytest

from megatron.training import TrainingConfig
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import fresh_layout

pytestmark = pytest.mark.world(1)
TINY = dict(
    num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, global_batch_size=2,
    micro_batch_size=2, progress=False, eval_interval=None,
)  # fmt: skip


def _losses(config: TrainingConfig):
    with fresh_layout():
        return [r["loss"] for r in pretrain(config).records]


@pytest.mark.slow  # 5 tiny pretrain runs, ~2.5 s: over the default run's share
def test_a_resume_keeps_the_seed_of_its_generated_data(tmp_path, capsys, no_training):
    from megatron.training import cli

    straight = _losses(TrainingConfig(**TINY, train_iters=2, seed=7))
    first = _losses(TrainingConfig(**TINY, train_iters=1, seed=7, save=str(tmp_path)))
    command = ["--load", str(tmp_path), "--train-iters", "2", "--global-batch-size", "2"]
    command += ["--micro-batch-size", "2"]  # the model's settings: adopted from the checkpoint
    assert cli.main(command) == 0
    assert no_training[0].seed == 7  # adopted: the resumed step trains on the saved seed's data
    resumed = _losses(dataclasses.replace(no_training[0], progress=False))
    assert first + resumed == straight
    other_seed = _losses(TrainingConfig(**TINY, train_iters=2, seed=1234))
    assert other_seed[1] != straight[1]  # the seed draws the data: the check above can fail

    with pytest.raises(SystemExit) as refused:
        cli.main(command + ["--seed", "8"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--seed 7 when saved, 8 now" in err, err
    with pytest.raises(ValueError, match="--seed 7 when saved, 1234 now"):
        _losses(TrainingConfig(**TINY, train_iters=2, load=str(tmp_path)))
    tuned = _losses(TrainingConfig(**TINY, train_iters=1, load=str(tmp_path), finetune=True))
    assert len(tuned) == 1  # --finetune: new data, any seed
