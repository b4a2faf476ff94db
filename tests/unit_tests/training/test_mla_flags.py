"""The multi-latent attention and DeepSeek routing flags (megatron's names): what they set in
``MLATransformerConfig``, megatron's ``--moe-layer-freq`` list expression, and the refusals
by name."""

import pytest

from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.training.arguments import explicit_options, parse_args, validate_config
from megatron.training.errors import UsageError
from megatron.training.model import transformer_config_from

pytestmark = pytest.mark.world(1)

MODEL = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--num-layers", "4", "--seq-length", "16"]  # fmt: skip
MLA = ["--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "6",
       "--qk-head-dim", "4", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
       "--rope-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "0.9",
       "--mscale-all-dim", "0.8", "--original-max-position-embeddings", "8",
       "--beta-fast", "8", "--beta-slow", "2", "--qk-layernorm"]  # fmt: skip
ROUTING = ["--num-experts", "8", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "12",
           "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
           "--moe-router-bias-update-rate", "0.01", "--moe-router-num-groups", "4",
           "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor", "2.5",
           "--moe-shared-expert-intermediate-size", "16",
           "--moe-layer-freq", "([0]*1+[1]*3)"]  # fmt: skip


def _checked(*argv: str):
    config = parse_args(list(argv))
    layout = validate_config(config, 1, explicit_options(list(argv)))
    return config, layout


def test_mla_and_deepseek_routing_flags_set_megatron_core_fields():
    config, layout = _checked(*MODEL, *MLA, *ROUTING)
    tc = transformer_config_from(config, layout)
    assert type(tc) is MLATransformerConfig
    expected = dict(
        multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=6, qk_head_dim=4,
        qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="yarn", rotary_scaling_factor=4.0,
        mscale=0.9, mscale_all_dim=0.8, original_max_position_embeddings=8, beta_fast=8.0,
        beta_slow=2.0, qk_layernorm=True, num_moe_experts=8, moe_router_topk=4,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.01, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=16,
        moe_layer_freq=[0, 1, 1, 1],
    )  # fmt: skip
    assert {k: getattr(tc, k) for k in expected} == expected


def test_defaults_are_megatrons_and_no_mla_without_the_switch():
    config, layout = _checked(*MODEL, "--multi-latent-attention")
    tc = transformer_config_from(config, layout)
    assert (tc.q_lora_rank, tc.kv_lora_rank, tc.qk_head_dim, tc.qk_pos_emb_head_dim) == (
        None, 32, 128, 64)  # fmt: skip
    assert (tc.v_head_dim, tc.rope_type, tc.mscale, tc.mscale_all_dim) == (128, "yarn", 1.0, 0.0)
    config, layout = _checked(*MODEL)
    assert type(transformer_config_from(config, layout)) is not MLATransformerConfig


@pytest.mark.parametrize(
    "text, pattern",
    [("([0]*1+[1]*3)", [0, 1, 1, 1]), ("[0,1]*2", [0, 1, 0, 1]), ("'[1]*4'", [1, 1, 1, 1]),
     ("2", 2)],
)  # fmt: skip
def test_moe_layer_freq_takes_megatrons_list_expression(text, pattern):
    config, _ = _checked(*MODEL, "--num-experts", "4", "--moe-layer-freq", text)
    assert config.moe_layer_freq == pattern


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--moe-layer-freq", "__import__('os')"], "--moe-layer-freq.*list expression"),
        (["--moe-layer-freq", "[0]*2"], r"--moe-layer-freq \[0, 0\]: expected"),
        (["--q-lora-rank", "8"], "--q-lora-rank 8 needs --multi-latent-attention"),
        (["--mscale-all-dim", "1"], "--mscale-all-dim 1.0 needs --multi-latent-attention"),
        (["--multi-latent-attention", "--rope-type", "rope", "--mscale", "2"],
         "--mscale 2.0 is a yarn setting, but --rope-type is rope"),
        (["--multi-latent-attention", "--rope-type", "ntk"], "--rope-type"),
        (["--multi-latent-attention", "--qk-pos-emb-head-dim", "3"],
         "--qk-pos-emb-head-dim must be an even integer >= 2, got 3"),
    ],
)  # fmt: skip
def test_bad_mla_and_routing_flags_are_refused_by_name(argv, message):
    with pytest.raises((UsageError, ValueError), match=message):
        _checked(*MODEL, "--num-experts", "4", *argv)


def test_mla_needs_rotary_positions():
    argv = ["--multi-latent-attention", "--num-layers", "2"]
    with pytest.raises(ValueError, match="--multi-latent-attention needs --position-embedding"):
        _checked(*argv)


def test_lora_targets_the_mla_projections_by_name():
    lora = ["--lora-dim", "4", "--lora-target-modules", "linear_q_down_proj", "linear_kv_up_proj"]
    config, _ = _checked(*MODEL, *MLA, *lora)
    assert config.lora_target_modules == ["linear_q_down_proj", "linear_kv_up_proj"]
    with pytest.raises(ValueError, match="'linear_q_down_proj' matches no layer of the model"):
        _checked(*MODEL, *lora)  # no multi-latent attention: no such layer
    with pytest.raises(ValueError, match="'linear_q_up_proj' matches no layer"):
        _checked(
            *MODEL,
            "--multi-latent-attention",
            "--lora-dim",
            "4",
            "--lora-target-modules",
            "linear_q_up_proj",
        )  # fmt: skip  (no q LoRA)


BIAS = ["--num-experts", "4", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--lora-dim", "2", "--lora-target-modules",
        "linear_qkv"]  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--export-hf", "out"], "--export-hf out with --lora-dim writes a PEFT adapter.*"
         "expert bias.*--merge-lora"),
        (["--save", "ckpt", "--save-trainable-params-only"],
         "--save-trainable-params-only keeps the LoRA adapters only, not the expert bias"),
    ],
)  # fmt: skip
def test_lora_that_would_drop_the_trained_expert_bias_is_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        _checked(*MODEL, *BIAS, *argv)
    _checked(*MODEL, *BIAS, "--export-hf", "out", "--merge-lora")  # the bias is merged in
