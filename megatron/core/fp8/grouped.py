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
e4m3 operands only (not "hybrid"'s e5m2 gradients), so each expert is one
``torch._scaled_mm`` (launch-bound on a GPU: docs/fp8.md "FP8 experts").
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
    gradients in e5m2 for "hybrid", ``wgrad`` False: dL/dW_i in high precision).

    The activations (X, and G in the backward) are cast as ONE tensor of rows, each row with
    its expert's scale (``scaling.cast_rows``; per-expert amaxes from the row maxima): the
    cast is bitwise the per-expert casts (the same float32 products), and its compiled
    kernel sees one tensor whose row count changes, not one tensor per expert (a list of 128
    tensors whose token counts change recompiled at every call, 15 s each, up to dynamo's
    limit). The per-expert GEMM operands are row slices of it; the transposes the weight
    gradient needs are taken per expert."""

    @staticmethod
    def forward(ctx, x, sizes, experts, n, *weights_and_kept):
        """y_i = (x_i,q / s_x,i) (W_i,q / s_w,i)^T."""
        fwd, _ = scaling.fp8_dtypes(experts.fmt)
        weights, kept = weights_and_kept[:n], weights_and_kept[n:]
        rows = _expert_of_rows(sizes, x.device)
        if kept:  # the weights' operands kept by the module: X's amaxes alone
            q_w, w_t, s_w = kept[:n], kept[n : 2 * n], kept[2 * n]
            amax_x = experts.global_amax(_row_amaxes(x, rows, n)[None])[0]
        else:  # X's and W's amaxes in one collective
            amax_x, amax_w = experts.global_amax(
                torch.stack([_row_amaxes(x, rows, n), _amaxes(weights)])
            )
            q_w, _, s_w = scaling.operands(weights, amax_w, fwd, experts.margin, experts=True)
            w_t = ()
        s_x = scaling.scale_from_amax(amax_x, fwd, experts.margin)
        q_x = torch.split(scaling.cast_rows(x, s_x, rows, fwd), sizes)
        outs = [_mm(a, b.t(), sa, sb, x.dtype) for a, b, sa, sb in zip(q_x, q_w, s_x, s_w)]
        saved_x = q_x if experts.wgrad else torch.split(x, sizes)  # FP8 or high precision
        ctx.save_for_backward(rows, s_x, s_w, *saved_x, *(w_t or q_w))
        ctx.sizes, ctx.experts, ctx.dtypes = sizes, experts, (x.dtype, weights[0].dtype)
        ctx.kept_transposes = bool(w_t)
        return torch.cat(outs) if outs else x.new_zeros(0, 0)

    @staticmethod
    def backward(ctx, grad_output):
        """dL/dx_i = G_i W_i, dL/dW_i = G_i^T x_i."""
        experts, sizes, n = ctx.experts, ctx.sizes, len(ctx.sizes)
        rows, s_x, s_w, *saved = ctx.saved_tensors
        saved_x, saved_w = saved[:n], saved[n:]  # X: FP8 with ``wgrad``; W^T if kept, else W
        _, grad_dtype = scaling.fp8_dtypes(experts.fmt)
        amax = experts.global_amax(_row_amaxes(grad_output, rows, n)[None])[0]
        s_g = scaling.scale_from_amax(amax, grad_dtype, experts.margin)
        q_g = torch.split(scaling.cast_rows(grad_output, s_g, rows, grad_dtype), sizes)
        w_t = saved_w if ctx.kept_transposes else [w.t().contiguous() for w in saved_w]
        x_dtype, w_dtype = ctx.dtypes
        grad_x = torch.cat(
            [_mm(g, wt.t(), sg, sw, x_dtype) for g, wt, sg, sw in zip(q_g, w_t, s_g, s_w)]
        )
        if experts.wgrad:
            grad_w = [
                _mm(g.t().contiguous(), xq, sg, sx, w_dtype)
                for g, xq, sg, sx in zip(q_g, saved_x, s_g, s_x)
            ]
        else:
            gs = torch.split(grad_output, sizes)
            grad_w = [g.t().matmul(xh).to(w_dtype) for g, xh in zip(gs, saved_x)]
        return (grad_x, None, None, None, *grad_w, *([None] * (len(ctx.needs_input_grad) - 4 - n)))


def _expert_of_rows(sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    """The local expert of each row (``sizes[i]`` rows of expert i, in order)."""
    counts = torch.tensor(sizes, dtype=torch.long).to(device, non_blocking=True)
    experts = torch.arange(len(sizes), device=device)
    return torch.repeat_interleave(experts, counts, output_size=sum(sizes))


def _row_amaxes(x: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """[n]: the max |x| over each expert's rows (0 for an expert with none): the maximum of
    its rows' maxima, exactly each expert's ``local_amax``."""
    out = torch.zeros(n, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return out
    row_max = torch.linalg.vector_norm(x.detach(), ord=float("inf"), dim=1).float()
    return out.scatter_reduce_(0, rows, row_max, reduce="amax")


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
