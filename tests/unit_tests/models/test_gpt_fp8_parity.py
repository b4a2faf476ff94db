"""FP8 (``fp8="hybrid"``, tensorwise) gradients do not depend on the layout: every layout's
first-step ``main_grad`` equals the one-process FP8 run's, because every scale comes from the
tensor's global amax, so the FP8 operands are bitwise those of one process.

Tolerance: relative L2 error <= ``TOLERANCE`` (1e-4) per parameter. The FP8 operands are the
same, but a layout sums in another order (a row-parallel GEMM's partial products over TP, the
CP attention), so a later tensor can differ in its last fp32 bits and, rarely, an element
sitting on an FP8 rounding edge rounds to the neighbouring FP8 value (a relative step of 2^-3
for e4m3, 2^-2 for e5m2 on that one element); fp32 parity is 1e-5. Negative control: the same
layouts with per-shard amaxes (no MAX reduction: Transformer Engine's per-device weight
amax) are off by far more than the tolerance (``CONTROL_MIN``, percent level: other scales
round every element differently). FP8 is really applied: the one-process FP8 gradients of
every FP8 linear differ from the fp32 ones by more than ``APPLIED_MIN`` (this chaotic test
model, std-0.3 weights, amplifies rounding: bf16 is 11% off fp32 here, FP8 about 50%; how
close one FP8 GEMM is: ``tests/unit_tests/tensor_parallel/test_fp8_linear.py``).
"""

import dataclasses
import functools
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from megatron.core.fp8 import scaling
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.dist_utils import Layout, assert_no_failures, rel_error, use_layout
from tests.unit_tests.models import test_gpt_parity as parity
from tests.unit_tests.models.test_gpt_bf16_parity import own_groups
from tests.unit_tests.transformer.test_mixed_precision import _one_process_step

TOLERANCE = 1e-4
CONTROL_MIN = 1e-3  # the negative control's worst parameter must exceed this
APPLIED_MIN = 1e-3
FP8 = dict(fp8="hybrid", fp8_recipe="tensorwise")


def _case(layout: Layout, arch: str, slow: bool = False):
    marks = [pytest.mark.world(layout.world)] + ([pytest.mark.slow] if slow else [])
    return pytest.param(layout, arch, marks=marks, id=f"{layout.id}-{arch}")


CASES = [
    _case(Layout(tp=2, sp=True), "llama"),
    _case(Layout(cp=2), "llama"),
    _case(Layout(tp=2, cp=2), "llama", slow=True),
    _case(Layout(tp=4), "gpt2", slow=True),
    _case(Layout(tp=2, pp=2), "llama"),
    _case(Layout(tp=2, sp=True, cp=2), "gpt2", slow=True),
    _case(Layout(dp=2), "llama"),
    _case(Layout(tp=2, sp=True, cp=2, pp=2), "llama", slow=True),
]


@functools.lru_cache(maxsize=None)
def one_process_grads(arch: str, fp8: bool = True) -> Dict[str, torch.Tensor]:
    """The one-process step's main_grads (FP8, or fp32 with ``fp8=False``)."""
    changes = FP8 if fp8 else {}
    groups = own_groups() if dist.is_initialized() else None
    grads, _ = _one_process_step(arch, bf16=False, groups=groups, **changes)
    return {name: grad.detach().clone() for name, grad in grads.items()}


def layout_errors(layout: Layout, arch: str, monkeypatch) -> Dict[str, float]:
    """Relative error of this rank's FP8 main_grads against the one-process FP8 run's."""
    expected_full = one_process_grads(arch)
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    make_config = parity.make_config
    monkeypatch.setattr(parity, "STEPS", 1)  # the first step's gradients are compared
    monkeypatch.setattr(
        parity, "make_config", lambda *a: dataclasses.replace(make_config(*a), **FP8)
    )
    steps = parity.distributed_training(layout, "averaged", parity.ARCHS[arch], groups)
    tp_size, tp_rank = groups.tp.size(), groups.tp.rank()
    return {
        name: rel_error(grad, parity.shard_like(expected_full[name], param, tp_size, tp_rank))
        for name, (grad, param) in steps[0][0].items()
    }


def _all_errors(errors: Dict[str, float]) -> Dict[str, float]:
    everyone: List[Dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, errors)
    merged: Dict[str, float] = {}
    for rank_errors in everyone:
        for name, error in rank_errors.items():
            merged[name] = max(error, merged.get(name, 0.0))
    return merged


@pytest.mark.parametrize("layout, arch", CASES)
def test_fp8_main_grads_equal_the_one_process_fp8_run(layout: Layout, arch: str, monkeypatch):
    errors = layout_errors(layout, arch, monkeypatch)
    worst = max(_all_errors(errors).values())
    if dist.get_rank() == 0:  # shown with pytest -s
        print(f"\n{layout.id}-{arch}: worst parameter {worst:.2e} (tolerance {TOLERANCE})")
    assert_no_failures([f"{n}: {e:.3e} > {TOLERANCE}" for n, e in errors.items() if e > TOLERANCE])


@pytest.mark.world(2)
@pytest.mark.parametrize("layout", [Layout(tp=2, sp=True), Layout(cp=2)], ids=lambda x: x.id)
def test_negative_control_per_shard_amax_is_far_off(layout: Layout, monkeypatch):
    """Without the MAX reduction each shard scales by its own amax: far outside TOLERANCE."""
    one_process_grads("llama")  # the reference keeps the global (one-rank) amax
    monkeypatch.setattr(scaling, "reduce_amax", lambda amaxes, groups: amaxes)
    worst = max(_all_errors(layout_errors(layout, "llama", monkeypatch)).values())
    if dist.get_rank() == 0:  # shown with pytest -s
        print(f"\nper-shard amax at {layout.id}: worst parameter {worst:.2e}")
    assert worst > CONTROL_MIN, f"per-shard amax stayed within {worst:.3e}"


@pytest.mark.world(1)
def test_fp8_is_applied():
    fp8, fp32 = one_process_grads("llama"), one_process_grads("llama", fp8=False)
    errors = {name: rel_error(fp8[name], fp32[name]) for name in fp8}
    linear = [e for n, e in errors.items() if "linear" in n and "norm" not in n]
    assert len(linear) == 16 and min(linear) > APPLIED_MIN, errors
    assert all(torch.isfinite(grad).all() for grad in fp8.values())
