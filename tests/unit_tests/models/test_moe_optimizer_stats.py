"""Gradient statistics and state sharding of the optimizers with experts (issue 30, SPEC 18):
at an EP layout the gradient norm and the zero count ``optimizer.step()`` reports equal the
one-process values (the float64 reference of ``moe_parity``), with the distributed optimizer
and without; the distributed optimizer shards expert state over the expert-data-parallel
group (each expert parameter's shards tile it exactly over expert DP).

The reference has no exact zeros in its gradient, so the test plants them: before the step,
every rank zeroes the whole ``main_grad`` of a few parameters (two experts held by different
EP ranks, one dense matrix) wherever it holds them. The one-process values are then
``#zeros = numel of the planted parameters`` and ``||g||^2 = sum of the other parameters'
||g_ref||^2`` (fp32 against float64: relative 1e-5 for the norm, the count exactly).

Negative controls (each planted bug must fail the comparison): the expert part reduced
without expert DP (the plain optimizer's groups: the EP 2 x DP 4 bug, a rank-dependent norm),
the expert part of the plain optimizer reduced over its dense group (tp x pp), a zero count
that leaves the experts out (the code before the fix) and one that counts them as dense
parameters (summed over tp x pp by the plain optimizer).

The inf/nan check of the mixed-precision optimizer (bf16 with a loss scale, plain optimizer):
an inf in one expert's gradient, held by one EP rank, makes every rank skip the step (the
check's max runs over the expert groups too); negative control: over the dense groups only.

Launch: ``torchrun --nproc-per-node 4 -m tests.tools.launch_pytest
tests/unit_tests/models/test_moe_optimizer_stats.py -m slow``.
"""

import math
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from megatron.core.optimizer import DistributedOptimizer
from megatron.core.optimizer.clip_grads import count_zeros
from megatron.core.optimizer.optimizer import MegatronOptimizer
from tests.unit_tests.dist_utils import assert_no_failures, gather_failures
from tests.unit_tests.models.moe_parity import (
    MoECase,
    Run,
    build_model,
    expert_aware_names,
    reference,
    run_step,
    use_moe_layout,
)

pytestmark = [pytest.mark.slow, pytest.mark.world(4), pytest.mark.timeout(300)]

C = MoECase
# EP 2 x DP 4 (expert DP 2); EP 2 with ETP 1 != TP 2 (expert DP 2, experts replicated over TP)
DISTOPT = C(ep=2, etp=1, dp=4, mask="full", losses="aux", router="grouped", distopt=True)
DISTOPT_TP = C(ep=2, etp=1, tp=2, dp=2, mb=2, mask="full", losses="aux", router="grouped")
PLAIN = DISTOPT.with_(distopt=False)  # tp x pp is one rank: experts need the EP group
CASES = [DISTOPT, DISTOPT_TP.with_(distopt=True), PLAIN, DISTOPT_TP]

# planted zeros: expert 3 of layer 1 (EP rank 1), expert 0 of layer 2 (EP rank 0), a dense matrix
PLANTED = (
    "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
    "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight",
    "decoder.layers.2.mlp.experts.local_experts.0.linear_fc2.weight",
    "decoder.layers.0.self_attention.linear_proj.weight",
)
TOLERANCE = 1e-5


def expected_stats(case: MoECase) -> Tuple[float, int]:
    """The one-process (float64 reference) norm and zero count with ``PLANTED`` zeroed."""
    grads = reference(case.model_key()).grads
    norm2 = sum(float((g * g).sum()) for n, g in grads.items() if n not in PLANTED)
    zeros = sum(int((g == 0).sum()) for n, g in grads.items() if n not in PLANTED)
    return math.sqrt(norm2), zeros + sum(grads[n].numel() for n in PLANTED)


