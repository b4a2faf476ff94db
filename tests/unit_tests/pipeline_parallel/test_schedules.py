"""The three schedules against the dense reference (full masks), and their options/hooks.

World sizes 1, 2, 4 and 8: each launch runs the layouts that fit it.
"""

import functools
from typing import List

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
from tests.unit_tests import parity
from tests.unit_tests.dist_utils import (
    WORLD_SIZE,
    Layout,
    assert_no_failures,
    rel_error,
    use_layout,
)
from tests.unit_tests.parity import Case, check_step, run_step

LAYOUTS = {
    1: [Layout()],
    2: [Layout(cp=2), Layout(pp=2), Layout(pp=2, vpp=2), Layout(dp=2)],
    4: [Layout(pp=4), Layout(pp=4, vpp=2), Layout(pp=2, vpp=2, dp=2), Layout(cp=2, pp=2)],
    8: [Layout(pp=8), Layout(pp=2, vpp=2, dp=2, cp=2), Layout(pp=4, vpp=2, dp=2)],
}


def _cases() -> List[Case]:
    cases = []
    for lay in LAYOUTS.get(WORLD_SIZE, []):
        base = Case(cp=lay.cp, pp=lay.pp, vpp=lay.vpp, dp=lay.dp, mask="full")
        counts = [lay.pp, 2 * lay.pp] if lay.vpp else [1, 3, 4]
        cases += [base.with_(microbatches=m) for m in counts]
        if lay.pp > 1:
            cases.append(base.with_(microbatches=counts[-1], tie=True, mask="uneven"))
            cases.append(base.with_(microbatches=counts[-1], tie=True, mode="per-token"))
    if WORLD_SIZE == 4:  # M not a multiple of g, last group >= PP; g > PP
        cases.append(Case(pp=2, vpp=2, dp=2, microbatches=5, mask="uneven"))
    return cases


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_schedule_matches_dense_reference(case: Case):
    use_layout(Layout(case.cp, case.pp, case.vpp, case.dp))
    if case.microbatches == 5:  # group size 3: groups of 3 then 2 microbatches
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(parity, "TransformerConfig", _with_group_size(3))
            assert_no_failures(check_step(case, run_step(case)))
    else:
        assert_no_failures(check_step(case, run_step(case)))


def _with_group_size(g: int):
    """TransformerConfig whose microbatch_group_size_per_vp_stage is g."""
    from megatron.core.transformer import TransformerConfig

    return functools.partial(TransformerConfig, microbatch_group_size_per_vp_stage=g)


KEEP_OUTPUTS = [c.with_(mask="uneven") for c in CASES if c.pp > 1 and c.microbatches > 1][:2]


@pytest.mark.world(2, 4, 8)
@pytest.mark.parametrize("case", KEEP_OUTPUTS, ids=[c.id for c in KEEP_OUTPUTS])
def test_without_deallocating_pipeline_outputs(case: Case):
    use_layout(Layout(case.cp, case.pp, case.vpp, case.dp))
    with pytest.MonkeyPatch.context() as patch:
        from megatron.core.transformer import TransformerConfig

        patch.setattr(
            parity,
            "TransformerConfig",
            lambda **kw: TransformerConfig(**{**kw, "deallocate_pipeline_outputs": False}),
        )
        assert_no_failures(check_step(case, run_step(case)))


def test_interleaved_schedule_table_order():
    """g = 2, V = 2, M = 4: groups of two microbatches through chunk 0 then chunk 1."""
    table = schedules.interleaved_schedule_table(4, 2, 2, 2)
    assert table == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    table = schedules.interleaved_schedule_table(5, 2, 3, 2)
    assert table == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    for k, (m, chunk) in enumerate(schedules.interleaved_schedule_table(6, 3, 2, 2)):
        assert chunk == (k % 6) // 2 and m == (k // 6) * 2 + k % 2


def test_get_forward_backward_func_picks_the_schedule():
    assert get_forward_backward_func(1, None) is schedules.forward_backward_no_pipelining
    assert (
        get_forward_backward_func(2, None)
        is schedules.forward_backward_pipelining_without_interleaving
    )
    assert (
        get_forward_backward_func(2, 2) is schedules.forward_backward_pipelining_with_interleaving
    )


