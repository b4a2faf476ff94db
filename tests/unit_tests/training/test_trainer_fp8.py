"""The trainer's FP8 flags (docs/fp8.md): megatron's names mapped to the TransformerConfig,
refused up front by flag where they would be ignored or ask for what is not implemented, an
FP8 run that learns close to the fp32 run without equalling it, and
``--compare-single-process`` passing for an FP8 run at CP = 2, PP = 2."""

import pytest

from megatron.training import TrainingConfig, validate_config
from megatron.training.arguments import parse_args
from megatron.training.errors import UsageError
from megatron.training.model import transformer_config_from
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout

FP8 = dict(fp8_format="hybrid", fp8_recipe="tensorwise")


@pytest.mark.world(1)
def test_flags_map_to_the_transformer_config():
    config = parse_args(
        "--fp8-format e4m3 --fp8-recipe tensorwise --fp8-margin 2 --no-fp8-wgrad".split()
    )
    layout = validate_config(config, 1)
    tc = transformer_config_from(config, layout)
    assert (tc.fp8, tc.fp8_recipe, tc.fp8_margin, tc.fp8_wgrad) == ("e4m3", "tensorwise", 2, False)
    assert transformer_config_from(TrainingConfig(), layout).fp8 is None


REFUSED = [
    (dict(fp8_margin=1), 1, "--fp8-margin needs --fp8-format"),
    (dict(fp8_wgrad=False), 1, "--no-fp8-wgrad needs --fp8-format"),
    (dict(fp8_format="hybrid"), 1, "--fp8-recipe delayed.*add --fp8-recipe tensorwise"),
    (dict(**FP8, fp8_amax_history_len=4), 1, "--fp8-amax-history-len 4 is read by the delayed"),
    (dict(**FP8, fp8_amax_compute_algo="max"), 1, "--fp8-amax-compute-algo max"),
    (
        dict(**FP8, num_experts=4, disable_bias_linear=True, expert_model_parallel_size=2),
        2,
        "--expert-model-parallel-size 2 x --expert-tensor-parallel-size 1 must divide --tp 1",
    ),
]


@pytest.mark.world(1)
@pytest.mark.parametrize("changes, world, message", REFUSED, ids=[m for _, _, m in REFUSED])
def test_bad_fp8_flags_are_refused_naming_the_flag(changes, world, message):
    with pytest.raises(UsageError, match=message):
        validate_config(TrainingConfig(**changes), world)


@pytest.mark.world(1)
def test_an_fp8_moe_run_warns_that_its_experts_are_slow(capsys):
    moe = dict(num_experts=4, disable_bias_linear=True, moe_grouped_gemm=True)
    for flags in (moe, dict(FP8, **moe), FP8):
        pretrain(TrainingConfig(train_iters=1, progress=False, **flags))
        warned = capsys.readouterr().out.count("warning: --fp8-format with --num-experts")
        assert warned == (flags == dict(FP8, **moe)), flags


@pytest.mark.slow  # two trainer runs (~1 s together)
@pytest.mark.world(1)
def test_an_fp8_run_learns_close_to_fp32_but_not_equal():
    runs = [pretrain(TrainingConfig(train_iters=3, progress=False, **c)) for c in ({}, FP8)]
    fp32, fp8 = ([r["loss"] for r in run.records] for run in runs)
    assert fp8[-1] < fp8[0], fp8
    assert fp8 != fp32 and fp8 == pytest.approx(fp32, rel=0.05), (fp8, fp32)


@pytest.mark.slow  # ~36 s on 2 busy cores (three trainings); measured max |difference| 1.3e-7
@pytest.mark.world(4)
def test_compare_single_process_passes_for_fp8_at_cp2_pp2():
    config = TrainingConfig(
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        train_iters=3,
        compare_single_process=True,
        progress=False,
        **FP8,
    )
    with fresh_layout():
        result = pretrain(config)
    assert_no_failures([] if result.passed else ["the comparison with one process failed"])
