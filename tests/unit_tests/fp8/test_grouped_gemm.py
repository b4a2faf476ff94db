"""The experts' FP8 grouped GEMM (``megatron.core.fp8.grouped``) against an independent
reference: each expert's operands cast by hand (scale fp8_max / amax / 2**margin, per expert
and per tensor), dequantized (q.float() / scale) and multiplied in float64, for the output,
dL/dx and dL/dW (e5m2 output gradients for "hybrid"), with the weights' operands cast in the
call or kept by the module (``expert_weight_operands``), an expert with no tokens included."""

import pytest
import torch

from megatron.core.fp8.grouped import Fp8Experts, expert_weight_operands, fp8_grouped_linear
from tests.unit_tests.fp8.fp8_reference import dequantized

pytestmark = pytest.mark.world(1)

SIZES = [6, 0, 9]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kept", [False, True], ids=["cast", "kept"])
@pytest.mark.parametrize(
    "fmt, margin, wgrad", [("hybrid", 0, True), ("e4m3", 1, True), ("hybrid", 0, False)]
)
def test_grouped_gemm_is_the_float64_product_of_the_dequantized_operands(fmt, margin, wgrad, kept):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(sum(SIZES), 16, generator=generator) * 3).requires_grad_()
    weights = [torch.randn(24, 16, generator=generator).requires_grad_() for _ in SIZES]
    experts = Fp8Experts(fmt, margin, wgrad, None, first_expert=0, num_experts=len(SIZES))
    operands = expert_weight_operands(weights, experts) if kept else None
    y = fp8_grouped_linear(x, SIZES, weights, experts, operands)
    g = torch.randn(y.shape, generator=generator)
    y.backward(g)
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    start = 0
    for i, n in enumerate(SIZES):
        rows = slice(start, start + n)
        xq, wq = dequantized(x[rows], E4M3, margin), dequantized(weights[i], E4M3, margin)
        gq = dequantized(g[rows], grad_dtype, margin)
        _close(y[rows], xq @ wq.t())
        _close(x.grad[rows], gq @ wq)
        high_x = x[rows].detach().double()
        _close(weights[i].grad, gq.t() @ xq if wgrad else g[rows].double().t() @ high_x)
        start += n
