"""The CP attention registry: one entry per cp_comm_type, the config's names, the backend rule."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import communication
from megatron.core.config_rules import CP_COMM_TYPES
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.cp_attention.registry import STRATEGIES
from megatron.core.transformer.cp_attention.strategy import Strategy


@pytest.mark.world(1)
def test_registry_holds_exactly_the_configurable_comm_types():
    """Every name TransformerConfig accepts has one strategy, and nothing else is accepted."""
    assert tuple(STRATEGIES) == CP_COMM_TYPES
    for name, strategy in STRATEGIES.items():
        assert isinstance(strategy, Strategy) and strategy.name == name
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, cp_comm_type=name)
    with pytest.raises(ValueError, match="cp_comm_type entries must be one of"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, cp_comm_type="ring")


@pytest.mark.world(1)
def test_a_registry_that_differs_from_the_comm_types_fails_at_import(monkeypatch):
    """Negative control: an accepted cp_comm_type without a strategy stops the import with an
    ImportError naming the option (the registry check the MoE dispatchers use, not an assert
    that ``python -O`` drops), and a name registered twice is refused."""
    import importlib

    from megatron.core import config_rules
    from megatron.core.transformer.cp_attention import registry, ring
    from megatron.core.transformer.registry import by_name

    monkeypatch.setattr(config_rules, "CP_COMM_TYPES", CP_COMM_TYPES + ("flex",))
    try:
        with pytest.raises(ImportError, match=r"cp_comm_type: .*'flex'"):
            importlib.reload(registry)
    finally:
        monkeypatch.undo()
        importlib.reload(registry)
    with pytest.raises(ValueError, match="name 'p2p' is registered twice"):
        by_name((ring.STRATEGY, ring.STRATEGY), "name")


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "backend, cuda, expected",
    [
        ("nccl", True, True),
        ("undefined", True, True),
        ("undefined", False, False),
        ("gloo", True, False),
    ],
)
def test_collectives_ask_the_device_module(backend, cuda, expected, monkeypatch):
    """The lazy "undefined" backend (init_process_group() without a backend) creates nccl for
    CUDA tensors, so with CUDA it takes the single-tensor collectives, as device.py says; the
    old name match ("nccl" in the backend name) sent it down the gloo path."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert communication.is_nccl(None) is expected  # the CP attention's collectives ask it
