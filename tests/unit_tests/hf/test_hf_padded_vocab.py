"""GPT-2's vocabulary (50,257 tokens, divisible by no TP > 1) at TP = 2: the model pads its
table to a multiple of TP, gives transformers' logits on the true ids (padded ids -inf),
trains from ``--hf-model``, and ``--export-hf`` strips the padding (tied embeddings): the
exported model, loaded in transformers, gives the logits of our trained model read back at
one process (unpadded) from the TP = 2 ``--save`` checkpoint.
"""

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.training import TrainingConfig
from megatron.training.checkpointing import checkpoint_dir
from megatron.training.hf import model_from_hf
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout, rel_error
from tests.unit_tests.hf.hf_models import HAVE_TRANSFORMERS, SKIP_REASON, transformers_logits

GPT2_VOCAB, SEQ = 50257, 16
CONFIG = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=GPT2_VOCAB)


def _build_gpt2(directory: Path) -> Path:
    import transformers

    torch.manual_seed(7)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**CONFIG, initializer_range=0.1)
    ).eval()
    model.save_pretrained(directory)
    return directory


def _ids() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, GPT2_VOCAB, (2, SEQ), generator=generator)
    ids[0, :3] = torch.tensor([GPT2_VOCAB - 1, GPT2_VOCAB - 2, 0])  # the last true ids
    return ids


@pytest.mark.world(2)
def test_gpt2_vocab_at_tp2_matches_transformers_trains_and_exports_unpadded():
    if not HAVE_TRANSFORMERS:
        pytest.skip(SKIP_REASON)
    shared = [tempfile.mkdtemp(prefix="hf-gpt2-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    directory = Path(shared[0])
    hf = directory / "gpt2"
    failures = []
    reference = None
    if dist.get_rank() == 0:
        _build_gpt2(hf)
        reference = transformers_logits(hf, _ids())
    box = [reference]
    dist.broadcast_object_list(box, src=0)
    reference = box[0]

    with fresh_layout():  # (1) the padded model at TP = 2 gives transformers' logits
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        groups = ProcessGroupCollection.use_mpu_process_groups()
        model, _ = model_from_hf(hf, pg_collection=groups)
        if (model.vocab_size, model.true_vocab_size) != (50258, GPT2_VOCAB):
            failures.append(f"vocabulary {model.vocab_size}/{model.true_vocab_size}")
        ids = _ids()
        with torch.no_grad():
            local = model(ids, torch.arange(SEQ).expand_as(ids))  # [b, s, V / 2]
            logits = gather_from_tensor_model_parallel_region(local, groups.tp)
        if not torch.isinf(logits[..., GPT2_VOCAB:]).all():
            failures.append("the padded id's logit is not -inf")
        err = rel_error(logits[..., :GPT2_VOCAB], reference)
        if not err <= 1e-5:
            failures.append(f"TP = 2 logits differ from transformers: {err:.2e}")

    # (2) trains at TP = 2 from --hf-model; --export-hf strips the padding
    with fresh_layout():
        result = pretrain(
            TrainingConfig(
                hf_model=str(hf),
                tensor_model_parallel_size=2,
                seq_length=SEQ,
                global_batch_size=4,
                micro_batch_size=1,
                train_iters=2,
                progress=False,
                save=str(directory / "ckpt"),
                export_hf=str(directory / "exported"),
            )
        )
    losses = [r["loss"] for r in result.records]
    if not all(loss == loss and 0 < loss < 20 for loss in losses):
        failures.append(f"losses {losses}")
    # our trained model at one process (unpadded): the TP = 2 checkpoint read back (a
    # collective load: every rank)
    ours, _ = model_from_hf(hf, pg_collection=ProcessGroupCollection())
    saved = dist_checkpointing.load(
        {"model": ours.sharded_state_dict()}, str(checkpoint_dir(str(directory / "ckpt"), 2))
    )
    ours.load_state_dict(saved["model"])
    ours.eval()
    original = model_from_hf(hf, pg_collection=ProcessGroupCollection())[0]
    if torch.equal(
        ours.embedding.word_embeddings.weight, original.embedding.word_embeddings.weight
    ):
        failures.append("the saved model equals the original: nothing was trained")
    if dist.get_rank() == 0:
        from safetensors import safe_open

        exported = directory / "exported"
        config = json.loads((exported / "config.json").read_text())
        with safe_open(str(exported / "model.safetensors"), framework="pt") as handle:
            shape = list(handle.get_slice("transformer.wte.weight").get_shape())
            has_head = "lm_head.weight" in handle.keys()
        if config["vocab_size"] != GPT2_VOCAB or shape != [GPT2_VOCAB, 32] or has_head:
            failures.append(f"export: vocab_size {config['vocab_size']}, wte {shape}")
        ids = _ids()
        with torch.no_grad():
            trained = ours(ids, torch.arange(SEQ).expand_as(ids))
        err = rel_error(transformers_logits(exported, ids), trained)
        if not err <= 1e-5:
            failures.append(f"exported model's logits differ from ours: {err:.2e}")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    assert_no_failures(failures)
