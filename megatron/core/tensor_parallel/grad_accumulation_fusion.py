"""Linear layers whose weight gradient is added straight into ``weight.main_grad``.

``config.gradient_accumulation_fusion`` (megatron-core's flag): instead of autograd writing
``dL/dW`` into ``weight.grad`` and the DDP hook adding it into the (fp32) ``main_grad``,
the backward computes ``main_grad += g^T x`` in one GEMM, reading and writing
``main_grad`` once. DDP still sees its hook fire (a placeholder gradient, never read) and
skips the add because ``weight.grad_added_to_main_grad`` is set.
"""

import functools
from typing import Optional

import torch
import torch.nn.functional as F


def linear_with_grad_accumulation_fusion(
    input: torch.Tensor, weight: torch.nn.Parameter, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """``y = x W^T + b``; the backward adds ``dL/dW = g^T x`` into ``weight.main_grad``.

    ``weight.main_grad`` must exist (``DistributedDataParallel`` attaches it), and the weight
    must receive its gradient from this call only (the placeholder gradient is discarded).
    """
    require_main_grad(weight)
    return _LinearAccumulatingIntoMainGrad.apply(input, weight, bias)


def require_main_grad(weight: torch.Tensor) -> None:
    """gradient_accumulation_fusion adds into ``weight.main_grad``: it must exist."""
    if not hasattr(weight, "main_grad"):
        raise ValueError(
            "config.gradient_accumulation_fusion=True adds weight gradients into "
            f"param.main_grad, but a weight of shape {tuple(weight.shape)} has none: wrap "
            "the model in DistributedDataParallel (which attaches main_grad) or set "
            "gradient_accumulation_fusion=False"
        )


def accumulate_weight_grad(main_grad: torch.Tensor, grad: torch.Tensor, x: torch.Tensor) -> None:
    """``main_grad += grad^T x`` for 2-D ``grad`` [n, out] and ``x`` [n, in].

    One GEMM accumulating in ``main_grad``'s precision: in place when the dtypes match,
    through ``out_dtype`` for half-precision inputs on CUDA, else on upcast copies.
    """
    if grad.dtype == main_grad.dtype:
        main_grad.addmm_(grad.t(), x)
    elif main_grad.is_cuda and _half_into_fp32_gemm_supported():
        torch.addmm(main_grad, grad.t(), x, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.addmm_(grad.t().to(main_grad.dtype), x.to(main_grad.dtype))


class _LinearAccumulatingIntoMainGrad(torch.autograd.Function):
    """Autograd of ``F.linear`` with the weight gradient accumulated into ``main_grad``."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        """y = x W^T + b."""
        ctx.save_for_backward(input, weight)
        ctx.has_bias = bias is not None
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        """dL/dx = g W; main_grad += g^T x; dL/db = sum of g over tokens."""
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        accumulate_weight_grad(weight.main_grad, grad_2d, input.reshape(-1, input.shape[-1]))
        weight.grad_added_to_main_grad = True
        placeholder = torch.empty_like(weight)  # fires DDP's hook; never read
        grad_bias = grad_2d.sum(dim=0) if ctx.has_bias else None
        return grad_input, placeholder, grad_bias


@functools.lru_cache(maxsize=None)
def _half_into_fp32_gemm_supported() -> bool:
    """Whether ``torch.addmm`` takes ``out_dtype`` (bf16 inputs, fp32 output); asked once,
    on first use, on the current CUDA device."""
    try:
        a = torch.ones(2, 2, device="cuda", dtype=torch.bfloat16)
        out = torch.zeros(2, 2, device="cuda", dtype=torch.float32)
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
    except (TypeError, RuntimeError):
        return False
    return True
