"""HuggingFace models at parallel layouts (2 ranks): ``model_from_hf`` builds this rank's TP
shard / pipeline stage (loading only its slices) and, on the CP shard of the tokens, gives
transformers' logits within 1e-5 relative (float32). Rank 0 builds the tiny models and
computes transformers' logits once; every rank compares its part.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.training.hf import model_from_hf
from tests.unit_tests.dist_utils import (
    Layout,
    assert_no_failures,
    rel_error,
    reset_layout,
    use_layout,
)
from tests.unit_tests.hf.hf_models import FAMILIES, shared_hf_models, token_ids

pytestmark = pytest.mark.world(2)


@pytest.fixture(scope="module")
def hf_models():
    models = shared_hf_models()
    yield models
    reset_layout()
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(models.directory, ignore_errors=True)


LAYOUTS = {"tp2": Layout(tp=2), "cp2": Layout(cp=2), "pp2": Layout(pp=2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_at_a_layout_equal_transformers(hf_models, family, layout):
    use_layout(LAYOUTS[layout])
    explicit = layout == "pp2"  # the other two use the parallel_state fallback
    groups = ProcessGroupCollection.use_mpu_process_groups() if explicit else None
    # a sliding window at C > 1 needs the a2a exchange (all_gather refuses it by name)
    extra = {"cp_comm_type": "a2a"} if family.endswith("window") and layout == "cp2" else {}
    model, config = model_from_hf(hf_models.paths[family], pg_collection=groups, **extra)
    model.eval()
    ids = token_ids()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    expected = hf_models.logits[family]
    failures = []
    with torch.no_grad():
        if layout == "tp2":
            rank, size = parallel_state.get_tensor_model_parallel_rank(), 2
            block = expected.shape[-1] // size
            ours = model(ids, positions)
            expected = expected[..., rank * block : (rank + 1) * block]
        elif layout == "cp2":
            shard = get_batch_on_this_cp_rank({"tokens": ids, "position_ids": positions})
            ours = model(shard["tokens"], shard["position_ids"])
            expected = expected[:, shard["position_ids"][0]]
        else:
            group = parallel_state.get_pipeline_model_parallel_group()
            first = dist.get_global_rank(group, 0)
            hidden = torch.empty(ids.shape[1], ids.shape[0], config.hidden_size)
            if model.pre_process:
                hidden = model(ids, positions)
            dist.broadcast(hidden, src=first, group=group)
            ours = None
            if model.post_process:
                model.set_input_tensor(hidden)
                ours = model(ids, positions)
    if ours is not None:
        err = rel_error(ours, expected)
        if not err <= 1e-5:
            failures.append(f"{family} {layout}: relative error {err:.2e}")
    assert_no_failures(failures)
