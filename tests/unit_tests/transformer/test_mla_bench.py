"""The arithmetic that ``tests/benchmarks/bench_mla.py`` reports rests on: its bare PyTorch
MLA (an independent plain write-up, its own YaRN tables) computes our ``MLASelfAttention``'s
output and input gradient from the same weights, and its parameter count (the active
parameters of its TFLOP/s) is the model the library builds, with MLA and with plain
attention."""

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.world(1)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_mla as bench  # noqa: E402


def test_bare_mla_equals_ours_in_float64():
    """Output and input gradient of the bare MLA equal ours (YaRN, no q LoRA, float64)."""
    seq, cpu = 16, torch.device("cpu")
    ours = bench.build_ours(bench.TINY, cpu, torch.float64)
    bare = bench.BareMLA(bench.TINY, seq, cpu, torch.float64)
    bench.init_by_name(bare)
    x = torch.randn(seq, 2, bench.TINY.hidden, dtype=torch.float64, requires_grad=True)
    grad = torch.randn_like(x)
    outputs = []
    for forward in (lambda t: ours(t, None)[0], bare):
        out = forward(x)
        (dx,) = torch.autograd.grad(out, x, grad)
        outputs.append((out, dx))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mla", [True, False], ids=["mla", "mha"])
def test_parameter_count_is_the_built_model(mla):
    """``model_params`` (dense first layer, then MoE with shared experts) counts what
    GPTModel builds."""
    assert bench.check_param_count(bench.TINY, 3, mla) is None
