"""The trainer on a MoE model with expert parallelism and the distributed optimizer (issue 30):
``--ep 2`` over DP 4 with ``--use-distributed-optimizer --log-num-zeros-in-grad`` logs, every
iteration, the gradient norm, the zero count and the router metrics of the one-process run
(``--compare-single-process``; rank 0 runs the one-process model after the 4-rank run).
Negative control: the experts' part of the norm reduced without expert DP (the bug the EP 2 x
DP 4 parity case caught) logs another norm, and the comparison of the norms says so.

The generated data's gradient has no exact zeros here (both runs log 0), so this checks that the
zero count is plumbed through and agrees; the test that discriminates a wrong expert zero count
plants zeros: ``tests/unit_tests/models/test_moe_optimizer_stats.py``.

Launch: ``torchrun --nproc-per-node 4 -m tests.tools.launch_pytest
tests/unit_tests/training/test_trainer_moe_optimizer.py -m slow``.
"""

from typing import List

import pytest
import torch
import torch.distributed as dist

from megatron.core.optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.transformer.moe import moe_utils
from megatron.training.arguments import parse_args
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout, gather_failures

pytestmark = [pytest.mark.slow, pytest.mark.world(4), pytest.mark.timeout(600)]

ARGV = [
    "--ep", "2", "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear",
    "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall",
    "--use-distributed-optimizer", "--log-num-zeros-in-grad",
    "--train-iters", "2", "--compare-single-process", "--no-progress",
]  # fmt: skip
TOLERANCE = 1e-5


def _differences(records: List[dict], reference: List[dict]) -> List[str]:
    failures = []
    if len(records) != len(reference):
        return [f"{len(records)} iterations vs {len(reference)} in the one-process run"]
    for got, want in zip(records, reference):
        it = got["iteration"]
        if abs(got["grad_norm"] - want["grad_norm"]) > TOLERANCE * want["grad_norm"]:
            failures.append(f"iteration {it}: grad norm {got['grad_norm']} vs {want['grad_norm']}")
        if got.get("num_zeros_in_grad") is None or want.get("num_zeros_in_grad") is None:
            failures.append(f"iteration {it}: num_zeros_in_grad not recorded")
        elif got["num_zeros_in_grad"] != want["num_zeros_in_grad"]:
            failures.append(
                f"iteration {it}: num zeros {got['num_zeros_in_grad']} vs "
                f"{want['num_zeros_in_grad']}"
            )
        if got["moe_tokens_per_expert"] != want["moe_tokens_per_expert"]:
            failures.append(f"iteration {it}: per-expert load differs")
    return failures


def _run() -> List[str]:
    """This rank's findings (rank 0 compares with the one-process records). A tracker entry
    of another model (a z-loss this one does not track, summed over the world group) is
    left first, as an earlier test of the launch leaves one: the trainer must drop it (else
    rank 0's one-process run reduced it over the world while the others waited)."""
    moe_utils.save_to_aux_losses_tracker(
        "z_loss", torch.ones(()), 1, 2, reduce_group=dist.group.WORLD
    )
    config = parse_args(ARGV)
    with fresh_layout():
        result = pretrain(config)
    if result.reference is None:  # not rank 0
        return []
    return _differences(result.records, result.reference)


def test_ep2_dp4_distributed_optimizer_logs_the_one_process_norm_and_zero_count():
    assert_no_failures(_run())


def test_negative_control_expert_norm_without_expert_dp():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            DistributedOptimizer,
            "_expert_grad_stats_groups",
            MegatronOptimizer._expert_grad_stats_groups,
        )
        failures = _run()
    everyone = gather_failures(failures)
    assert any("grad norm" in f for f in everyone), "the planted bug went unnoticed"