LOSS_LAYOUTS = LAYOUTS.get(WORLD_SIZE, [])[:3]


def _case(layout: Layout, **fields) -> Case:
    """A case on ``layout`` with 2*PP microbatches."""
    return Case(
        cp=layout.cp,
        pp=layout.pp,
        vpp=layout.vpp,
        dp=layout.dp,
        microbatches=2 * layout.pp,
        **fields,
    )


@pytest.mark.parametrize("layout", LOSS_LAYOUTS, ids=[lay.id for lay in LOSS_LAYOUTS])
def test_forward_only_reports_losses_and_leaves_gradients(layout: Layout):
    """forward_only: the last stage reports every microbatch; no gradient is produced."""
    use_layout(layout)
    case = _case(layout, mask="uneven")
    result = run_step(case, forward_only=True)
    failures = [f"{n}: gradient {g.abs().max().item()}" for n, g in result.grads.items() if g.any()]
    _, _, losses = parity.reference_step(case)
    batch = parity.global_batch(case)
    for g, (loss_sum, _) in zip(result.microbatch_ids, result.produced):
        mask = batch["loss_mask"][g][:, result.positions].double()
        expected = (losses[g][:, result.positions] * mask).sum()
        if rel_error(loss_sum, expected) > 1e-5:
            failures.append(
                f"microbatch {g}: forward-only loss {loss_sum.item()} vs {expected.item()}"
            )
    if result.produced and len(result.reported) != case.microbatches:
        failures.append(f"{len(result.reported)} reports for {case.microbatches} microbatches")
    assert_no_failures(failures)


@pytest.mark.parametrize("layout", LOSS_LAYOUTS, ids=[lay.id for lay in LOSS_LAYOUTS])
def test_hooks_are_honoured(layout: Layout):
    """grad_scale_func scales the loss before backward; no_sync, grad_sync, param_sync and
    finalize hooks are called."""
    use_layout(layout)
    case = _case(layout, mask="uneven")
    calls = {"param_sync": 0, "grad_sync": 0}

    def hooks(config):
        config.grad_scale_func = lambda loss: loss * 2.0
        config.param_sync_func = lambda params: calls.__setitem__(
            "param_sync", calls["param_sync"] + 1
        )
        config.grad_sync_func = lambda params: calls.__setitem__(
            "grad_sync", calls["grad_sync"] + 1
        )

    result = run_step(case, configure=hooks)
    grads, _, _ = parity.reference_step(case)
    doubled = {n: 2.0 * g for n, g in grads.items()}
    failures = [
        f"{n}: {rel_error(g, doubled[n]):.2e}"
        for n, g in result.grads.items()
        if rel_error(g, doubled[n]) > 1e-5
    ]
    chunks = layout.vpp or 1
    if calls["param_sync"] != chunks or calls["grad_sync"] != chunks:
        failures.append(f"hook calls {calls}, expected {chunks} each")
    if result.finalize_calls != 1:
        failures.append(f"finalize_model_grads_func called {result.finalize_calls} times")
    assert_no_failures(failures)


@pytest.mark.parametrize("layout", LOSS_LAYOUTS, ids=[lay.id for lay in LOSS_LAYOUTS])
def test_collect_non_loss_data(layout: Layout):
    use_layout(layout)
    case = Case(
        cp=layout.cp, pp=layout.pp, vpp=layout.vpp, dp=layout.dp, microbatches=2 * layout.pp
    )
    result = run_step(case, forward_only=True, collect_non_loss_data=True)
    last = (
        parallel_state.is_pipeline_last_stage()
        if parallel_state.model_parallel_is_initialized()
        else True
    )
    expected = case.microbatches if last else 0
    assert len(result.reported) == expected
    assert all(isinstance(r, dict) and "per_token_loss" in r for r in result.reported)
    assert all(torch.is_tensor(r["per_token_loss"]) for r in result.reported)
