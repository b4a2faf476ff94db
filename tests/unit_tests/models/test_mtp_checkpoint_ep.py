"""MoE MTP depths' checkpoints at expert parallelism: each depth is stored through its own
``sharded_state_dict``, its routed experts on the global expert axis, so a dp2 x ep2 save
holds all four experts of each depth and every rank loads its own back (before, the depths
were stored flat by local expert index and EP rank 1's experts were saved as replicas of
rank 0's: lost, and loaded back as rank 0's)."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.dist_utils import Layout, assert_no_failures, gather_failures, use_layout
from tests.unit_tests.models.test_multi_token_prediction import MOE, _config, _model

pytestmark = pytest.mark.world(2)


def test_mtp_experts_round_trip_at_ep2(tmp_path):
    layout = Layout(dp=2, ep=2)
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    shared = [str(tmp_path)]
    dist.broadcast_object_list(shared, src=0)
    torch.manual_seed(0)
    saved = _model(_config(layout, **MOE), groups)
    dist_checkpointing.save(saved.sharded_state_dict(), shared[0])
    stored = dist_checkpointing.load_tensors_metadata(shared[0])
    key = "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight"
    failures = [] if key in stored else [f"no {key} in {sorted(stored)[:5]}"]
    if key in stored and stored[key].global_shape[0] != MOE["num_moe_experts"]:
        failures.append(f"{key} has shape {stored[key].global_shape}")
    torch.manual_seed(1)
    fresh = _model(_config(layout, **MOE), groups)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), shared[0]))
    for (name, a), b in zip(saved.named_parameters(), fresh.parameters()):
        if name.startswith("mtp.") and not torch.equal(a, b):
            failures.append(f"{name} loads another value")
    assert_no_failures(gather_failures(failures))
