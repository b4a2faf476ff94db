"""megatron-core 0.16.1's FP8 / low-precision config fields (recorded by
``tests/tools/record_fp8_facts.py`` into ``data/mcore_fp8_facts.json``): each exists with
megatron-core's default, the defaults are accepted (``TransformerConfig(fp8=None)`` works), the
implemented settings are accepted, and every other value is refused naming the field."""

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from megatron.core.enums import Fp4Recipe, Fp8Recipe
from megatron.core.transformer import TransformerConfig

FACTS = json.loads((Path(__file__).parents[1] / "data" / "mcore_fp8_facts.json").read_text())

pytestmark = pytest.mark.world(1)

BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=2)

# (field, value) with fp8="hybrid", fp8_recipe="tensorwise": each must raise naming the field
REFUSED = [
    ("fp8", "e5m2"),
    ("fp8_recipe", "delayed"),
    ("fp8_recipe", "mxfp8"),
    ("fp8_recipe", "blockwise"),
    ("fp8_recipe", "custom"),
    ("fp8_recipe", "rowwise"),
    ("fp8_param", True),
    ("fp8_quantizer_factory", "pkg.factory"),
    ("fp8_margin", -1),
    ("fp8_interval", 2),
    ("fp8_amax_history_len", 16),
    ("fp8_amax_compute_algo", "max"),
    ("fp8_amax_compute_algo", "mean"),
    ("fp8_wgrad", "yes"),
    ("fp8_dot_product_attention", True),
    ("fp8_multi_head_attention", True),
    ("tp_only_amax_red", True),
    ("first_last_layers_bf16", True),
    ("num_layers_at_start_in_bf16", 2),
    ("num_layers_at_end_in_bf16", 0),
    ("activation_func_fp8_input_store", True),
    ("fp4", "e2m1"),
    ("fp4_recipe", "mxfp4"),
    ("fp4_recipe", "custom"),
    ("fp4_param", True),
    ("fp4_quantizer_factory", "pkg.factory"),
    ("use_kitchen", True),
    ("use_kitchen_attention", True),
    ("kitchen_attention_backend", "fa"),
]


def _config(**changes) -> TransformerConfig:
    return TransformerConfig(**{**BASE, **changes})


def test_facts_are_from_megatron_core_0_16_1():
    assert FACTS["meta"]["megatron_core_version"] == "0.16.1"
    assert "fp8" in FACTS["config_fields"] and "fp8_wgrad" in FACTS["config_fields"]


@pytest.mark.parametrize("name", sorted(FACTS["config_fields"]))
def test_field_and_default_equal_megatron_core(name):
    fact = FACTS["config_fields"][name]
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    assert name in fields, f"TransformerConfig has no field {name} (megatron-core 0.16.1 has)"
    expected = ast.literal_eval(fact["value"])
    got = fields[name].default
    assert got == expected and type(got) is type(expected), f"{name}: {got!r} != {expected!r}"


def test_the_defaults_are_accepted():
    config = _config(fp8=None)
    assert config.fp8 is None and config.fp8_recipe == "delayed" and config.fp8_wgrad


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", ["tensorwise", Fp8Recipe.tensorwise])
def test_tensorwise_formats_margin_and_wgrad_are_accepted(fmt, recipe):
    config = _config(fp8=fmt, fp8_recipe=recipe, fp8_margin=1, fp8_wgrad=False)
    assert config.fp8 == fmt and config.fp8_recipe == "tensorwise"


def test_recipe_names_are_accepted_without_fp8():
    for recipe in Fp8Recipe:
        assert _config(fp8_recipe=recipe.value).fp8 is None
    assert _config(fp4_recipe=Fp4Recipe.nvfp4.value).fp4 is None


@pytest.mark.parametrize("field, value", REFUSED, ids=[f"{f}={v}" for f, v in REFUSED])
def test_refused_setting_raises_naming_field_and_value(field, value):
    with pytest.raises((NotImplementedError, ValueError)) as info:
        _config(**{"fp8": "hybrid", "fp8_recipe": "tensorwise", field: value})
    assert f"{field}={value!r}" in str(info.value), info.value


def test_fp8_param_without_fp8_names_both():
    with pytest.raises(ValueError, match="fp8_param=True .*fp8 is None"):
        _config(fp8_param=True)


def test_default_recipe_with_fp8_says_how_to_get_tensorwise():
    with pytest.raises(NotImplementedError, match="fp8_recipe='delayed'.*--fp8-recipe tensorwise"):
        _config(fp8="hybrid")


MOE = dict(num_moe_experts=4, moe_ffn_hidden_size=8, add_bias_linear=False)


def test_fp8_experts_spread_over_data_parallel_replicas_are_refused():
    fp8 = dict(fp8="hybrid", fp8_recipe="tensorwise")
    with pytest.raises(NotImplementedError, match="expert_model_parallel_size=2 x"):
        _config(**MOE, **fp8, expert_model_parallel_size=2)
    # inside the ranks of one micro-batch (EP over TP x SP): accepted
    _config(**MOE, **fp8, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
            tensor_model_parallel_size=2, sequence_parallel=True)  # fmt: skip
    _config(**MOE, expert_model_parallel_size=2)  # without FP8: accepted
