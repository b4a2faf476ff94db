"""The FP8 linear: Y = X W^T + b with the GEMMs in FP8 and every scale from the global amax.

Forward: X (all-gathered along dim 0 under sequence parallelism) and W are cast to e4m3 with
scales from their amaxes MAX-reduced over the TP group (W and a row-parallel X are split
along TP, a column-parallel output gradient too; a replicated tensor's MAX is itself) and the
context-parallel group (the sequence is split over CP), in one collective per group for both.
Backward: the output gradient G is cast (e5m2 for "hybrid", e4m3 for "e4m3") with its global
amax; dL/dX = G W from the FP8 G and W; dL/dW = G^T X from the FP8 G and X (``fp8_wgrad``;
else in the input's precision from the saved high-precision X); dL/db = sum of G in high
precision. The communication of dL/dX is that of the high-precision linear
(``tensor_parallel.layers``). Data parallelism splits no tensor of one GEMM (each replica
runs whole microbatches) and the weight is cast from the full model parameter after the
distributed optimizer's all-gather, so neither needs a reduction. A module that caches
(``fp8.cache``, ``is_first_microbatch`` not None) passes W's FP8 operands kept from the
step's first microbatch (``fp8_weight_operands``): then only X's amax is taken and reduced,
and the backward uses the kept FP8 W^T.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from megatron.core.communication import (
    all_gather_along_first_dim,
    start_all_reduce,
    start_reduce_scatter_along_first_dim,
)
from megatron.core.fp8 import scaling
from megatron.core.fp8.cache import cached_operands
from megatron.core.process_groups_config import resolve_group


@dataclass(frozen=True)
class Fp8Gemm:
    """What an FP8 GEMM needs: the format ("e4m3" | "hybrid"), ``margin``, ``wgrad`` (FP8
    weight gradient) and ``cp_group``, the group the activations' sequence is split over
    (None: ``parallel_state``'s CP group when initialized)."""

    fmt: str
    margin: int = 0
    wgrad: bool = True
    cp_group: Any = None

    @classmethod
    def from_config(cls, config: Any) -> Optional["Fp8Gemm"]:
        """The settings of ``config`` (a ``TransformerConfig``); None without FP8."""
        fmt = getattr(config, "fp8", None)
        if fmt is None:
            return None
        return cls(fmt, config.fp8_margin, config.fp8_wgrad)

    def activation_groups(self, tp_group: Any) -> Tuple[Any, Any]:
        """The groups an activation (or its gradient) of a TP layer is sharded across."""
        return tp_group, resolve_group("cp", self.cp_group)


def fp8_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    flags: Tuple[bool, bool, bool],
    tp_group: Any,
    gemm: Fp8Gemm,
    weight_operands: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """``linear_with_grad_accumulation_and_async_allreduce`` with FP8 GEMMs (module
    docstring): ``flags`` (gradient_accumulation_fusion, allreduce_dgrad,
    sequence_parallel) as the high-precision linear runs them (``tensor_parallel.layers.
    _linear_flags``: none of the communication on a group of one rank, the fusion only where
    ``weight.main_grad`` is to be written), ``tp_group`` resolved; ``weight_operands``: the
    weight's kept (FP8 W, FP8 W^T, scale) (``fp8_weight_operands``; None: cast here). The
    autograd function sees the input's rows ([s * b, h]: under sequence parallelism the
    all-gather along s is one along the rows); reshaped outside it, no symbolic size is an
    output of its traced forward (torch 2.11's dynamo specialized such a size to a constant
    and stopped with an AssertionError once a dimension was dynamic). Traced by
    ``torch.compile`` (the trainer's ``--compile``), the backward returns the weight gradient
    for DDP's hook to add into ``main_grad``, as without ``gradient_accumulation_fusion``: a
    traced autograd.Function may not write a tensor from outside its graph."""
    if flags[0] and torch.compiler.is_compiling():
        flags = (False, *flags[1:])
    q_w, w_t, s_w = weight_operands if weight_operands is not None else (None, None, None)
    rows = input.reshape(-1, input.shape[-1])
    out = Fp8LinearFunction.apply(rows, weight, bias, flags, tp_group, gemm, q_w, w_t, s_w)
    return out.view(-1, *input.shape[1:-1], weight.shape[0])  # dim 0 gathered under SP


def fp8_weight_operands(
    module: torch.nn.Module, weight: torch.Tensor, tp_group: Any, gemm: Fp8Gemm
) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``module``'s kept (FP8 W, FP8 W^T, scale) of its own ``weight`` (``fp8.cache``): None
    when it does not cache or ``weight`` is another tensor. The amax is MAX-reduced over TP
    alone (CP holds the same weight: its MAX changes nothing)."""
    if weight is not getattr(module, "weight", None):
        return None

    def fill():
        amax = scaling.reduce_amax(scaling.local_amax(weight).reshape(1), (tp_group,))
        dtype, _ = scaling.fp8_dtypes(gemm.fmt)
        (q_w,), (w_t,), scale = scaling.operands((weight,), amax, dtype, gemm.margin, (0,))
        return q_w, w_t, scale[0]

    return cached_operands(module, (weight,), fill)


class Fp8LinearFunction(torch.autograd.Function):
    """Autograd of ``fp8_linear`` (module docstring)."""

    @staticmethod
    def forward(ctx, input, weight, bias, flags, tp_group, gemm, q_w, w_t, s_w):
        """Y = (X_q / s_x) (W_q / s_w)^T + b (W's operands given, or cast here with X's)."""
        fusion, allreduce_dgrad, sequence_parallel = flags
        x2d = all_gather_along_first_dim(input, tp_group) if sequence_parallel else input
        groups = gemm.activation_groups(tp_group)
        fwd_dtype, _ = scaling.fp8_dtypes(gemm.fmt)
        if q_w is None:
            amax = torch.stack([scaling.local_amax(x2d), scaling.local_amax(weight)])
            amax = scaling.reduce_amax(amax, groups)
            (q_x, q_w), _, scales = scaling.operands((x2d, weight), amax, fwd_dtype, gemm.margin)
            s_x, s_w = scales.unbind()
        else:
            amax = scaling.reduce_amax(scaling.local_amax(x2d).reshape(1), groups)
            (q_x,), _, scales = scaling.operands((x2d,), amax, fwd_dtype, gemm.margin)
            s_x = scales[0]
        out = scaling.scaled_mm(q_x, q_w.t(), s_x, s_w, input.dtype, fast_accum=True)
        if bias is not None:
            out = out + bias
        high_x = None if gemm.wgrad or not ctx.needs_input_grad[1] else x2d
        fp8_wgrad = gemm.wgrad and ctx.needs_input_grad[1]  # else the FP8 X is not needed
        saved_w = (None, w_t) if w_t is not None else (q_w, None)  # W^T or W to transpose
        ctx.save_for_backward(q_x if fp8_wgrad else None, *saved_w, s_x, s_w, high_x, weight)
        ctx.flags, ctx.tp_group, ctx.gemm, ctx.has_bias = flags, tp_group, gemm, bias is not None
        ctx.input_dtype = input.dtype
        return out

    @staticmethod
    def backward(ctx, grad_output):
        """dL/dX, dL/dW, dL/db (module docstring)."""
        q_x, q_w, w_t, s_x, s_w, high_x, weight = ctx.saved_tensors
        fusion, allreduce_dgrad, sequence_parallel = ctx.flags
        gemm, group = ctx.gemm, ctx.tp_group
        _, grad_dtype = scaling.fp8_dtypes(gemm.fmt)
        amax = scaling.reduce_amax(
            scaling.local_amax(grad_output).reshape(1), gemm.activation_groups(group)
        )
        fp8_wgrad = ctx.needs_input_grad[1] and high_x is None
        (q_g,), transposes, s_g = scaling.operands(
            (grad_output,),
            amax,
            grad_dtype,
            gemm.margin,
            transposed_too=(0,) if fp8_wgrad else (),
            fp8_to_transpose=[t for t in (q_w, q_x if fp8_wgrad else None) if t is not None],
        )
        s_g = s_g[0]
        rest = iter(transposes)  # G^T (fp8_wgrad), W^T (not kept), X^T (fp8_wgrad)
        q_g_t = next(rest) if fp8_wgrad else None
        w_t = next(rest) if w_t is None else w_t
        x_t = next(rest) if fp8_wgrad else None
        grad_input = scaling.scaled_mm(q_g, w_t.t(), s_g, s_w, ctx.input_dtype)
        pending = None
        if allreduce_dgrad:
            pending = start_all_reduce(grad_input, group, overwrite_input=True)
        elif sequence_parallel:
            pending = start_reduce_scatter_along_first_dim(grad_input, group, overwrite_input=True)
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = _weight_grad(q_g_t, s_g, grad_output, x_t, s_x, high_x, weight, fusion)
        if ctx.has_bias:
            grad_bias = grad_output.sum(dim=0)
        if pending is not None:
            grad_input = pending.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def _weight_grad(q_g_t, s_g, g2d, x_t, s_x, high_x, weight, fusion) -> torch.Tensor:
    """G^T X in FP8 (``high_x`` None; ``q_g_t``, ``x_t``: FP8 G^T and X^T, row-major) or in
    high precision; added into ``main_grad`` with ``fusion`` (then the returned tensor only
    fires DDP's hook)."""
    out_dtype = weight.main_grad.dtype if fusion else weight.dtype
    if high_x is None:
        grad = scaling.scaled_mm(q_g_t, x_t.t(), s_g, s_x, out_dtype)
    else:
        grad = g2d.t().matmul(high_x).to(out_dtype)
    if not fusion:
        return grad
    weight.main_grad.add_(grad)
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)


def bind_cp_group(module: torch.nn.Module, cp_group: Any) -> None:
    """Give every FP8 linear under ``module`` the model's context-parallel group (a model
    built with an explicit ``pg_collection`` does not use ``parallel_state``'s)."""
    for sub in module.modules():
        gemm = getattr(sub, "fp8_gemm", None)
        if isinstance(gemm, Fp8Gemm):
            sub.fp8_gemm = dataclasses.replace(gemm, cp_group=cp_group)
