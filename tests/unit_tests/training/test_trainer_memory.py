"""The trainer's memory flags (megatron's names): --use-distributed-optimizer,
--overlap-param-gather, --recompute-granularity/-method/-num-layers/-modules. Runs with them
follow the one-process run (``--compare-single-process``, within 1e-5); the flags map to the
config and bad combinations are refused naming both flags."""

from typing import List, Optional

import pytest
import torch.distributed as dist

from megatron.training import TrainingConfig, validate_config
from megatron.training.arguments import parse_args
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout

RUNS = [
    pytest.param(
        dict(
            use_distributed_optimizer=True,
            overlap_param_gather=True,
            overlap_grad_reduce=True,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
        ),
        marks=pytest.mark.world(2),
        id="dp2-distopt-overlap-full-recompute",
    ),
    pytest.param(
        dict(
            context_parallel_size=2,
            use_distributed_optimizer=True,
            recompute_granularity="selective",
            recompute_modules=["core_attn", "mlp", "layernorm"],
        ),
        marks=[pytest.mark.world(4), pytest.mark.slow],
        id="cp2-dp2-distopt-selective-recompute",
    ),
]


@pytest.mark.parametrize("changes", RUNS)
def test_memory_flags_follow_the_one_process_run(changes):
    config = TrainingConfig(
        train_iters=3, compare_single_process=True, compare_tolerance=1e-5, progress=False,
        **changes,
    )  # fmt: skip
    with fresh_layout():
        result = pretrain(config)
    failures = [] if result.passed else ["the comparison with the one-process run failed"]
    losses = [r["loss"] for r in result.records]
    everyone: List[Optional[List[float]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, losses)
    if any(other != everyone[0] for other in everyone):
        failures.append(f"ranks log different losses: {everyone}")
    assert_no_failures(failures)


@pytest.mark.world(1)
def test_memory_flags_map_to_the_config():
    config = parse_args(
        [
            "--use-distributed-optimizer",
            "--overlap-param-gather",
            "--recompute-granularity",
            "selective",
            "--recompute-modules",
            "mlp",
            "layernorm",
        ]
    )
    assert config.use_distributed_optimizer and config.overlap_param_gather
    assert config.recompute_granularity == "selective"
    assert config.recompute_modules == ["mlp", "layernorm"]
    full = parse_args(
        ["--recompute-granularity", "full", "--recompute-method", "block"]
        + ["--recompute-num-layers", "2"]
    )
    assert (full.recompute_method, full.recompute_num_layers) == ("block", 2)
    validate_config(full, 1)


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(overlap_param_gather=True),
            "--overlap-param-gather only supported with distributed optimizer",
        ),
        (dict(recompute_method="uniform"), "--recompute-method='uniform' needs"),
        (
            dict(recompute_granularity="full", recompute_method="block"),
            "--recompute-num-layers=None; with --recompute-granularity='full'",
        ),
        (
            dict(recompute_granularity="selective", recompute_num_layers=2),
            "--recompute-num-layers must be None",
        ),
        (dict(recompute_modules=["mlp"]), "--recompute-modules mlp needs"),
    ],
)
def test_bad_memory_flag_combinations_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        validate_config(TrainingConfig(**changes), 1)
