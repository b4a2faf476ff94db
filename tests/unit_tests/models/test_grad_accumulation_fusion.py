"""``gradient_accumulation_fusion``: weight gradients added by the GEMM into ``main_grad``.

One process: a fused linear layer inside our DDP gives the same ``main_grad`` as the
unfused layer over several microbatches (and the fp32 accumulation of bf16 inputs matches
a float64 reference to fp32 rounding); without DDP it names what is missing. The
distributed GPT parity matrix (test_gpt_parity.py, ``-fused`` cases) checks the fused model
against the dense reference under CP, PP, VPP and DP.
"""

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.grad_accumulation_fusion import (
    accumulate_weight_grad,
    linear_with_grad_accumulation_fusion,
)

pytestmark = [pytest.mark.world(1), pytest.mark.timeout(60)]

MICROBATCHES, TOKENS, IN, OUT = 3, 5, 6, 4


class FusableLinear(torch.nn.Linear):
    """``nn.Linear`` whose training forward goes through the fused GEMM when ``fusion``."""

    def __init__(self, *args, fusion: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fusion = fusion

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.fusion and torch.is_grad_enabled():
            return linear_with_grad_accumulation_fusion(input, self.weight, self.bias)
        return super().forward(input)


def _layer(fusion: bool, bias: bool = True) -> FusableLinear:
    """A seeded [IN -> OUT] layer, the same weights whatever ``fusion``."""
    layer = FusableLinear(IN, OUT, bias=bias, fusion=fusion)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return layer


def _train(layer: FusableLinear, overlap: bool = False) -> DistributedDataParallel:
    """M microbatches of forward/backward through our DDP (one process, no groups)."""
    config = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=1)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap
    )
    ddp = DistributedDataParallel(config, ddp_config, layer)
    ddp.zero_grad_buffer()
    gen = torch.Generator().manual_seed(1)
    for _ in range(MICROBATCHES):
        x = torch.randn(2, TOKENS, IN, generator=gen)
        (ddp(x) ** 2).sum().backward()
    return ddp


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_fused_main_grads_equal_the_unfused_ones(overlap: bool, bias: bool):
    fused, plain = _train(_layer(True, bias), overlap), _train(_layer(False, bias), overlap)
    for (name, f), p in zip(fused.module.named_parameters(), plain.module.parameters()):
        torch.testing.assert_close(f.main_grad, p.main_grad, rtol=1e-5, atol=1e-5, msg=name)
        assert f.grad is None, f"{name}: the placeholder gradient was left in .grad"
    assert fused.module.weight.main_grad.abs().sum() > 0


def test_fusion_accumulates_into_main_grad_not_grad():
    """The weight's gradient never passes through ``.grad``: main_grad changes during the
    backward, before DDP's hook could add anything."""
    layer = _layer(True)
    layer.weight.main_grad = torch.zeros(OUT, IN)
    x = torch.randn(TOKENS, IN)
    layer(x).sum().backward()
    expected = torch.ones(TOKENS, OUT).t() @ x
    torch.testing.assert_close(layer.weight.main_grad, expected)
    assert layer.weight.grad_added_to_main_grad


def test_bf16_inputs_accumulate_in_fp32():
    """main_grad (fp32) += g^T x for bf16 g, x: equal to the float64 product of the same
    bf16 values, to fp32 rounding (not to bf16 rounding)."""
    gen = torch.Generator().manual_seed(2)
    grad = torch.randn(64, OUT, generator=gen).bfloat16()
    x = torch.randn(64, IN, generator=gen).bfloat16()
    main_grad = torch.full((OUT, IN), 0.25)
    accumulate_weight_grad(main_grad, grad, x)
    expected = 0.25 + grad.double().t() @ x.double()
    torch.testing.assert_close(main_grad.double(), expected, rtol=1e-6, atol=1e-6)


def test_fusion_without_main_grad_names_what_is_missing():
    """Through the layer and through the function: the flag, the weight, the fix."""
    layer = _layer(True)
    with pytest.raises(ValueError, match=r"gradient_accumulation_fusion=True .*shape \(4, 6\)"):
        layer(torch.randn(TOKENS, IN))
    weight = torch.nn.Parameter(torch.ones(2, 3))
    with pytest.raises(ValueError, match="wrap the model in DistributedDataParallel"):
        linear_with_grad_accumulation_fusion(torch.ones(1, 3), weight, None)


def test_fusion_is_off_without_autograd():
    """Evaluation (no_grad) needs no main_grad: a plain linear layer."""
    layer = _layer(True)
    with torch.no_grad():
        out = layer(torch.ones(TOKENS, IN))
    torch.testing.assert_close(out, _layer(False)(torch.ones(TOKENS, IN)).detach())


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (H200 run: results/fusion_and_counts_cuda_h200.log)",
)
def test_cuda_bf16_gemm_accumulates_into_fp32_main_grad():
    """On CUDA, bf16 g and x go through one GEMM with fp32 output (``out_dtype``), added
    into the fp32 main_grad in place: float64 result of the same bf16 values to fp32
    rounding."""
    from megatron.core.tensor_parallel.grad_accumulation_fusion import (
        _half_into_fp32_gemm_supported,
    )

    assert _half_into_fp32_gemm_supported(), "torch.addmm(out_dtype=...) is unavailable"
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(256, OUT, generator=gen).bfloat16()
    x = torch.randn(256, IN, generator=gen).bfloat16()
    main_grad = torch.full((OUT, IN), 0.25, device="cuda")
    storage = main_grad.data_ptr()
    accumulate_weight_grad(main_grad, grad.cuda(), x.cuda())
    assert main_grad.data_ptr() == storage and main_grad.dtype == torch.float32
    expected = 0.25 + grad.double().t() @ x.double()
    torch.testing.assert_close(main_grad.cpu().double(), expected, rtol=1e-5, atol=1e-5)
