"""Faults and determinism under torchrun (SPEC sections 7 and 8).

- A bad loss count fails on the rank that produced it, before the count all-reduce, and no
  rank is left blocked in a collective.
- The same inputs give bitwise-identical ``main_grad``s; overlapped reduction and bucket
  sizes change them by fp32 rounding at most.

Run: ``torchrun --nproc-per-node 4 -m pytest tests/unit_tests/distributed`` (and 2, 8);
a plain ``pytest`` run covers the one-process determinism cases.
"""

import re
from datetime import timedelta
from typing import List

import pytest
import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer import TransformerConfig
from tests.unit_tests import parity
from tests.unit_tests.dist_utils import (
    WORLD_SIZE,
    Layout,
    StubChunk,
    assert_no_failures,
    rel_error,
    use_layout,
)
from tests.unit_tests.parity import Case, run_step

pytestmark = pytest.mark.timeout(60)

DETERMINISM = {
    1: [Case(microbatches=3, mask="uneven")],
    2: [
        Case(cp=2, microbatches=3, mask="uneven"),
        Case(pp=2, vpp=2, microbatches=2, mask="varying", mode="per-token"),
    ],
    4: [
        Case(cp=2, pp=2, microbatches=3, mask="uneven"),
        Case(cp=2, pp=2, vpp=2, microbatches=4, mask="varying", mode="per-token"),
        Case(cp=2, dp=2, microbatches=3, mask="single", tie=True),
    ],
    8: [
        Case(cp=2, pp=2, dp=2, microbatches=3, mask="uneven"),
        Case(cp=4, pp=2, vpp=2, microbatches=2, mask="varying", mode="per-token"),
    ],
}
CASES = DETERMINISM.get(WORLD_SIZE, [])


def _layout(case: Case) -> Layout:
    return Layout(case.cp, case.pp, case.vpp, case.dp)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_same_inputs_give_bitwise_identical_main_grads(case: Case):
    use_layout(_layout(case))
    first, second = run_step(case), run_step(case)
    failures = [
        f"main_grad {name} differs between two identical runs"
        for name, grad in first.grads.items()
        if not torch.equal(grad, second.grads[name])
    ]
    if not any(grad.abs().sum() > 0 for grad in first.grads.values()):
        failures.append("all main_grads are zero: the comparison would prove nothing")
    assert_no_failures(failures)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_overlap_on_off_and_bucket_sizes_agree_within_fp32_rounding(case: Case):
    use_layout(_layout(case))
    base = run_step(case.with_(overlap=False, bucket_size=None))
    failures = []
    for bucket_size in (None, 1, 40):
        variant = run_step(case.with_(overlap=True, bucket_size=bucket_size))
        for name, grad in variant.grads.items():
            err = rel_error(grad, base.grads[name])
            if not err <= 1e-6:
                failures.append(f"overlap, bucket_size={bucket_size}: {name} off by {err:.2e}")
    assert_no_failures(failures)


# ----------------------------------------------------------------------------- bad counts


class _Recorder:
    """Wraps ``dist.all_reduce``: records each call, then runs it."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


def _negated_counts(monkeypatch):
    """The harness's loss callback, with ``-(count) - 1`` as the count."""
    real = parity._loss_function

    def patched(case, cp_group, result):
        inner = real(case, cp_group, result)

        def loss(mask, output, **kwargs):
            loss_sum, count, reported = inner(mask, output, **kwargs)
            return loss_sum, -count - 1, reported

        return loss

    monkeypatch.setattr(parity, "_loss_function", patched)


BAD_EVERYWHERE = list(dict.fromkeys([Layout(cp=WORLD_SIZE), Layout(cp=2, dp=WORLD_SIZE // 2)]))


@pytest.mark.world(2, 4, 8)
@pytest.mark.parametrize("layout", BAD_EVERYWHERE, ids=[lay.id for lay in BAD_EVERYWHERE])
def test_negative_count_on_every_cp_rank_raises_everywhere_before_the_all_reduce(
    monkeypatch, layout
):
    """Every rank's callback returns a negative count: every rank raises the same error
    and none has entered the count all-reduce (so none is left waiting in it)."""
    use_layout(layout)
    failures: List[str] = []
    recorder = _Recorder(dist.all_reduce)
    with monkeypatch.context() as patch:
        _negated_counts(patch)
        patch.setattr(dist, "all_reduce", recorder)
        try:
            run_step(Case(cp=layout.cp, dp=layout.dp, microbatches=2, mask="uneven"))
            failures.append("no error for a negative num_tokens")
        except ValueError as exc:
            if not re.search(r"loss_func returned num_tokens=-\d+; expected .*>= 0", str(exc)):
                failures.append(f"unexpected message: {exc}")
    if recorder.calls:
        failures.append(f"{recorder.calls} all-reduce(s) ran before the error")
    assert_no_failures(failures)


_PAIRS: list = []


def _pair_groups() -> list:
    """CP groups [0, 1], [2, 3], ... with a short timeout: a regression fails, not hangs."""
    if not _PAIRS:
        timeout = timedelta(seconds=20)
        _PAIRS.extend(dist.new_group([r, r + 1], timeout=timeout) for r in range(0, WORLD_SIZE, 2))
    return _PAIRS


@pytest.mark.world(2, 4, 8)
def test_negative_count_on_one_rank_raises_there_before_the_all_reduce(monkeypatch):
    """Odd ranks return a negative count, their CP peers a valid one. The odd rank raises
    without entering the count all-reduce; the test then releases its peer by joining that
    all-reduce with 0 tokens, and the peer's loss shows it saw only its own count. (A check
    placed after the all-reduce would fail here within the 20 s group timeout.)"""
    rank = dist.get_rank()
    cp = _pair_groups()[rank // 2]
    bad = rank % 2 == 1
    loss_sum = torch.tensor(4.0, requires_grad=True)
    count = torch.tensor(-1 if bad else 3)
    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    failures: List[str] = []
    recorder = _Recorder(dist.all_reduce)
    with monkeypatch.context() as patch:
        patch.setattr(dist, "all_reduce", recorder)
        try:
            out, _ = schedules.forward_step(
                lambda it, model: (torch.zeros(()), lambda _: (loss_sum, count, {})),
                None,
                StubChunk(config),
                2,
                None,
                [],
                config,
                None,
                is_last_stage=True,
                cp_group=cp,
            )
            if bad:
                failures.append("no error for num_tokens=-1")
            elif not torch.allclose(out, torch.tensor(4.0 * 2 / 3 / 2)):
                failures.append(f"peer's loss {out.item()} != S*C/(N*M) with N = its own 3")
        except ValueError as exc:
            if not bad or "loss_func returned num_tokens=-1;" not in str(exc):
                failures.append(f"unexpected error: {exc}")
            if recorder.calls:
                failures.append("the bad rank entered the count all-reduce before raising")
    if bad:
        try:
            dist.all_reduce(torch.zeros((), dtype=count.dtype), group=cp)
        except RuntimeError as exc:  # the peer never waited: the check came too late
            failures.append(f"releasing the peer failed: {exc}")
    assert_no_failures(failures)
