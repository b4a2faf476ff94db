"""The trainer with LoRA (``--lora-dim``): the same training at every layout, adapter-only
checkpoints that resume at another layout, a base model from a checkpoint of ours, and the
flags refused without ``--lora-dim``. (The adapters' gradients against an independent
reference: ``tests/unit_tests/models/test_lora_parity.py``.)"""

import shutil
import tempfile
from pathlib import Path
from typing import List

import pytest
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.training import TrainingConfig
from megatron.training.arguments import validate_config
from megatron.training.checkpointing import checkpoint_dir
from megatron.training.errors import UsageError
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import fresh_layout

SMALL = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    global_batch_size=8,
    progress=False,
    lr=1e-2,
)
LORA = dict(lora_dim=4, lora_alpha=8.0, lora_b_init_method="normal")


def _run(**changes) -> List[float]:
    with fresh_layout():
        result = pretrain(TrainingConfig(**{**SMALL, **changes}))
    assert result.passed
    return [r["loss"] for r in result.records]


def _shared_dir() -> str:
    path = [tempfile.mkdtemp(prefix="lora-test-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


@pytest.mark.world(4)
@pytest.mark.slow  # two one-process comparison runs on rank 0 while the others wait
def test_a_lora_run_at_cp2_pp2_follows_the_one_process_run():
    """--compare-single-process with --lora-dim: the 4-rank run and the one-process run agree
    (the comparison raises the run's ``passed`` flag, asserted in ``_run``)."""
    losses = _run(context_parallel_size=2, pipeline_model_parallel_size=2, train_iters=3,
                  num_layers=2, hidden_size=16, compare_single_process=True,
                  **LORA)  # fmt: skip
    assert losses[-1] < losses[0]


@pytest.mark.world(2)
@pytest.mark.slow
def test_lora_with_the_distributed_optimizer_at_dp2_follows_the_one_process_run():
    """The adapters' Adam state sharded over two data-parallel ranks (the base has none): the
    losses follow the one-process run (``--compare-single-process``, asserted in ``_run``)."""
    losses = _run(use_distributed_optimizer=True, train_iters=3, num_layers=2, hidden_size=16,
                  compare_single_process=True, **LORA)  # fmt: skip
    assert losses[-1] < losses[0]


@pytest.mark.world(2)
def test_adapter_only_checkpoints_resume_at_another_layout_from_a_base_checkpoint():
    """A base trained and saved (full model); LoRA on it with --pretrained-checkpoint, saving
    adapters only (the checkpoint holds no base weight); resuming it at another layout
    continues the uninterrupted run's losses."""
    root = Path(_shared_dir())
    try:
        _run(train_iters=2, save=str(root / "base"))
        lora = dict(LORA, pretrained_checkpoint=str(root / "base"), train_iters=4)
        straight = _run(tensor_model_parallel_size=2, **lora)
        first = _run(context_parallel_size=2, **dict(lora, train_iters=2),
                     save=str(root / "lora"), save_trainable_params_only=True)  # fmt: skip
        resumed = _run(tensor_model_parallel_size=2, sequence_parallel=True, **lora,
                       load=str(root / "lora"), save=str(root / "lora"),
                       save_trainable_params_only=True)  # fmt: skip
        assert first == pytest.approx(straight[:2], rel=1e-6)
        assert resumed == pytest.approx(straight[2:], rel=1e-6)
        stored = dist_checkpointing.load_tensors_metadata(
            str(checkpoint_dir(str(root / "lora"), 4))
        )
        weights = [k for k in stored if not k.startswith(("optimizer", "rng_state"))]
        assert weights and all(".adapter." in k for k in weights), sorted(stored)
        base = dist_checkpointing.load_tensors_metadata(str(checkpoint_dir(str(root / "base"), 2)))
        assert "embedding.word_embeddings.weight" in base  # positive control: a full one has it
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.world(2)
@pytest.mark.slow
def test_an_adapter_only_checkpoint_without_its_base_is_refused():
    root = Path(_shared_dir())
    try:
        _run(train_iters=2, save=str(root / "base"))
        _run(**LORA, train_iters=2, pretrained_checkpoint=str(root / "base"),
             save=str(root / "lora"), save_trainable_params_only=True)  # fmt: skip
        # the base it was trained on is named (the recorded --pretrained-checkpoint)
        with pytest.raises(ValueError, match="--pretrained-checkpoint"):
            _run(**LORA, train_iters=4, load=str(root / "lora"))
        with pytest.raises(ValueError, match="--lora-dim 4 when saved, not given now"):
            _run(train_iters=4, load=str(root / "lora"))
        # --finetune from the base: the adapters start fresh (positive control: it loads)
        _run(**LORA, train_iters=2, load=str(root / "base"), finetune=True)
        with pytest.raises(ValueError, match="pass --finetune"):
            _run(**LORA, train_iters=4, load=str(root / "base"))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(lora_alpha=4.0), "--lora-alpha 4.0 needs --lora-dim"),
        (dict(save_trainable_params_only=True, save="x"), "--save-trainable-params-only"),
        (dict(lora_target_modules=["linear_qkv"]), "--lora-target-modules linear_qkv needs"),
        (dict(lora_dim=3, tensor_model_parallel_size=2), "--lora-dim 3 is not divisible"),
        (dict(lora_dim=4, lora_target_modules=["qkv"]), "'qkv': expected one of"),
        (dict(lora_dim=4, save_trainable_params_only=True), "needs --save DIR"),
    ],
    ids=["alpha", "save-trainable", "targets", "dim-tp", "unknown-target", "no-save"],
)
def test_lora_flags_are_refused_by_name(changes, message):
    config = TrainingConfig(**{**SMALL, **changes})
    world = config.tensor_model_parallel_size
    with pytest.raises(UsageError, match=message):
        validate_config(config, world)


@pytest.mark.world(1)
def test_targets_that_match_no_layer_are_refused():
    with pytest.raises(ValueError, match="matches no layer"):
        _run(lora_dim=4, lora_target_modules=["*.layers.9.*"], train_iters=1)
