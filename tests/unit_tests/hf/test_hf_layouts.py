"""HuggingFace models at parallel layouts (2 ranks): ``model_from_hf`` builds this rank's TP
shard / pipeline stage / experts (loading only its slices) and, on the CP shard of the
tokens, gives transformers' logits within 1e-5 relative (float32). The mixtures of experts
also run with expert parallelism: EP = 2 (each rank holds 2 of the 4 experts; alltoall
dispatcher) and TP = 2 with sequence parallelism x EP = 2 (ETP = 1). Rank 0 builds the tiny
models and computes transformers' logits once; every rank compares its part.
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
from tests.unit_tests.hf.hf_models import (
    FAMILIES,
    MOE_FAMILIES,
    SLOW_FAMILIES,
    shared_hf_models,
    token_ids,
)

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


LAYOUTS = {
    "tp2": Layout(tp=2),
    "cp2": Layout(cp=2),
    "pp2": Layout(pp=2),
    "ep2": Layout(dp=2, ep=2),  # MoE only
    "tp2-sp-ep2": Layout(tp=2, ep=2, etp=1),  # MoE only
}
# The MoE cases of the default run (the others are slow): mixed dense/MoE layers with a
# shared expert under both expert layouts, Mixtral at EP = 2, OLMoE's whole-projection q/k
# norms split over TP.
MOE_DEFAULT = {
    ("qwen2_moe", "ep2"),
    ("qwen2_moe", "tp2-sp-ep2"),
    ("mixtral", "ep2"),
    ("olmoe", "tp2-sp-ep2"),
}
SLOW = pytest.mark.slow


def _cases():
    for family in FAMILIES:
        for layout in LAYOUTS:
            if family in SLOW_FAMILIES:
                if LAYOUTS[layout].ep == 1:
                    yield pytest.param(family, layout, id=f"{layout}-{family}", marks=SLOW)
            elif family not in MOE_FAMILIES:
                if LAYOUTS[layout].ep == 1:
                    yield pytest.param(family, layout, id=f"{layout}-{family}")
            elif (family, layout) in MOE_DEFAULT:
                yield pytest.param(family, layout, id=f"{layout}-{family}")
            else:
                yield pytest.param(family, layout, id=f"{layout}-{family}", marks=SLOW)


@pytest.mark.parametrize("family, layout", list(_cases()))
def test_logits_at_a_layout_equal_transformers(hf_models, family, layout):
    use_layout(LAYOUTS[layout])
    tp = LAYOUTS[layout].tp
    explicit = layout == "pp2"  # the others use the parallel_state fallback
    groups = ProcessGroupCollection.use_mpu_process_groups() if explicit else None
    # a sliding window at C > 1 needs the a2a exchange (all_gather refuses it by name)
    windowed = family.endswith("window") or family in SLOW_FAMILIES
    extra = {"cp_comm_type": "a2a"} if windowed and layout == "cp2" else {}
    if family in MOE_FAMILIES or family in SLOW_FAMILIES:  # MoE at TP > 1 needs SP; Gemma's
        # sandwich norms run on the sequence shards
        extra["sequence_parallel"] = tp > 1
        if layout == "ep2":
            extra["moe_token_dispatcher_type"] = "alltoall"
    model, config = model_from_hf(hf_models.paths[family], pg_collection=groups, **extra)
    model.eval()
    ids = token_ids()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    expected = hf_models.logits[family]
    failures = []
    for layer in model.decoder.layers:  # each MoE layer holds its share of the 4 experts
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and len(experts.local_experts) != 4 // LAYOUTS[layout].ep:
            failures.append(f"{family} {layout}: {len(experts.local_experts)} local experts")
    with torch.no_grad():
        if layout == "ep2":
            ours = model(ids, positions)
        elif tp == 2:
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
