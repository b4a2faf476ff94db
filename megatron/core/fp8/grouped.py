"""FP8 GEMMs of a MoE layer's local experts: y_i = x_i W_i^T for the rows x_i routed to local
expert i, one autograd node for all of them, so that each direction needs ONE amax
collective whatever the token counts (an expert with no tokens still takes part).

Each expert's tensors get their own tensorwise scales from their global amaxes: a
[tensors, E] matrix (column = global expert index, zero elsewhere) MAX-reduced over the
``tp_cp`` group, the ranks holding the shards of one micro-batch. The experts' tokens of a
micro-batch are spread over (or gathered within) that group only when the expert groups
(expert TP x EP) lie inside it, which ``megatron.core.fp8.config`` requires; then the amaxes,
the FP8 operands and the result are those of one process. Written by hand: megatron-core's
FP8 experts come from Transformer Engine (not available); ``torch._scaled_grouped_mm`` takes
rowwise scales only on CUDA, so each expert is one ``torch._scaled_mm``.
"""

from dataclasses import dataclass
from typing import Any, List, Sequence

import torch

from megatron.core.fp8 import scaling


@dataclass(frozen=True)
class Fp8Experts:
    """The local experts' FP8 settings: format, margin, FP8 weight gradient, the amax group
    (``tp_cp``), the global index of local expert 0 and the number of experts."""

    fmt: str
    margin: int
    wgrad: bool
    group: Any
    first_expert: int
    num_experts: int

    @classmethod
    def from_config(cls, config: Any, group: Any, first_expert: int):
        """None without ``config.fp8``."""
        if getattr(config, "fp8", None) is None:
            return None
        return cls(
            config.fp8,
            config.fp8_margin,
            config.fp8_wgrad,
            group,
            first_expert,
            config.num_moe_experts,
        )

    def global_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """[k, E_local] local amaxes -> the same entries MAX-reduced over ``group``."""
        local = amax.shape[1]
        full = amax.new_zeros(amax.shape[0], self.num_experts)
        full[:, self.first_expert : self.first_expert + local] = amax
        reduced = scaling.reduce_amax(full, (self.group,))
        return reduced[:, self.first_expert : self.first_expert + local]


def fp8_grouped_linear(
    x: torch.Tensor, sizes: Sequence[int], weights: List[torch.Tensor], experts: Fp8Experts
) -> torch.Tensor:
    """[sum(sizes), in] rows grouped by local expert -> [sum(sizes), out], expert i's rows
    times W_i^T (``weights[i]`` [out, in]) in FP8."""
    return Fp8GroupedLinearFunction.apply(x, tuple(int(n) for n in sizes), experts, *weights)


class Fp8GroupedLinearFunction(torch.autograd.Function):
    """Autograd of ``fp8_grouped_linear`` (the dense linear's math per expert: e4m3 forward,
    gradients in e5m2 for "hybrid", ``wgrad`` False: dL/dW_i in high precision)."""

    @staticmethod
    def forward(ctx, x, sizes, experts, *weights):
        """y_i = (x_i,q / s_x,i) (W_i,q / s_w,i)^T."""
        fwd, _ = scaling.fp8_dtypes(experts.fmt)
        xs = torch.split(x, sizes)
        amax = torch.stack(
            [
                torch.stack([scaling.local_amax(t) for t in xs]),
                torch.stack([scaling.local_amax(w) for w in weights]),
            ]
        )
        scales = scaling.scale_from_amax(experts.global_amax(amax), fwd, experts.margin)
        q_x = [scaling.quantize(t, s, fwd) for t, s in zip(xs, scales[0])]
        q_w = [scaling.quantize(w, s, fwd) for w, s in zip(weights, scales[1])]
        outs = [
            _mm(a, b.t(), sa, sb, x.dtype) for a, b, sa, sb in zip(q_x, q_w, scales[0], scales[1])
        ]
        saved_x = q_x if experts.wgrad else xs  # the FP8 or the high-precision X, not both
        ctx.save_for_backward(scales, *saved_x, *q_w)
        ctx.sizes, ctx.experts, ctx.dtypes = sizes, experts, (x.dtype, weights[0].dtype)
        return torch.cat(outs) if outs else x.new_zeros(0, 0)

    @staticmethod
    def backward(ctx, grad_output):
        """dL/dx_i = G_i W_i, dL/dW_i = G_i^T x_i."""
        experts, n = ctx.experts, len(ctx.sizes)
        scales, *saved = ctx.saved_tensors
        saved_x, q_w = saved[:n], saved[n:]  # the FP8 X with ``wgrad``, else the high one
        _, grad_dtype = scaling.fp8_dtypes(experts.fmt)
        gs = torch.split(grad_output, ctx.sizes)
        amax = torch.stack([scaling.local_amax(g) for g in gs]).reshape(1, n)
        s_g = scaling.scale_from_amax(experts.global_amax(amax), grad_dtype, experts.margin)[0]
        q_g = [scaling.quantize(g, s, grad_dtype) for g, s in zip(gs, s_g)]
        x_dtype, w_dtype = ctx.dtypes
        grad_x = torch.cat(
            [_mm(g, _cols(w), sg, sw, x_dtype) for g, w, sg, sw in zip(q_g, q_w, s_g, scales[1])]
        )
        if experts.wgrad:
            grad_w = [
                _mm(_cols(g).t(), _cols(xq), sg, sx, w_dtype)
                for g, xq, sg, sx in zip(q_g, saved_x, s_g, scales[0])
            ]
        else:
            grad_w = [g.t().matmul(xh).to(w_dtype) for g, xh in zip(gs, saved_x)]
        return (grad_x, None, None, *grad_w)


def _mm(a, b, a_scale, b_scale, out_dtype) -> torch.Tensor:
    """``scaling.scaled_mm``, also for an expert with no tokens (an empty or zero product)."""
    if a.shape[0] == 0 or a.shape[1] == 0:
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    return scaling.scaled_mm(a, b, a_scale, b_scale, out_dtype)


def _cols(q: torch.Tensor) -> torch.Tensor:
    """A 2-D FP8 tensor as the column-major operand ``scaled_mm`` takes without a copy."""
    return scaling.transposed(q).t() if q.numel() else q
