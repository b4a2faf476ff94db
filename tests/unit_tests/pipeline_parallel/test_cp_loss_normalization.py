"""Parity bucket for context-parallel loss normalization (SPEC section 7).

Every case runs one training step through our schedule, DDP and ``finalize_model_grads``
on this launch's ranks and compares every parameter's ``main_grad``, the parameters after
one SGD step, the returned local counts and the aliased reported tensors with a dense
float64 single-process reference (``tests/unit_tests/parity.py``).

Run: ``torchrun --nproc-per-node 4 -m pytest <this file>`` and with 8 ranks; a plain
``pytest`` run covers the one-process cases.
"""

import itertools
from typing import List

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.tools.per_shard_normalization import per_shard_normalization
from tests.unit_tests.dist_utils import (
    WORLD_SIZE,
    Layout,
    StubChunk,
    assert_no_failures,
    gather_failures,
    use_layout,
)
from tests.unit_tests.parity import MASKS, MODES, Case, check_step, run_step

LAYOUTS = {
    1: [Layout()],
    2: [Layout(cp=2), Layout(pp=2, vpp=2)],
    4: [
        Layout(cp=4),
        Layout(cp=2, pp=2),
        Layout(cp=2, pp=2, vpp=2),
        Layout(cp=2, dp=2),
        Layout(pp=2, dp=2),
        Layout(pp=2, vpp=2, dp=2),
    ],
    8: [
        Layout(cp=8),
        Layout(cp=4, pp=2),
        Layout(cp=4, pp=2, vpp=2),
        Layout(cp=4, dp=2),
        Layout(cp=2, pp=2, dp=2),
        Layout(cp=2, pp=2, vpp=2, dp=2),
    ],
}


def _microbatch_counts(layout: Layout) -> List[int]:
    """M in {1, 3}; with VPP a multiple of PP (the interleaved schedule's limit)."""
    return [layout.pp, 2 * layout.pp] if layout.vpp else [1, 3]


def _matrix() -> List[Case]:
    """Every layout of this world size x M x mask x mode, plus DDP and p2p variants."""
    cases = []
    for layout in LAYOUTS.get(WORLD_SIZE, []):
        base = Case(cp=layout.cp, pp=layout.pp, vpp=layout.vpp, dp=layout.dp)
        for m, mask, mode in itertools.product(_microbatch_counts(layout), MASKS, MODES):
            cases.append(base.with_(microbatches=m, mask=mask, mode=mode))
        m = _microbatch_counts(layout)[-1]
        cases.append(base.with_(microbatches=m, mask="uneven", overlap=True, bucket_size=40))
        cases.append(base.with_(microbatches=m, mask="varying", average_in_collective=True))
        cases.append(
            base.with_(microbatches=m, mask="single", mode="per-token", overlap=True, bucket_size=1)
        )
        if layout.vpp and layout.pp == 2:
            for mode in MODES:
                cases.append(base.with_(microbatches=m, mask="uneven", mode=mode, batch_p2p=False))
    return cases


MATRIX = _matrix()


@pytest.mark.parametrize("case", MATRIX, ids=[c.id for c in MATRIX])
def test_gradients_match_dense_reference(case: Case):
    use_layout(Layout(case.cp, case.pp, case.vpp, case.dp))
    assert_no_failures(check_step(case, run_step(case)))


def _case(layout: Layout, **fields) -> Case:
    """A case on ``layout`` with its largest microbatch count."""
    m = _microbatch_counts(layout)[-1]
    return Case(cp=layout.cp, pp=layout.pp, vpp=layout.vpp, dp=layout.dp, microbatches=m, **fields)


FALLBACK = [
    _case(lay, mask=mask, mode="averaged", groups="mpu")
    for lay in LAYOUTS.get(WORLD_SIZE, [])[:3]
    for mask in ("uneven", "single")
]


@pytest.mark.parametrize("case", FALLBACK, ids=[c.id for c in FALLBACK])
def test_mpu_fallback_without_any_group_matches(case: Case):
    """No pg_collection to the schedule, DDP or finalize: parallel_state is used."""
    use_layout(Layout(case.cp, case.pp, case.vpp, case.dp))
    assert_no_failures(check_step(case, run_step(case)))


