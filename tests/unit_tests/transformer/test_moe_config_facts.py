"""The mixture-of-experts config: megatron-core 0.16.1's field names and defaults (recorded by
``tests/tools/record_moe_facts.py`` into ``data/mcore_moe_facts.json``), and every setting
this core does not implement, or whose result would depend on the layout, refused by name
when the ``TransformerConfig`` is built (before any collective)."""

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megatron.core.transformer import TransformerConfig

# The MoE package (issue 30) lands separately; until it is on the tree these tests are skipped
# with this reason (importorskip on a present module is a no-op).
_MOE = "megatron.core.transformer.moe.moe_layer"
pytest.importorskip(_MOE, reason="megatron.core.transformer.moe is not on this tree yet")

FACTS = json.loads((Path(__file__).parents[1] / "data" / "mcore_moe_facts.json").read_text())

pytestmark = pytest.mark.world(1)

BASE = dict(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=2,
    ffn_hidden_size=32,
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=8,
    add_bias_linear=False,
)

# (field, value): each must raise naming the field, whatever else is set.
REFUSED = [
    ("moe_expert_capacity_factor", 1.0),
    ("moe_pad_expert_input_to_capacity", True),
    ("moe_token_drop_policy", "position"),
    ("moe_token_dropping", True),
    ("moe_router_load_balancing_type", "global_aux_loss"),
    ("moe_router_load_balancing_type", "sinkhorn"),
    ("moe_router_topk_limited_devices", 2),
    ("moe_input_jitter_eps", 0.01),
    ("moe_router_force_load_balancing", True),
    ("moe_token_dispatcher_type", "flex"),
    ("moe_enable_deepep", True),
    ("moe_permute_fusion", True),
    ("moe_router_fusion", True),
    ("moe_router_padding_for_fp8", True),
    ("moe_extended_tp", True),
    ("overlap_moe_expert_parallel_comm", True),
    ("moe_enable_routing_replay", True),
]


def _config(**changes) -> TransformerConfig:
    return TransformerConfig(**{**BASE, **changes})


def test_facts_are_from_megatron_core_0_16_1():
    assert FACTS["meta"]["megatron_core_version"] == "0.16.1"


@pytest.mark.parametrize("name", sorted(FACTS["config_fields"]))
def test_moe_field_and_default_equal_megatron_core(name):
    fact = FACTS["config_fields"][name]
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    assert name in fields, f"TransformerConfig has no field {name} (megatron-core 0.16.1 has)"
    field = fields[name]
    assert fact["type"] not in ("factory", "required"), fact  # all MoE fields have defaults
    assert field.default is not dataclasses.MISSING, f"{name}: no plain default"
    expected = fact["value"] if fact["type"] == "dtype" else ast.literal_eval(fact["value"])
    got = str(field.default) if isinstance(field.default, torch.dtype) else field.default
    assert got == expected and type(got) is type(expected), f"{name}: {got!r} != {expected!r}"


def test_the_default_moe_config_is_accepted():
    config = _config()
    assert config.num_moe_experts == 4 and config.moe_token_dispatcher_type == "allgather"


@pytest.mark.parametrize(
    "field, value", REFUSED, ids=[f"{f}={v}" for f, v in REFUSED]  # spec-like ids
)
def test_refused_setting_raises_naming_the_field(field, value):
    with pytest.raises((NotImplementedError, ValueError)) as info:
        _config(**{field: value})
    assert field in str(info.value), f"the error does not name {field}: {info.value}"


def test_tensor_parallel_without_sequence_parallel_is_refused():
    with pytest.raises(NotImplementedError, match="sequence_parallel"):
        _config(tensor_model_parallel_size=2, sequence_parallel=False)
    _config(tensor_model_parallel_size=2, sequence_parallel=True)  # accepted with SP
