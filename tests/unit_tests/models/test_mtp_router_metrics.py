"""The router metrics of MoE multi-token prediction depths, as megatron-core 0.16.1 logs
them: each depth's router files its losses and counts as layer num_layers + k + 1, and
``track_moe_metrics(..., mtp_num_layers=K)`` averages over the decoder's MoE layers and the
K depths. At PP = 2 a stage without MoE layers (DeepSeek's first dense layers) joins the
reduction with zeros."""

import pytest

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe import moe_utils
from tests.unit_tests.models.test_multi_token_prediction import (
    DEPTHS,
    LAYERS,
    MOE,
    _config,
    _model,
    batch,
)


def _forward() -> int:
    """One forward of the MoE MTP model with the load-balancing loss on; the routed tokens."""
    moe_utils.reset_aux_losses_tracker()
    config = _config(**MOE, moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="aux_loss")
    model = _model(config, ProcessGroupCollection())
    rows = batch()
    model(rows["tokens"], None, labels=rows["labels"], loss_mask=rows["loss_mask"])
    return rows["tokens"].numel()


@pytest.mark.world(1)
def test_mtp_depths_routers_are_tracked_after_the_decoders():
    tokens = _forward()
    metrics = moe_utils.reduced_moe_metrics(1.0, LAYERS, None, mtp_num_layers=DEPTHS)
    counts = metrics["tokens_per_expert"]
    assert counts.shape == (LAYERS + DEPTHS, MOE["num_moe_experts"])
    # every router, the depths' included, routed each token to top-k experts
    assert counts.sum(dim=1).tolist() == [tokens * MOE["moe_router_topk"]] * (LAYERS + DEPTHS)
    losses = metrics["load_balancing_loss"]
    assert losses.shape == (LAYERS + DEPTHS,) and bool((losses[LAYERS:] > 0).all())


@pytest.mark.world(1)
def test_track_moe_metrics_averages_over_decoder_and_mtp_layers():
    _forward()
    per_layer = moe_utils.reduced_moe_metrics(0.5, LAYERS, None, mtp_num_layers=DEPTHS)
    moe_utils.clear_aux_losses_tracker()
    _forward()
    record = {}
    moe_utils.track_moe_metrics(
        0.5, 1, total_loss_dict=record, num_layers=LAYERS, mtp_num_layers=DEPTHS
    )
    values = per_layer["load_balancing_loss"]
    # megatron-core: the sum over the tracked layers / (MoE layers + mtp_num_layers)
    assert float(record["load_balancing_loss"]) == pytest.approx(
        float(values.sum()) / (LAYERS + DEPTHS), rel=1e-12
    )
    assert float(values.sum()) > float(values[:LAYERS].sum())


@pytest.mark.world(1)
def test_dense_first_layer_keeps_depths_rows():
    """With ``moe_layer_freq`` [0, 1] the dense layer's row is dropped, the depths' kept."""
    _forward()
    metrics = moe_utils.reduced_moe_metrics(1.0, LAYERS, [0, 1], mtp_num_layers=DEPTHS)
    assert metrics["tokens_per_expert"].shape[0] == 1 + DEPTHS


@pytest.mark.world(2)
def test_a_pipeline_stage_without_moe_layers_joins_the_reduction():
    """PP = 2, only stage 1 tracks (its MoE layer 2 of 2): both stages get the values reduced
    over the whole step; before, stage 0 skipped the pipeline all-reduce (a deadlock)."""
    import torch
    import torch.distributed as dist

    from tests.unit_tests.dist_utils import Layout, use_layout

    use_layout(Layout(pp=2))
    groups = ProcessGroupCollection.use_mpu_process_groups()
    moe_utils.reset_aux_losses_tracker()
    stage = dist.get_rank(groups.pp)
    if stage == 1:
        loss = torch.tensor(3.0, dtype=torch.float64)
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", loss, 2, 2, groups.tp_cp)
        counts = torch.tensor([5, 7])
        moe_utils.save_tokens_per_expert(counts, 2, 2, groups.tp_cp, groups.dp)
    metrics = moe_utils.reduced_moe_metrics(0.5, 2, [0, 1], pg_collection=groups)
    assert metrics["load_balancing_loss"].tolist() == [1.5]
    assert metrics["tokens_per_expert"].tolist() == [[5, 7]]
    moe_utils.reset_aux_losses_tracker()
