"""The MoE extension points: the token-dispatcher registry equals the accepted
``moe_token_dispatcher_type`` values (checked at import), and ``moe_utils`` stays the front
of megatron-core's names, each defined once in the module of its concept."""

import importlib
import json
from pathlib import Path

import pytest

from megatron.core import config_rules
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import dispatchers, moe_utils
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

pytestmark = pytest.mark.world(1)

FACTS = json.loads((Path(__file__).parents[1] / "data" / "mcore_moe_facts.json").read_text())
MOE = dict(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=2)
MOE.update(moe_ffn_hidden_size=8, add_bias_linear=False)


def test_every_accepted_dispatcher_type_has_one_dispatcher():
    assert tuple(dispatchers.DISPATCHERS) == config_rules.MOE_TOKEN_DISPATCHERS
    for name, dispatcher in dispatchers.DISPATCHERS.items():
        assert issubclass(dispatcher, MoETokenDispatcher)
        TransformerConfig(**MOE, moe_token_dispatcher_type=name)


def test_the_layer_builds_the_registered_dispatcher(monkeypatch):
    """MoELayer looks its dispatcher up in the registry (a new entry needs nothing else)."""

    class Marked(dispatchers.DISPATCHERS["alltoall"]):
        pass

    monkeypatch.setitem(dispatchers.DISPATCHERS, "alltoall", Marked)
    spec = get_gpt_layer_local_spec(num_experts=2).submodules.mlp
    config = TransformerConfig(**MOE, moe_token_dispatcher_type="alltoall")
    layer = MoELayer(config, spec.submodules, layer_number=1)
    assert type(layer.token_dispatcher) is Marked


def test_a_registry_that_differs_from_the_choices_fails_at_import(monkeypatch):
    """Negative control: an accepted value without a dispatcher stops the import, naming the
    option and both lists."""
    monkeypatch.setattr(config_rules, "MOE_TOKEN_DISPATCHERS", ("allgather", "alltoall", "flex"))
    try:
        with pytest.raises(ImportError, match=r"moe_token_dispatcher_type: .*'flex'"):
            importlib.reload(dispatchers)
    finally:
        monkeypatch.undo()
        importlib.reload(dispatchers)
    with pytest.raises(ImportError, match="register each accepted value once"):
        dispatchers.check_registry({"b": 1, "a": 2}, ("a", "b"), "--option")


def test_moe_utils_keeps_megatron_cores_names():
    """Every moe_utils name of megatron-core 0.16.1 recorded in the facts, and every name
    this front lists, resolves there to the one definition in its concept's module."""
    prefix = "megatron.core.transformer.moe.moe_utils."
    recorded = {k[len(prefix) :].split(".")[0] for k in FACTS["signatures"] if k.startswith(prefix)}
    assert recorded and recorded <= set(moe_utils.__all__), recorded - set(moe_utils.__all__)
    for name in moe_utils.__all__:
        value = getattr(moe_utils, name)
        home = importlib.import_module(value.__module__)
        assert home is not moe_utils and getattr(home, name) is value, name
