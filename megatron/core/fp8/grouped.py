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
from typing import Any, List, Optional, Sequence, Tuple

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
    x: torch.Tensor,
    sizes: Sequence[int],
    weights: List[torch.Tensor],
    experts: Fp8Experts,
    weight_operands: Optional[Tuple] = None,
) -> torch.Tensor:
    """[sum(sizes), in] rows grouped by local expert -> [sum(sizes), out], expert i's rows
    times W_i^T (``weights[i]`` [out, in]) in FP8; ``weight_operands``: the weights' kept
    (FP8 W_i, FP8 W_i^T, scales) (``expert_weight_operands``; None: cast here)."""
    kept = (
        ()
        if weight_operands is None
        else (*weight_operands[0], *weight_operands[1], weight_operands[2])
    )
    sizes = tuple(int(n) for n in sizes)
    return Fp8GroupedLinearFunction.apply(x, sizes, experts, len(weights), *weights, *kept)


def expert_weight_operands(weights: Sequence[torch.Tensor], experts: Fp8Experts) -> Tuple:
    """(FP8 W_i, FP8 W_i^T, the [E_local] scales) of the local experts' ``weights``, amaxes
    MAX-reduced over ``experts.group`` (what the forward would compute)."""
    return expert_weights_operands([weights], experts)[0]


def expert_weights_operands(
    weight_lists: Sequence[Sequence[torch.Tensor]], experts: Fp8Experts
) -> List[Tuple]:
    """``expert_weight_operands`` of each list (fc1's, fc2's), the amaxes of all of them
    MAX-reduced in one collective."""
    fwd, _ = scaling.fp8_dtypes(experts.fmt)
    operands = []
    for weights, amax in zip(weight_lists, _global_amaxes(experts, *weight_lists)):
        n = len(weights)
        q_w, w_t, scales = scaling.operands(
            weights, amax, fwd, experts.margin, tuple(range(n)), experts=True
        )
        operands.append((tuple(q_w), tuple(w_t), scales))
    return operands


class Fp8GroupedLinearFunction(torch.autograd.Function):
    """Autograd of ``fp8_grouped_linear`` (the dense linear's math per expert: e4m3 forward,
    gradients in e5m2 for "hybrid", ``wgrad`` False: dL/dW_i in high precision)."""

    @staticmethod
    def forward(ctx, x, sizes, experts, n, *weights_and_kept):
        """y_i = (x_i,q / s_x,i) (W_i,q / s_w,i)^T."""
        fwd, _ = scaling.fp8_dtypes(experts.fmt)
        weights, kept = weights_and_kept[:n], weights_and_kept[n:]
        xs = torch.split(x, sizes)
        if kept:  # the weights' operands kept by the module: X's amaxes alone
            q_w, w_t, s_w = kept[:n], kept[n : 2 * n], kept[2 * n]
            amax = _global_amaxes(experts, xs)[0]
            q_x, _, s_x = scaling.operands(xs, amax, fwd, experts.margin, experts=True)
        else:  # X's and W's amaxes in one collective
            amax = _global_amaxes(experts, xs, weights).reshape(2 * n)
            casts, _, scales = scaling.operands(
                (*xs, *weights), amax, fwd, experts.margin, experts=True
            )
            q_x, q_w, w_t, (s_x, s_w) = casts[:n], casts[n:], (), scales.reshape(2, n)
        outs = [_mm(a, b.t(), sa, sb, x.dtype) for a, b, sa, sb in zip(q_x, q_w, s_x, s_w)]
        saved_x = q_x if experts.wgrad else xs  # the FP8 or the high-precision X, not both
        ctx.save_for_backward(s_x, s_w, *saved_x, *(w_t or q_w))
        ctx.sizes, ctx.experts, ctx.dtypes = sizes, experts, (x.dtype, weights[0].dtype)
        ctx.kept_transposes = bool(w_t)
        return torch.cat(outs) if outs else x.new_zeros(0, 0)

    @staticmethod
    def backward(ctx, grad_output):
        """dL/dx_i = G_i W_i, dL/dW_i = G_i^T x_i."""
        experts, n = ctx.experts, len(ctx.sizes)
        s_x, s_w, *saved = ctx.saved_tensors
        saved_x, saved_w = saved[:n], saved[n:]  # X: FP8 with ``wgrad``; W^T if kept, else W
        _, grad_dtype = scaling.fp8_dtypes(experts.fmt)
        gs = torch.split(grad_output, ctx.sizes)
        amax = _global_amaxes(experts, gs)[0]
        to_transpose = ([] if ctx.kept_transposes else list(saved_w)) + (
            list(saved_x) if experts.wgrad else []
        )
        q_g, transposes, s_g = scaling.operands(
            gs,
            amax,
            grad_dtype,
            experts.margin,
            transposed_too=tuple(range(n)) if experts.wgrad else (),
            fp8_to_transpose=to_transpose,
            experts=True,
        )
        rest = iter(transposes)  # G_i^T (wgrad), W_i^T (not kept), X_i^T (wgrad)
        g_t = [next(rest) for _ in range(n)] if experts.wgrad else None
        w_t = saved_w if ctx.kept_transposes else [next(rest) for _ in range(n)]
        x_dtype, w_dtype = ctx.dtypes
        grad_x = torch.cat(
            [_mm(g, wt.t(), sg, sw, x_dtype) for g, wt, sg, sw in zip(q_g, w_t, s_g, s_w)]
        )
        if experts.wgrad:
            x_t = [next(rest) for _ in range(n)]
            grad_w = [
                _mm(gt, xt.t(), sg, sx, w_dtype) for gt, xt, sg, sx in zip(g_t, x_t, s_g, s_x)
            ]
        else:
            grad_w = [g.t().matmul(xh).to(w_dtype) for g, xh in zip(gs, saved_x)]
        return (grad_x, None, None, None, *grad_w, *([None] * (len(ctx.needs_input_grad) - 4 - n)))


def _global_amaxes(experts: Fp8Experts, *groups: Sequence[torch.Tensor]) -> torch.Tensor:
    """[len(groups), E_local]: each group's (one tensor per local expert) amaxes, MAX-reduced
    over ``experts.group`` in one collective (row k: group k)."""
    return experts.global_amax(torch.stack([_amaxes(tensors) for tensors in groups]))


def _amaxes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The local amax of each tensor, a float32 vector."""
    return torch.stack([scaling.local_amax(t) for t in tensors])


def _mm(a, b, a_scale, b_scale, out_dtype) -> torch.Tensor:
    """``scaling.scaled_mm``, also for an expert with no tokens (an empty or zero product)."""
    if a.shape[0] == 0 or a.shape[1] == 0:
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    return scaling.scaled_mm(a, b, a_scale, b_scale, out_dtype)
