"""When the value of a loss callback's ``num_tokens`` is checked (SPEC section 8).

A CPU count is read at once. A count on an accelerator is copied to the host without a
sync while the schedule runs and checked when the schedule finishes, before
``finalize_model_grads``: one bad count still fails the step with the same message, plus
the microbatch it came from. The collector is tested on the CPU directly and, with the
accelerator test forced onto CPU counts, through the parity harness's schedule; the CUDA
tests run where a GPU is present (tests/benchmarks/results/ records the H200 run).
"""

import math

import pytest
import torch

from megatron.core.pipeline_parallel import schedules, token_counts
from megatron.core.pipeline_parallel.token_counts import DeferredCountChecks, check_num_tokens
from megatron.core.transformer import TransformerConfig
from tests.unit_tests import parity
from tests.unit_tests.dist_utils import compare_tensors
from tests.unit_tests.parity import Case, run_step

pytestmark = [pytest.mark.world(1), pytest.mark.timeout(60)]

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (H200 run: results/fusion_and_counts_cuda_h200.log)",
)

BAD_VALUES = {"negative": (-3, r"num_tokens=-3 "), "nan": (math.nan, r"num_tokens=nan ")}


def test_a_cpu_count_is_checked_at_once_even_while_collecting():
    checks = DeferredCountChecks()
    with checks, pytest.raises(ValueError, match=r"num_tokens=-1; expected"):
        check_num_tokens(torch.tensor(-1))


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_verify_names_the_first_bad_count_and_its_microbatch(name):
    value, match = BAD_VALUES[name]
    checks = DeferredCountChecks()
    for count in (5, 0, value, -7):
        checks.add(torch.tensor(count))
    with pytest.raises(ValueError, match=match + r"\(microbatch 2 of .*\); expected a finite"):
        checks.verify()
    checks.verify()  # the failed step's counts are gone


def test_verify_accepts_valid_counts_of_any_real_dtype():
    checks = DeferredCountChecks()
    for count in (torch.tensor(0), torch.tensor(3.5), torch.tensor(7, dtype=torch.int32)):
        checks.add(count)
    checks.verify()


def test_the_collector_keeps_its_own_copy_of_the_count():
    checks, count = DeferredCountChecks(), torch.tensor(4)
    checks.add(count)
    count.fill_(-1)  # the caller reuses its tensor after the loss callback
    checks.verify()


def test_collecting_ends_with_its_block_even_on_error():
    checks = DeferredCountChecks()
    with pytest.raises(RuntimeError), checks:
        raise RuntimeError("inside")
    assert token_counts._COLLECTOR.get() is None


# ----------------------------------------------------------------------------- through a schedule


def _defer_every_count(monkeypatch):
    """Route CPU counts through the collector, as the schedule does with GPU counts."""
    real = token_counts._check_value
    monkeypatch.setattr(
        token_counts, "_check_value", lambda value, where: real(value, where or " (eager)")
    )

    def check(num_tokens):
        collector = token_counts._COLLECTOR.get()
        assert collector is not None, "the schedule is not collecting counts"
        collector.add(num_tokens)

    monkeypatch.setattr(schedules, "_check_num_tokens", check)


def _bad_count_in(monkeypatch, microbatch: int):
    """The harness's loss callback, with a negative count in ``microbatch``."""
    real, calls = parity._loss_function, []

    def patched(case, cp_group, result):
        inner = real(case, cp_group, result)

        def loss(mask, output, **kw):
            out = inner(mask, output, **kw)
            calls.append(len(calls))
            return (out[0], torch.tensor(-2), out[2]) if len(calls) - 1 == microbatch else out

        return loss

    monkeypatch.setattr(parity, "_loss_function", patched)
    return calls


@pytest.mark.parametrize(
    "case", [Case(microbatches=3), Case(microbatches=3, mode="per-token")], ids=lambda case: case.id
)
def test_a_deferred_bad_count_fails_the_step_when_the_schedule_finishes(monkeypatch, case):
    _defer_every_count(monkeypatch)
    calls = _bad_count_in(monkeypatch, microbatch=1)
    finalized = []
    monkeypatch.setattr(parity, "finalize_model_grads", lambda *a, **k: finalized.append(1))
    with pytest.raises(ValueError, match=r"num_tokens=-2 \(microbatch 1 of .*\); expected"):
        run_step(case)
    assert len(calls) == case.microbatches, "the error came before the schedule finished"
    assert finalized == [], "gradients were finalized with a bad count"


def test_negative_control_without_verify_a_deferred_bad_count_trains_silently(monkeypatch):
    """If the schedule never verified, the bad count would give a wrong gradient and no
    error: the test above is what catches a missing ``verify``."""
    case = Case(microbatches=3)
    _defer_every_count(monkeypatch)
    _bad_count_in(monkeypatch, microbatch=1)
    monkeypatch.setattr(DeferredCountChecks, "verify", lambda self: None)
    result = run_step(case)
    expected = parity.reference_step(case)[0]
    assert compare_tensors(result.grads, expected, 1e-5, "main_grad") != []


# ----------------------------------------------------------------------------- on a GPU


class _CudaChunk(torch.nn.Module):
    """y = w * x on the GPU: the least a schedule needs, with a real parameter."""

    def __init__(self):
        super().__init__()
        self.config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
        self.weight = torch.nn.Parameter(torch.ones(4, device="cuda"))

    def set_input_tensor(self, tensor) -> None:
        pass

    def forward(self, x):
        return self.weight * x


def _cuda_step(counts):
    """One no-pipelining step whose loss callback returns ``counts[m]`` on the GPU."""
    model, seen = _CudaChunk(), iter(range(len(counts)))

    def forward_step(data_iterator, chunk):
        m = next(seen)
        output = chunk(torch.full((4,), float(m + 1), device="cuda"))
        count = torch.full((), counts[m], device="cuda")  # a fill: no host-to-device copy
        return output, lambda out: (out.sum(), count, {})

    schedules.forward_backward_no_pipelining(
        forward_step_func=forward_step,
        data_iterator=None,
        model=model,
        num_microbatches=len(counts),
        seq_length=4,
        micro_batch_size=1,
    )
    return model.weight.grad


@needs_cuda
def test_cuda_counts_cost_no_host_sync_per_microbatch():
    """With CUDA's sync debug mode set to error, any host read inside the schedule raises;
    the step runs, and its gradient is (1/M) sum_m (m + 1) / N_m per element."""
    counts = [2, 4, 8]
    torch.cuda.set_sync_debug_mode("error")
    try:
        grad = _cuda_step(counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = sum((m + 1) / n for m, n in enumerate(counts)) / len(counts)
    torch.testing.assert_close(grad.cpu(), torch.full((4,), expected), rtol=1e-6, atol=0)


@needs_cuda
def test_negative_control_an_eager_cuda_count_check_syncs_the_host():
    """The same step with the count read at once (the old check) trips sync debug mode."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(schedules, "_check_num_tokens", lambda n: n.item())
        torch.cuda.set_sync_debug_mode("error")
        try:
            with pytest.raises(RuntimeError, match="synchroniz"):
                _cuda_step([2, 4])
        finally:
            torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_a_bad_cuda_count_fails_the_step_naming_its_microbatch(name):
    value, match = BAD_VALUES[name]
    with pytest.raises(ValueError, match=match + r"\(microbatch 1 of .*\); expected"):
        _cuda_step([3, value, 5])