def step_with_planted_zeros(case: MoECase) -> Tuple[Run, object]:
    """One step of the case with the zero count logged and ``PLANTED`` zeroed first."""
    reference(case.model_key())  # one-process model first
    groups = use_moe_layout(case)
    model = build_model(case, groups)
    optimizer = model.optimizer
    optimizer.config.log_num_zeros_in_grad = True
    _before_prepare(model, groups, PLANTED, torch.Tensor.zero_)
    return run_step(case, groups, model=model), (model, groups)


def _before_prepare(model, groups, names, change) -> List[str]:
    """Make the optimizer's ``prepare_grads`` first apply ``change`` to the gradient of each
    parameter in ``names`` this rank holds; returns the list of those changed (filled at
    the step)."""
    prepare, changed = model.optimizer.prepare_grads, []

    def changed_then_prepare() -> bool:
        for gpt in model.gpts:
            for name, _, _, grad in expert_aware_names(gpt, groups):
                if name in names and grad is not None:
                    change(grad)
                    changed.append(name)
        return prepare()

    model.optimizer.prepare_grads = changed_then_prepare
    return changed


def stats_failures(case: MoECase, run: Run) -> List[str]:
    norm, zeros = expected_stats(case)
    failures = []
    if not abs(run.grad_norm - norm) <= TOLERANCE * norm:
        failures.append(f"grad norm {run.grad_norm!r} != one-process {norm!r}")
    if run.num_zeros != zeros:
        failures.append(f"zero count {run.num_zeros!r} != one-process {zeros}")
    return failures


def expert_shard_failures(model, groups) -> List[str]:
    """Every expert parameter's distributed-optimizer shards tile it exactly over expert DP
    (and the dense ones over dp x cp): each element's state is on one rank of that group."""
    inner = model.optimizer.chained_optimizers[0]
    assert isinstance(inner, DistributedOptimizer)
    failures = []
    for label, group, expert in (
        ("expert DP", groups.expt_dp, True),
        ("dp x cp", groups.dp_cp, False),
    ):
        mine: Dict[str, Tuple[int, int, int]] = {}
        for gpt in model.gpts:
            names = {p: n for n, p in gpt.named_parameters()}
            for shard in inner.shards:
                if shard.param in names and getattr(shard.param, "allreduce", True) != expert:
                    mine[names[shard.param]] = (shard.start, shard.end, shard.param.numel())
        everyone: List[Dict[str, Tuple[int, int, int]]] = [{}] * group.size()
        dist.all_gather_object(everyone, mine, group=group)
        names_here = {
            n for gpt in model.gpts for n, p in gpt.named_parameters()
            if getattr(p, "allreduce", True) != expert
        }  # fmt: skip
        for name in sorted(names_here):
            ranges = sorted((r[name][0], r[name][1]) for r in everyone if name in r)
            numel = next((r[name][2] for r in everyone if name in r), None)
            tiles = (  # from 0, each range starting where the last ended, up to numel
                bool(ranges)
                and ranges[0][0] == 0
                and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
                and ranges[-1][1] == numel
            )
            if numel is None or not tiles:
                failures.append(f"{name}: shards over {label} {ranges} do not tile {numel}")
    return failures


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_grad_norm_and_zero_count_equal_one_process(case: MoECase):
    run, (model, groups) = step_with_planted_zeros(case)
    failures = stats_failures(case, run)
    if case.distopt:
        failures += expert_shard_failures(model, groups)
    assert_no_failures(failures)


# ----------------------------------------------------------------------------- negative controls


def _caught(case: MoECase, patch_fn, expect: str) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch_fn(patch)
        run, _ = step_with_planted_zeros(case)
    failures = gather_failures(stats_failures(case, run))
    assert any(expect in f for f in failures), f"{case.id}: the planted bug went unnoticed"


