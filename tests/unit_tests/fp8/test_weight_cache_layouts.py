"""The FP8 weight cache (``megatron.core.fp8.cache``) at layouts: steps with the cache give
bitwise the gradients of steps without it, across ranks (a weight amax MAX-reduced over TP at
the refill) and pipeline stages (each model chunk refills at its own first microbatch)."""

from dataclasses import replace

import pytest
import torch

from tests.unit_tests.dist_utils import Layout, assert_no_failures, use_layout
from tests.unit_tests.fp8.test_weight_cache import FP8, _count_weight_amaxes, _uncached


@pytest.mark.slow
@pytest.mark.world(2)
@pytest.mark.parametrize(
    "layout", [Layout(tp=2, sp=True), Layout(pp=2), Layout(pp=2, vpp=2)], ids=lambda x: x.id
)
def test_cached_steps_are_bitwise_the_uncached_ones_at_a_layout(layout, monkeypatch):
    """3 SGD steps of the parity GPT in FP8 at ``layout`` (the interleaved schedule: every
    model chunk refills at its own first microbatch)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from tests.unit_tests.models import test_gpt_parity as parity

    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    config = parity.make_config
    monkeypatch.setattr(parity, "make_config", lambda *a: replace(config(*a), **FP8))

    def grads(steps):
        return [{name: grad for name, (grad, _) in step.items()} for step, _ in steps]

    arch = parity.ARCHS["llama"]
    with monkeypatch.context() as patch:
        amaxes = _count_weight_amaxes(patch)
        cached = grads(parity.distributed_training(layout, "averaged", arch, groups))
    with monkeypatch.context() as patch:
        _uncached(patch)
        amaxes_uncached = _count_weight_amaxes(patch)
        plain = grads(parity.distributed_training(layout, "averaged", arch, groups))
    assert len(cached) == parity.STEPS and len(amaxes) > 0
    assert len(amaxes) * parity.GLOBAL_MICROBATCHES == len(amaxes_uncached)  # once a step
    failures = [f"step {i}: {name}" for i, (a, b) in enumerate(zip(cached, plain)) for name in a
                if not torch.equal(a[name], b[name])]  # fmt: skip
    assert_no_failures(failures)
