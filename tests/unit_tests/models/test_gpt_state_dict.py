"""GPTModel built from ``get_gpt_layer_local_spec`` has megatron-core 0.16.1's state dict, name
for name and shape for shape, and its parameters in the same order.

The expected keys and shapes were recorded from the real megatron-core 0.16.1 (one process,
CPU) by ``tests/tools/record_gpt_state_dict_facts.py`` into
``tests/unit_tests/data/mcore_gpt_state_dict.json``; each case is built here with the same
arguments.
"""

import json
from pathlib import Path

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

FACTS = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "mcore_gpt_state_dict.json").read_text()
)


@pytest.mark.world(1)
@pytest.mark.parametrize("case", sorted(FACTS))
def test_state_dict_matches_megatron_core(case):
    """Same tensor keys with the same shapes, same parameter order; megatron-core's extra
    (non-tensor) entries are ours too where our layers keep one."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    facts = FACTS[case]
    config = TransformerConfig(use_cpu_initialization=True, **facts["config"])
    if config.gated_linear_unit:
        config.activation_func = torch.nn.functional.silu
    model = GPTModel(config, get_gpt_layer_local_spec(**facts["spec"]), **facts["model"])
    state = model.state_dict()
    shapes = {k: list(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert shapes == facts["state_dict"]
    assert [name for name, _ in model.named_parameters()] == facts["parameters"]
    extra = sorted(k for k, v in state.items() if not isinstance(v, torch.Tensor))
    assert set(extra) <= set(facts["non_tensor_keys"])


@pytest.mark.world(1)
def test_spec_rejects_what_it_cannot_build():
    """Options of get_gpt_layer_local_spec this core lacks fail with the option's name."""
    with pytest.raises(NotImplementedError, match="fp8='e4m3'"):
        get_gpt_layer_local_spec(num_experts=8, fp8="e4m3")
    with pytest.raises(ValueError, match="normalization.*'L2Norm'"):
        get_gpt_layer_local_spec(normalization="L2Norm")