def test_negative_control_expert_norm_without_expert_dp():
    """The distributed optimizer reducing the experts' part like the plain one (expert
    tp x ep x pp only): the open bug of the EP 2 x DP 4 parity case."""
    _caught(
        DISTOPT,
        lambda p: p.setattr(
            DistributedOptimizer,
            "_expert_grad_stats_groups",
            MegatronOptimizer._expert_grad_stats_groups,
        ),
        "grad norm",
    )


def test_negative_control_expert_norm_over_dense_groups():
    """The experts' part summed over the plain optimizer's dense group (tp x pp): the other
    EP rank's experts are missed. (With the distributed optimizer, dp x cp then tp x pp is
    the whole world, as expert DP then expert tp x ep x pp is: the same sum.)"""
    _caught(
        PLAIN,
        lambda p: p.setattr(
            MegatronOptimizer,
            "_expert_grad_stats_groups",
            lambda self: self._grad_stats_groups(),
        ),
        "grad norm",
    )


def _zeros_without_experts(self) -> float:
    return count_zeros(
        self.get_main_grads_for_grad_norm(), self._reduce_grad_stats, self._grad_stats_device()
    )


def _zeros_experts_as_dense(self) -> float:
    grads = self.get_main_grads_for_grad_norm() + self.get_expert_main_grads_for_grad_norm()
    return count_zeros(grads, self._reduce_grad_stats, self._grad_stats_device())


def test_negative_control_zero_count_without_experts():
    """The zero count before the fix: the experts' zeros left out."""
    _caught(
        DISTOPT,
        lambda p: p.setattr(MegatronOptimizer, "count_zeros", _zeros_without_experts),
        "zero count",
    )


def test_negative_control_zero_count_experts_as_dense():
    """Experts counted as dense parameters (summed over tp x pp by the plain optimizer: the
    other EP rank's experts missed)."""
    _caught(
        PLAIN,
        lambda p: p.setattr(MegatronOptimizer, "count_zeros", _zeros_experts_as_dense),
        "zero count",
    )


# ----------------------------------------------------------------------------- inf / nan


def _skipped_on_every_rank(case: MoECase) -> List[str]:
    """bf16 with a loss scale (the mixed-precision optimizer checks for inf/nan): an inf
    planted in one expert's ``main_grad`` (held by EP rank 1 only) must make EVERY rank skip
    the step, else the ranks' models part ways."""
    reference(case.model_key())
    groups = use_moe_layout(case)

    def bf16(config) -> None:
        config.bf16, config.params_dtype = True, torch.bfloat16

    model = build_model(
        case, groups, configure=bf16, optimizer_overrides={"bf16": True, "loss_scale": 1.0}
    )
    optimizer = model.optimizer
    step, results = optimizer.step, []
    planted = _before_prepare(
        model, groups, PLANTED[:1], lambda grad: grad.view(-1).__setitem__(0, float("inf"))
    )

    def recording_step():
        results.append(step())
        return True, 0.0, None  # run_step asserts success; the real answer is kept

    optimizer.step = recording_step
    run_step(case, groups, model=model)
    updated = bool(results[0][0])
    everyone: List[Tuple[bool, bool]] = [(False, False)] * dist.get_world_size()
    dist.all_gather_object(everyone, (updated, bool(planted)))
    assert any(p for _, p in everyone), f"no rank holds {PLANTED[0]}: nothing was planted"
    assert all(not u for u, p in everyone if p), "a rank holding the inf stepped"
    return [f"rank {r} stepped despite the inf" for r, (u, _) in enumerate(everyone) if u]


def test_an_inf_in_one_expert_skips_the_step_on_every_rank():
    assert not _skipped_on_every_rank(PLAIN)


def test_negative_control_inf_check_without_the_expert_groups():
    """The inf check over the dense groups only (tp x pp: one rank here): the EP rank without
    the inf steps."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MegatronOptimizer, "_reduce_expert_grad_stats", lambda self, t, op=None: t)
        failures = _skipped_on_every_rank(PLAIN)
    assert failures, "an inf on one EP rank went unnoticed on the others"
