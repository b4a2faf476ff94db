"""Rule 3 (SPEC section 12): under sequence parallelism a parameter replicated over TP but
fed a TP shard of the data has its gradient summed over the TP group by
``finalize_model_grads``, whatever the module.

Toy model (TP = 2 and 4, SP on): LayerNorm (replicated weight and bias) times a free
replicated ``scale`` parameter on [s/T, b, h] activations, then Column -> GeLU -> Row with a
replicated row bias. No layer names are listed anywhere: every parameter that is not
``tensor_model_parallel`` is marked ``sequence_parallel`` generically. After
``finalize_model_grads`` every ``main_grad`` equals the dense float64 gradient (the TP
shards' the slices of it); negative control: without the TP sum the replicated ones don't.
"""

import importlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.dist_utils import WORLD_SIZE, assert_no_failures, rel_error, reset_layout
from tests.unit_tests.tensor_parallel.tp_reference import (
    TOL,
    block,
    device,
    full_weight,
    on_device,
    seeded,
    world_group,
)

pytestmark = [pytest.mark.world(2, 4), pytest.mark.timeout(120)]

S, B, H, F_ = 8, 2, 6, 8

# the module (the package exports the function under the same name)
finalize_module = importlib.import_module("megatron.core.distributed.finalize_model_grads")


class Toy(torch.nn.Module):
    """norm(x) * scale -> Column -> GeLU -> Row (bias)."""

    def __init__(self, config, group):
        super().__init__()
        self.norm = torch.nn.LayerNorm(H, dtype=torch.float64)
        self.scale = torch.nn.Parameter(seeded(H, 20))
        torch.manual_seed(0)
        self.fc1 = ColumnParallelLinear(
            H, F_, config=config, init_method=torch.nn.init.normal_, bias=False, tp_group=group
        )
        torch.manual_seed(1)
        self.fc2 = RowParallelLinear(
            F_,
            H,
            config=config,
            init_method=torch.nn.init.normal_,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=group,
        )
        with torch.no_grad():
            self.norm.weight.copy_(seeded(H, 21))
            self.norm.bias.copy_(seeded(H, 22))
            self.fc2.bias.copy_(seeded(H, 23))

    def forward(self, x):
        hidden, _ = self.fc1(self.norm(x) * self.scale)
        return self.fc2(F.gelu(hidden))[0]


def mark_replicated_params_sequence_parallel(module: torch.nn.Module) -> None:
    """Generic marking: every parameter not split over TP is fed sequence shards."""
    for param in module.parameters():
        if not getattr(param, "tensor_model_parallel", False):
            param.sequence_parallel = True


def _dense_grads(x, g):
    """Dense float64 gradients of sum(out * g), keyed like the toy's parameters."""
    params = {
        "norm.weight": seeded(H, 21),
        "norm.bias": seeded(H, 22),
        "scale": seeded(H, 20),
        "fc1.weight": full_weight((F_, H), 0),
        "fc2.weight": full_weight((H, F_), 1),
        "fc2.bias": seeded(H, 23),
    }
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    normed = F.layer_norm(x, (H,), p["norm.weight"], p["norm.bias"]) * p["scale"]
    out = F.linear(F.gelu(F.linear(normed, p["fc1.weight"])), p["fc2.weight"], p["fc2.bias"])
    (out * g).sum().backward()
    return {k: v.grad for k, v in p.items()}


_SELF_GROUPS = {}


def _self_group():
    """A one-rank group per process (the data-parallel group when the world is TP)."""
    if WORLD_SIZE not in _SELF_GROUPS:
        groups = [dist.new_group([r]) for r in range(WORLD_SIZE)]
        _SELF_GROUPS[WORLD_SIZE] = groups[dist.get_rank()]
    return _SELF_GROUPS[WORLD_SIZE]


def _run(groups: str):
    """Failure messages comparing every main_grad with the dense gradient (its TP slice)."""
    group, T, rank = world_group()
    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=T,
        tensor_model_parallel_size=T,
        sequence_parallel=True,
        params_dtype=torch.float64,
    )
    if groups == "pg_collection":
        pgc = ProcessGroupCollection(tp=group, dp_cp=_self_group(), dp=_self_group())
        toy = Toy(config, group)
    else:  # MPU fallback everywhere
        pgc = None
        toy = Toy(config, None)
    toy.to(device())
    mark_replicated_params_sequence_parallel(toy)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), toy, pg_collection=pgc)
    model.zero_grad_buffer()
    x, g = seeded((S, B, H), 1), seeded((S, B, H), 2)
    out = model(on_device(block(x, 0, rank, T)))
    (out * on_device(block(g, 0, rank, T))).sum().backward()
    finalize_model_grads([model], pg_collection=pgc)

    dense = _dense_grads(x, g)
    failures = []
    for name, param in toy.named_parameters():
        expected = dense[name]
        if getattr(param, "tensor_model_parallel", False):
            expected = block(expected, param.partition_dim, rank, T)
        err = rel_error(param.main_grad, expected)
        if not err <= TOL:
            failures.append(f"{name}: main_grad rel error {err:.2e}")
    return failures


@pytest.mark.parametrize("groups", ["pg_collection", "mpu"])
def test_replicated_params_fed_sequence_shards_get_the_dense_gradient(groups):
    if groups == "mpu":
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD_SIZE)
    try:
        assert_no_failures(_run(groups))
    finally:
        reset_layout()


def test_negative_control_without_the_tp_sum(monkeypatch):
    monkeypatch.setattr(finalize_module, "_allreduce_sequence_parallel_grads", lambda *a: None)
    failures = _run("pg_collection")
    everyone = [None] * WORLD_SIZE
    dist.all_gather_object(everyone, failures)
    replicated = ("norm.weight", "norm.bias", "scale", "fc2.bias")
    for fails in everyone:
        assert {f.split(":")[0] for f in fails} == set(replicated), everyone


def test_pg_collection_without_tp_is_a_clear_error():
    """Marked parameters at TP > 1 and an explicit collection lacking tp: an error naming
    the missing group, before any collective."""
    group, T, _ = world_group()
    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=T,
        tensor_model_parallel_size=T,
        sequence_parallel=True,
        params_dtype=torch.float64,
    )
    toy = Toy(config, group).to(device())
    mark_replicated_params_sequence_parallel(toy)
    pgc = ProcessGroupCollection(dp_cp=_self_group(), dp=_self_group())
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), toy, pg_collection=pgc)
    with pytest.raises(ValueError, match="pg_collection has no tp group"):
        finalize_model_grads([model], pg_collection=pgc)
