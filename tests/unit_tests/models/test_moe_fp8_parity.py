"""FP8 experts (``fp8="hybrid"``, tensorwise; ``SequentialMLP`` and ``GroupedMLP``): one step
of the MoE parity model under expert parallelism equals the one-process FP8 step (every
``main_grad``, experts by global index), because each expert's scales come from its global
amax (a [tensors, experts] MAX over the ranks of one micro-batch). Tolerance as in
``test_gpt_fp8_parity.py`` (1e-4: another summation order can flip a rare element at an FP8
rounding edge). Negative control: per-shard amaxes leave it by far. Expert layouts across
data-parallel replicas are refused by name (``test_fp8_config.py``)."""

import dataclasses
import functools
from typing import Dict

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fp8.grouped import Fp8Experts
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.dist_utils import assert_no_failures, rel_error
from tests.unit_tests.models.moe_parity import (
    MoECase,
    build_model,
    expected_shard,
    run_step,
    use_moe_layout,
)

TOLERANCE, CONTROL_MIN = 1e-4, 1e-3


def _fp8(config) -> None:
    config.fp8, config.fp8_recipe = "hybrid", "tensorwise"


def _p(case: MoECase, slow: bool = False):
    marks = [pytest.mark.world(case.world)] + ([pytest.mark.slow] if slow else [])
    return pytest.param(case, marks=marks, id=case.id)


C = MoECase
CASES = [
    _p(C(ep=2, etp=1, tp=2, mask="uneven", mode="per-token", grouped=True)),
    _p(C(ep=1, etp=1, cp=2, mask="uneven", grouped=True)),
    _p(C(ep=2, etp=1, cp=2, mask="uneven", shared=True)),
    _p(C(ep=2, etp=1, tp=2, cp=2, mask="uneven", losses="all", router="sigmoid-bias"), slow=True),
    _p(C(ep=2, etp=2, tp=2, cp=2, mask="single", grouped=True, dispatcher="allgather"), slow=True),
]


@functools.lru_cache(maxsize=None)
def _own_groups() -> ProcessGroupCollection:
    """Every group of one rank (every rank creates every group)."""
    mine = None
    for rank in range(dist.get_world_size()):
        group = dist.new_group([rank])
        mine = group if rank == dist.get_rank() else mine
    names = [f.name for f in dataclasses.fields(ProcessGroupCollection) if f.name != "hcp"]
    return ProcessGroupCollection(**{name: mine for name in names})


@functools.lru_cache(maxsize=None)
def one_process_grads(key: MoECase) -> Dict[str, torch.Tensor]:
    """The one-process FP8 step's main_grads (full tensors, experts by global index)."""
    parallel_state.destroy_model_parallel()
    run = run_step(key, _own_groups(), configure=_fp8)
    return run.grads


def _failures(case: MoECase):
    key = dataclasses.replace(case.model_key(), grouped=case.grouped)
    expected = one_process_grads(key)
    groups = use_moe_layout(case)
    run = run_step(case, groups, configure=_fp8)
    errors = {}
    for name, grad in run.grads.items():
        kind, param = run.layouts[name]
        errors[name] = rel_error(
            grad, expected_shard(expected[name], name, kind, param, groups, case)
        )
    return errors


@pytest.mark.parametrize("case", CASES)
def test_fp8_expert_grads_equal_the_one_process_fp8_run(case: MoECase):
    errors = _failures(case)
    assert_no_failures([f"{n}: {e:.3e} > {TOLERANCE}" for n, e in errors.items() if e > TOLERANCE])


@pytest.mark.world(2)
def test_negative_control_per_shard_expert_amax_is_far_off(monkeypatch):
    """EP = 1 over CP = 2: each rank's experts see its sequence shard's tokens only; without
    the experts' MAX reduction (the dense layers keep theirs) the expert gradients move."""
    case = C(ep=1, etp=1, cp=2, mask="uneven", grouped=True)
    one_process_grads(dataclasses.replace(case.model_key(), grouped=True))
    monkeypatch.setattr(Fp8Experts, "global_amax", lambda self, amax: amax)
    errors = _failures(case)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, max(e for n, e in errors.items() if "expert" in n))
    assert max(everyone) > CONTROL_MIN, everyone


@functools.lru_cache(maxsize=None)
def one_process_second_step(key: MoECase) -> Dict[str, torch.Tensor]:
    parallel_state.destroy_model_parallel()
    return _two_steps(key, _own_groups()).grads


def _two_steps(case: MoECase, groups):
    model = build_model(case, groups, configure=_fp8)
    run_step(case, groups, model=model)
    return run_step(case, groups, model=model)


@pytest.mark.world(2)
def test_dp2_distributed_optimizer_second_step_equals_one_process():
    """DP = 2 with the distributed optimizer: the second step's FP8 casts read weights
    all-gathered from the optimizer's shards; its gradients equal the one-process run's."""
    case = C(dp=2, distopt=True, mask="uneven", grouped=True)
    expected = one_process_second_step(dataclasses.replace(case.model_key(), grouped=True))
    groups = use_moe_layout(case)
    run = _two_steps(case, groups)
    failures = []
    for name, grad in run.grads.items():
        kind, param = run.layouts[name]
        error = rel_error(grad, expected_shard(expected[name], name, kind, param, groups, case))
        if error > TOLERANCE:
            failures.append(f"{name}: {error:.3e} > {TOLERANCE}")
    assert_no_failures(failures)


@pytest.mark.world(2)
def test_fp8_is_applied_to_the_experts():
    key = dataclasses.replace(C(mask="uneven").model_key(), grouped=True)
    fp8 = one_process_grads(key)
    parallel_state.destroy_model_parallel()
    high = run_step(key, _own_groups()).grads
    experts = [rel_error(fp8[n], high[n]) for n in fp8 if "experts" in n]
    assert experts and min(experts) > CONTROL_MIN, experts
