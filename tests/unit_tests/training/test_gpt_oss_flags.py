"""The GPT-OSS trainer flags (megatron's names) refused by name where they do not fit, before
any worker starts, and the library fields they set."""

import re

import pytest

from megatron.training.arguments import TrainingConfig
from megatron.training.model import transformer_config_from
from megatron.training.validation import validate_config

pytestmark = pytest.mark.world(1)

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
YARN = dict(
    position_embedding_type="yarn", rotary_scaling_factor=32.0,
    yarn_original_max_position_embeddings=4096, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
)  # fmt: skip


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(quick_geglu=True, swiglu=True), "--quick-geglu is its own gated activation"),
        (dict(glu_linear_offset=1.0), "--glu-linear-offset 1.0 shapes the gated MLP"),
        (dict(activation_func_clamp_value=7.0), "--activation-func-clamp-value 7.0 shapes"),
        (dict(window_attn_skip_freq=2), "--window-attn-skip-freq 2 needs --window-size"),
        (
            dict(window_size=[4, 0], window_attn_skip_freq=[1, 0, 1]),
            "a list of --num-layers (2) values",
        ),
        ({**YARN, "yarn_beta_fast": None}, "yarn needs --yarn-beta-fast"),
        (dict(yarn_beta_slow=1.0), "--yarn-beta-slow is a YaRN setting"),
        (
            dict(window_size=[4, 0], window_attn_skip_freq=2, context_parallel_size=2),
            "--window-size 4 0 at --cp 2: layer 1 has a sliding window and --cp-comm-type "
            "all_gather",
        ),
    ],
)
def test_a_misplaced_gpt_oss_flag_is_refused_by_name(flags, message):
    world = flags.get("tensor_model_parallel_size", 1) * flags.get("context_parallel_size", 1)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_config(TrainingConfig(**BASE, **flags), world)


def test_the_gpt_oss_flags_set_megatron_cores_fields():
    config = TrainingConfig(
        **BASE, **YARN, quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
        softmax_type="learnable", window_size=[4, 0], window_attn_skip_freq=2, compile=True,
        no_yarn_correction_range_round_to_int=True,
    )  # fmt: skip
    built = transformer_config_from(config, validate_config(config, 1))
    assert built.gated_linear_unit and built.activation_func.__name__ == "quick_gelu"
    assert (built.glu_linear_offset, built.activation_func_clamp_value) == (1.0, 7.0)
    assert (built.softmax_type, built.window_attn_skip_freq) == ("learnable", 2)
    assert built.yarn_rotary_scaling_factor == 32.0
    assert not built.yarn_correction_range_round_to_int
    assert not built.bias_activation_fusion  # --compile does not fuse the clamped unit


def test_windowed_layers_at_cp2_take_a2a_and_the_full_layers_anything():
    config = TrainingConfig(
        **BASE, window_size=[4, 0], window_attn_skip_freq=2, context_parallel_size=2,
        cp_comm_type=["a2a", "all_gather"],
    )  # fmt: skip
    validate_config(config, 2)


MLA = dict(multi_latent_attention=True, position_embedding_type="rope", rope_type="yarn")


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(quick_geglu=True, geglu=True), "--quick-geglu is its own gated activation"),
        (dict(rotary_scaling_factor=4.0), "--rotary-scaling-factor is a YaRN setting"),
        (
            {**YARN, "rotary_percent": 0.5},
            "--use-rope-scaling and --rotary-percent need --position-embedding-type rope",
        ),
        (
            dict(window_size=[4, 0], window_attn_skip_freq=[1, 2]),
            "--window-attn-skip-freq [1, 2]; expected None, an int >= 1 or a list",
        ),
    ],
)
def test_the_gpt_oss_flags_beside_gemmas_and_mlas_are_refused_by_name(flags, message):
    """Flags both GPT-OSS and Gemma / multi-latent attention read: --quick-geglu is a third
    gated activation, --rotary-scaling-factor serves yarn positions or MLA's yarn only, yarn
    rotates whole heads, the window pattern is one rule."""
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_config(TrainingConfig(**BASE, **flags), 1)


def test_one_rotary_scaling_factor_serves_yarn_positions_and_multi_latent_attention():
    """--rotary-scaling-factor sets yarn_rotary_scaling_factor with --position-embedding-type
    yarn and MLA's rotary_scaling_factor (default 1) with --multi-latent-attention."""
    yarn = TrainingConfig(**BASE, **YARN)
    assert transformer_config_from(yarn, validate_config(yarn, 1)).yarn_rotary_scaling_factor == 32
    for factor, expected in ((None, 1.0), (4.0, 4.0)):
        mla = TrainingConfig(**BASE, **MLA, rotary_scaling_factor=factor)
        built = transformer_config_from(mla, validate_config(mla, 1))
        assert (built.rotary_scaling_factor, built.yarn_rotary_scaling_factor) == (expected, None)
