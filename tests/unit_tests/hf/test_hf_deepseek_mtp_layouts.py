"""The trainer from a DeepSeek-V3 checkpoint with its MTP layer (``--hf-model``; the tiny
checkpoint of ``test_hf_deepseek_mtp.py``) at parallel layouts: every rank's losses (LM and
"mtp_1 loss") follow the one-process run (``--compare-single-process``), and ``--export-hf``
writes the trained model with its MTP layer. Slow: torchrun launches.

Launch: ``torchrun --nproc-per-node 4 (or 2) -m pytest
tests/unit_tests/hf/test_hf_deepseek_mtp_layouts.py -m slow``.
"""

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.training import TrainingConfig
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout, gather_failures
from tests.unit_tests.hf.hf_models import HAVE_TRANSFORMERS, SKIP_REASON

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=SKIP_REASON)]
RUN = dict(seq_length=16, global_batch_size=4, micro_batch_size=1, progress=False)


def _checkpoint() -> Path:
    """A shared folder holding the tiny V3 with its MTP layer under ``hf`` (rank 0 writes)."""
    from tests.unit_tests.hf.test_hf_deepseek_mtp import build_mtp_checkpoint

    path = [tempfile.mkdtemp(prefix="hf-mtp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    directory = Path(path[0])
    if dist.get_rank() == 0:
        build_mtp_checkpoint(directory / "hf")
    dist.barrier()
    return directory


def _run_and_compare(directory: Path, **layout) -> list:
    """Train 3 iterations at ``layout`` from the checkpoint, export; the failures."""
    from megatron.training.hf.weights import SafetensorsReader

    with fresh_layout():
        result = pretrain(
            TrainingConfig(
                **RUN,
                **layout,
                hf_model=str(directory / "hf"),
                train_iters=3,
                compare_single_process=True,
                compare_tolerance=1e-5,
                export_hf=str(directory / "exported"),
            )
        )
    failures = [] if result.passed else ["the LM loss left the one-process run's"]
    ours = [r["mtp_1_loss"] for r in result.records]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ours)
    if any(other != everyone[0] for other in everyone):
        failures.append(f"ranks log different MTP losses: {everyone}")
    if dist.get_rank() == 0:
        reference = [r["mtp_1_loss"] for r in result.reference]
        if any(abs(g - w) > 1e-5 * abs(w) for g, w in zip(ours, reference)):
            failures.append(f"MTP losses {ours} differ from the one-process run's {reference}")
        original = SafetensorsReader(directory / "hf")
        exported = SafetensorsReader(directory / "exported")
        if sorted(original.keys()) != sorted(exported.keys()):
            failures.append("the export's tensors differ in name from the original's")
        for key in ("model.layers.2.eh_proj.weight", "model.layers.2.self_attn.kv_b_proj.weight"):
            everything = (slice(None), slice(None))
            if torch.equal(original.read(key, everything), exported.read(key, everything)):
                failures.append(f"{key} was not trained")
        head = exported.read("lm_head.weight", (slice(None),))
        if not torch.equal(exported.read("model.layers.2.shared_head.head.weight", (slice(None),)),
                           head):  # fmt: skip
            failures.append("the MTP layer's head copy is not the trained head")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return failures


@pytest.mark.world(4)
def test_v3_with_mtp_from_hf_at_cp2_pp2_follows_one_process_and_exports():
    """CP = 2 (the SFT masks are uneven over the CP chunks) x PP = 2 (the MTP layer and its
    copy of the embeddings on the last stage)."""
    failures = _run_and_compare(
        _checkpoint(), context_parallel_size=2, pipeline_model_parallel_size=2
    )
    assert_no_failures(gather_failures(failures))


@pytest.mark.world(2)
def test_v3_with_mtp_from_hf_with_the_distributed_optimizer_follows_one_process():
    """DP = 2 with the distributed optimizer (each rank updates its shard of the buffers)."""
    failures = _run_and_compare(_checkpoint(), use_distributed_optimizer=True)
    assert_no_failures(gather_failures(failures))
