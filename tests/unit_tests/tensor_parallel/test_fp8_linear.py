"""The FP8 linear on one process (``megatron.core.fp8``): its forward and both gradients equal
the product of the dequantized FP8 operands (e4m3 forward; e5m2 output gradient for "hybrid",
e4m3 for "e4m3"), each scaled by fp8_max / amax / 2**margin; ``fp8_wgrad=False`` keeps the
weight gradient in high precision; gradient-accumulation fusion adds into ``main_grad``; FP8
is applied and close to the high-precision linear; the GPT's output layer stays in high
precision. The layouts: ``tests/unit_tests/models/test_gpt_fp8_parity.py``."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fp8 import scaling
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.fp8.fp8_reference import dequantized

pytestmark = pytest.mark.world(1)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _config(**changes) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2)
    return TransformerConfig(**{**base, "fp8": "hybrid", "fp8_recipe": "tensorwise", **changes})


def _run(layer_cls, config, **kwargs):
    torch.manual_seed(0)
    layer = layer_cls(16, 24, config=config, init_method=torch.nn.init.normal_, **kwargs)
    x = torch.randn(5, 3, 16, requires_grad=True)
    y, _ = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    return layer, x, y, g


@pytest.mark.parametrize("fmt, grad_dtype", [("hybrid", E5M2), ("e4m3", E4M3)])
@pytest.mark.parametrize("margin", [0, 2])
def test_forward_and_gradients_are_the_dequantized_products(fmt, grad_dtype, margin):
    config = _config(fp8=fmt, fp8_margin=margin)
    layer, x, y, g = _run(ColumnParallelLinear, config, bias=True)
    xq, wq = (dequantized(t, E4M3, margin, torch.float32) for t in (x, layer.weight))
    gq = dequantized(g, grad_dtype, margin, torch.float32).reshape(-1, 24)
    torch.testing.assert_close(y, F.linear(xq, wq, layer.bias), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(x.grad.reshape(-1, 16), gq @ wq, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad, gq.t() @ xq.reshape(-1, 16), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad, g.reshape(-1, 24).sum(0))


def test_no_fp8_wgrad_keeps_the_weight_gradient_in_high_precision():
    layer, x, _, g = _run(RowParallelLinear, _config(fp8_wgrad=False), **_ROW)
    expected = g.reshape(-1, 24).t() @ x.detach().reshape(-1, 16)
    torch.testing.assert_close(layer.weight.grad, expected)


_ROW = dict(bias=False, input_is_parallel=True, skip_bias_add=False)


def test_gradient_accumulation_fusion_adds_into_main_grad():
    plain, _, _, _ = _run(RowParallelLinear, _config(), **_ROW)
    torch.manual_seed(0)
    layer = RowParallelLinear(
        16, 24, config=_config(gradient_accumulation_fusion=True),
        init_method=torch.nn.init.normal_, **_ROW,
    )  # fmt: skip
    layer.weight.main_grad = torch.ones_like(layer.weight)
    x = torch.randn(5, 3, 16, requires_grad=True)
    y, _ = layer(x)
    y.backward(torch.randn_like(y))
    torch.testing.assert_close(layer.weight.main_grad, 1 + plain.weight.grad)


@pytest.mark.parametrize("fp8", ["hybrid", None])
def test_fusion_needs_main_grad_only_where_a_weight_gradient_is_computed(fp8):
    """One rule for the FP8 and the high-precision linear (``layers._linear_flags``): with
    gradient_accumulation_fusion a trainable weight without ``main_grad`` is refused; a
    frozen weight, or no autograd, needs none."""
    config = _config(fp8=fp8, gradient_accumulation_fusion=True)
    layer = RowParallelLinear(16, 24, config=config, init_method=torch.nn.init.normal_, **_ROW)
    x = torch.randn(5, 3, 16)
    with pytest.raises(ValueError, match="has none: wrap the model in DistributedDataParallel"):
        layer(x)
    with torch.no_grad():
        layer(x)
    layer.weight.requires_grad_(False)
    x.requires_grad_(True)
    y, _ = layer(x)
    y.sum().backward()
    assert x.grad is not None and layer.weight.grad is None


@pytest.mark.parametrize(
    "layer_cls, kwargs", [(ColumnParallelLinear, {}), (RowParallelLinear, _ROW)]
)
def test_fp8_is_applied_and_close_to_high_precision(layer_cls, kwargs):
    fp8_layer, x8, y8, _ = _run(layer_cls, _config(), **kwargs)
    hp_layer, x, y, _ = _run(layer_cls, _config(fp8=None), **kwargs)
    for fp8, hp in [(y8, y), (x8.grad, x.grad), (fp8_layer.weight.grad, hp_layer.weight.grad)]:
        error = float((fp8 - hp).norm() / hp.norm())
        assert 1e-3 < error < 0.1, error


def test_zero_input_gives_zero_output_and_finite_gradients():
    config = _config()
    layer = ColumnParallelLinear(16, 8, config=config, init_method=torch.nn.init.normal_)
    x = torch.zeros(4, 1, 16, requires_grad=True)
    y, _ = layer(x)
    y.sum().backward()
    assert not y.any() and torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
    assert scaling.scale_from_amax(torch.tensor(0.0), E4M3, 0) == 1


def test_scale_is_fp8_max_over_amax_over_two_to_the_margin():
    amax = torch.tensor(3.5)
    assert scaling.scale_from_amax(amax, E4M3, 1) == torch.tensor(448.0) / 3.5 / 2
    assert scaling.scale_from_amax(amax, E5M2, 0) == torch.tensor(57344.0) / 3.5


def test_the_gpt_output_layer_stays_in_high_precision():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _config(num_layers=1, hidden_size=16, num_attention_heads=2)
    gpt = GPTModel(config, get_gpt_layer_local_spec(), 32, 8)
    assert gpt.output_layer.fp8_gemm is None
    assert gpt.decoder.layers[0].mlp.linear_fc1.fp8_gemm.fmt == "hybrid"


def test_padding_to_multiples_of_16_changes_no_product():
    """The CUDA path pads inner and output sizes to multiples of 16 with zeros: the product
    (forced on the CPU) is that of the unpadded GEMM, contiguous, in its shape."""
    torch.manual_seed(1)
    a, b = torch.randn(7, 24).to(E4M3), torch.randn(24, 40).to(E4M3)
    scale = torch.tensor(2.0)
    plain = scaling.scaled_mm(a, b, scale, scale, torch.float32, pad=False)
    padded = scaling.scaled_mm(a, b, scale, scale, torch.float32, pad=True)
    assert padded.shape == (7, 40) and padded.is_contiguous()
    torch.testing.assert_close(padded, plain, rtol=0, atol=0)
    torch.testing.assert_close(plain, (a.float() / 2) @ (b.float() / 2))


def test_the_cpu_product_is_scaled_mm_s_without_its_reference_loop(monkeypatch):
    """On the CPU ``scaled_mm`` gives torch._scaled_mm's numbers without calling it (its CPU
    kernel is a reference loop: 24 s for 512 x 256 x 1024, the emulation 9 ms)."""
    torch.manual_seed(2)
    a, b = torch.randn(9, 32).to(E4M3), torch.randn(32, 20).to(E5M2)
    s_a, s_b = torch.tensor(3.0), torch.tensor(0.25)
    expected = torch._scaled_mm(
        a, b, scale_a=s_a.reciprocal(), scale_b=s_b.reciprocal(), out_dtype=torch.float32
    )

    def refuse(*args, **kwargs):
        raise AssertionError("torch._scaled_mm called on the CPU")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    got = scaling.scaled_mm(a, b, s_a, s_b, torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # torch.compile on the CPU: ~10 s
def test_a_compiled_fp8_linear_hands_its_weight_gradient_to_the_hook():
    """Traced by ``torch.compile`` (the trainer's ``--compile`` traces FP8 linears), the FP8
    linear with gradient-accumulation fusion returns the weight gradient (DDP's hook adds it
    into ``main_grad``: a traced backward may not write it) and leaves ``main_grad`` alone;
    the gradients equal the eager FP8 linear's."""
    import torch._dynamo

    torch._dynamo.reset()
    eager, x_eager, _, _ = _run(RowParallelLinear, _config(), **_ROW)
    torch.manual_seed(0)
    layer = RowParallelLinear(
        16, 24, config=_config(gradient_accumulation_fusion=True),
        init_method=torch.nn.init.normal_, **_ROW,
    )  # fmt: skip
    layer.weight.main_grad = torch.zeros_like(layer.weight)
    x = torch.randn(5, 3, 16, requires_grad=True)
    g = torch.randn(5, 3, 24)  # as _run draws it
    explain = torch._dynamo.explain(lambda t: layer(t)[0])(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    y = torch.compile(lambda t: layer(t)[0])(x)
    y.backward(g)
    assert torch.equal(layer.weight.main_grad, torch.zeros_like(layer.weight))
    torch.testing.assert_close(layer.weight.grad, eager.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_eager.grad, rtol=0, atol=0)


@pytest.mark.slow
def test_the_compiled_casts_compile_once_per_call_shape_not_per_weight(monkeypatch):
    """On CUDA an eager FP8 linear's casts are one compiled graph (``scaling.operands``);
    dynamo guarded on each weight's static shape, requires_grad, a view's base and the grad
    mode, so an eager FP8 model reached the recompile limit (8) and ran uncompiled. Here the
    compiled path on the CPU (a counting backend): linears of 6 weight shapes, forward and
    backward, twice: at most 3 graphs per kind of call (static, then each dim dynamic)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    torch._dynamo.reset()
    monkeypatch.setattr(
        scaling, "_fused_operands", torch.compile(scaling._operands, backend=counter)
    )
    monkeypatch.setattr(scaling, "_compiled_here", lambda t: not torch.compiler.is_compiling())
    config = _config()
    try:
        for _ in range(2):
            for n_in, n_out in ((16, 24), (16, 48), (24, 16), (48, 16), (16, 40), (40, 16)):
                layer = ColumnParallelLinear(
                    n_in, n_out, config=config, init_method=torch.nn.init.normal_
                )
                layer(torch.randn(5, 3, n_in, requires_grad=True))[0].sum().backward()
    finally:
        torch._dynamo.reset()
    # 3 a kind: static, then each dim dynamic; at least 1: the path still reaches the function
    assert 1 <= counter.frame_count <= 6, f"{counter.frame_count} compilations"