@pytest.mark.world(4, 8)
@pytest.mark.parametrize("mask", ["uneven", "single", "varying"])
def test_explicit_cp_group_differing_from_parallel_state_is_honoured(mask):
    """parallel_state says C=1 (all ranks data-parallel); the step is told C=2 through
    pg_collection.cp. Only a schedule that uses the group passed at call time matches."""
    use_layout(Layout(dp=WORLD_SIZE))
    cp_groups, dp_groups = _custom_groups(cp=2)
    case = Case(cp=2, dp=WORLD_SIZE // 2, microbatches=3, mask=mask)
    rank = dist.get_rank()
    groups = ProcessGroupCollection(
        **_mpu_fields(),
        cp=cp_groups[rank // 2],
        dp=dp_groups[rank % 2],
        dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True),
    )
    result = run_step(case, pg_collection=groups, dp_rank=rank // 2)
    assert parallel_state.get_context_parallel_world_size() == 1
    assert_no_failures(check_step(case, result))


@pytest.mark.world(4, 8)
def test_count_never_mixes_data_parallel_replicas():
    """Replicas with very different valid-token counts: a count reduced over dp_cp instead
    of cp would change every replica's weight; parity holds, the mixed count fails."""
    layout = next(lay for lay in LAYOUTS[WORLD_SIZE] if lay.dp == 2 and lay.cp >= 2)
    use_layout(layout)
    case = Case(cp=layout.cp, pp=layout.pp, dp=2, microbatches=3, mask="varying")
    assert_no_failures(check_step(case, run_step(case)))

    def mixed_count(loss_sum, num_tokens, cp_group):
        total = num_tokens.detach().clone().float()
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group(True))
        return loss_sum * cp_group.size() / total.clamp(min=1)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(schedules, "reduce_loss_across_cp", mixed_count)
        failures = gather_failures(check_step(case, run_step(case)))
    assert failures, "a count mixed across data-parallel replicas went unnoticed"


NEGATIVE = [
    _case(lay, mask=mask, mode="averaged")
    for lay in LAYOUTS.get(WORLD_SIZE, [])
    if lay.cp > 1
    for mask in ("uneven", "single", "empty")
]


@pytest.mark.world(4, 8)
@pytest.mark.parametrize("case", NEGATIVE, ids=[c.id for c in NEGATIVE])
def test_negative_control_per_shard_normalization_fails(case: Case):
    """With reduce_loss_across_cp swapped for per-shard normalization the bucket fails."""
    use_layout(Layout(case.cp, case.pp, case.vpp, case.dp))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(schedules, "reduce_loss_across_cp", per_shard_normalization)
        failures = gather_failures(check_step(case, run_step(case)))
    assert any("main_grad" in f for f in failures), f"per-shard normalization passed {case.id}"


@pytest.mark.world(4, 8)
def test_forward_step_without_cp_group_uses_parallel_state():
    """forward_step(..., cp_group=None) normalizes with parallel_state's CP group."""
    use_layout(Layout(cp=WORLD_SIZE))
    cp = parallel_state.get_context_parallel_group()
    loss_sum = torch.tensor(3.0, requires_grad=True)
    count = torch.tensor(cp.rank() % 2, dtype=torch.int64)  # some shards have no token
    store: list = []
    config = _config()
    out, returned = schedules.forward_step(
        lambda it, model: (torch.zeros(()), lambda _: (loss_sum, count, {"n": count})),
        None,
        StubChunk(config),
        2,
        None,
        store,
        config,
        None,
        is_last_stage=True,
    )
    total = sum(r % 2 for r in range(cp.size()))
    assert torch.allclose(out, torch.tensor(3.0 * cp.size() / max(total, 1) / 2))
    assert returned is count and int(count) == cp.rank() % 2 and store[0]["n"] is count


def test_reduce_loss_across_cp_without_group_runs_no_collective():
    """C = 1: S / max(N, 1), the caller's tensors untouched, empty gives 0 (not NaN)."""
    loss_sum, count = torch.tensor(6.0), torch.tensor(3)
    assert schedules.reduce_loss_across_cp(loss_sum, count, None).item() == 2.0
    assert loss_sum.item() == 6.0 and count.item() == 3
    assert schedules.reduce_loss_across_cp(torch.tensor(0.0), torch.tensor(0), None).item() == 0


def _config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)


_GROUP_CACHE: dict = {}


def _custom_groups(cp: int):
    """CP groups of consecutive ranks and the matching DP groups, built by hand (all ranks
    create all groups, in the same order)."""
    if cp not in _GROUP_CACHE:
        world = dist.get_world_size()
        cps = [dist.new_group(list(range(s, s + cp))) for s in range(0, world, cp)]
        dps = [dist.new_group(list(range(r, world, cp))) for r in range(cp)]
        _GROUP_CACHE[cp] = (cps, dps)
    return _GROUP_CACHE[cp]


def _mpu_fields() -> dict:
    """parallel_state's pp/embedding/tp groups as keyword arguments."""
    mpu = ProcessGroupCollection.use_mpu_process_groups()
    return {name: getattr(mpu, name) for name in ("tp", "pp", "mp", "embd", "pos_embd")}


@pytest.mark.world(4, 8)
def test_explicit_collection_without_cp_means_one_rank_not_parallel_state():
    """parallel_state has C=2, but the step's pg_collection has no cp group and the config
    says C=1: the count is not reduced behind the caller's back (explicit groups win)."""
    use_layout(Layout(cp=2, dp=WORLD_SIZE // 2))
    groups = ProcessGroupCollection(
        **_mpu_fields(), dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True)
    )
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(k.get("group")))
        store: list = []
        out, _ = schedules.forward_step(
            lambda it, model: (torch.zeros(()), lambda _: (torch.tensor(4.0), torch.tensor(2), {})),
            None,
            StubChunk(_config()),
            1,
            None,
            store,
            _config(),
            1,
            is_last_stage=True,
            cp_group=groups.cp,
        )
    assert calls == [] and out.item() == 2.0
