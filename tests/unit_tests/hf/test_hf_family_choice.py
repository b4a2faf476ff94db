"""The family a model trained from scratch exports as is decided by a round trip: the first
family whose ``config.json`` reads back as the same model (``read(write(x)) == x``), not by
predicates in each family that know the other families' features.
"""

import pytest

from megatron.training.hf.config import (
    architecture_from_config,
    architecture_from_model_settings,
    hf_config_of_settings,
    model_meaning,
    settings_of_hf_config,
    training_settings,
)
from megatron.training.hf.families import REGISTRY
from tests.unit_tests.hf.hf_models import MOE_TRAINER_SETTINGS

pytestmark = pytest.mark.world(1)

DENSE = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=128,
    seq_length=16, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
    disable_bias_linear=True,
)  # fmt: skip
MOE = dict(DENSE, **MOE_TRAINER_SETTINGS)


def test_no_family_carries_a_claims_predicate():
    """What a family writes is its ``write``; no family tests for another one's features."""
    assert not any(hasattr(family, "claims") for family in REGISTRY.values())


def test_a_windowed_moe_is_written_as_mixtral_whose_config_has_the_window():
    """Mixtral's config.json carries Mistral's sliding_window, which the import reads: a
    --window-size MoE round-trips through it (the per-family predicates refused it)."""
    settings = dict(MOE, window_size=[4, 0])
    arch = architecture_from_model_settings(settings)
    assert (arch.family, arch.window_size) == ("mixtral", (4, 0))
    config = hf_config_of_settings(settings)
    assert config["model_type"] == "mixtral" and config["sliding_window"] == 5  # W + 1 keys
    back = settings_of_hf_config(config)
    assert back["window_size"] == [4, 0] and back["num_experts"] == 4


def test_a_family_that_would_drop_a_feature_is_passed_over(monkeypatch):
    """With Llama asked first, a Qwen3-shaped model (per-head q/k norms) still goes to Qwen3:
    Llama's config.json has no q/k norm, so it does not read back as the same model."""
    order = {"llama": REGISTRY["llama"], "qwen3": REGISTRY["qwen3"]}
    monkeypatch.setattr("megatron.training.hf.config.REGISTRY", order)
    settings = dict(DENSE, qk_layernorm=True)
    assert architecture_from_model_settings(settings).family == "qwen3"
    assert architecture_from_model_settings(DENSE).family == "llama"
    with pytest.raises(ValueError, match="matches no HuggingFace family"):
        architecture_from_model_settings(dict(DENSE, add_qkv_bias=True))  # Qwen2's, absent


@pytest.mark.parametrize("family", sorted(REGISTRY))
def test_every_family_writes_what_it_reads(family):
    """HF config -> settings -> HF config -> settings gives the same model, and the family
    chosen for those settings writes it as that model too."""
    from tests.unit_tests.hf.test_hf_refusals import BASE

    arch = architecture_from_config(BASE[family])
    settings = training_settings(arch)
    again = settings_of_hf_config(REGISTRY[family].write(arch))
    assert model_meaning(again) == model_meaning(settings)
    chosen = settings_of_hf_config(hf_config_of_settings(dict(settings, seq_length=16)))
    assert model_meaning(chosen) == model_meaning(settings)


@pytest.mark.parametrize("family", sorted(REGISTRY))
def test_architecture_and_settings_translate_by_name(family):
    """An HFArchitecture field named as a trainer option is that option (no hand mapping:
    a new model feature is one field); the others go through ``TRANSLATED`` both ways, so
    settings -> architecture -> settings is the identity."""
    import dataclasses

    from megatron.training import TrainingConfig
    from megatron.training.hf.config import TRANSLATED, architecture_from_model_settings
    from tests.unit_tests.hf.test_hf_refusals import BASE

    options = {f.name for f in dataclasses.fields(TrainingConfig)}
    arch = architecture_from_config(BASE[family])
    settings = training_settings(arch)
    for f in dataclasses.fields(arch):
        if (
            f.name in options
            and f.name not in TRANSLATED
            and (arch.num_moe_experts is not None or not f.name.startswith("moe_"))
        ):
            assert settings[f.name] == getattr(arch, f.name), f.name
    again = architecture_from_model_settings(dict(settings, seq_length=16))
    assert training_settings(again) == settings
