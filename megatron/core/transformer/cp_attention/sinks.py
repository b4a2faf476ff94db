"""Attention sinks: a per-head logit ``sink_h`` in the softmax denominator (GPT-OSS).

softmax'_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij)), so with the merged output O and
log-sum-exp L of plain attention: O' = O sigmoid(L - sink) and L' = logaddexp(L, sink),
exactly. The sink joins the merged LSE once, after every block (every CP rank's keys) has
been merged, not per block. The kernels' backward rebuilds P' = exp(s - L') and
D' = rowsum(dO * O'), so given (O', L') it gives exactly the sink attention's dQ, dK, dV;
the sink's own gradient is -sum_i exp(sink - L'_i) D'_i (over this rank's queries; a CP
rank's share, summed with the other ranks' by the data-parallel reduction as for every
weight).
"""

from typing import Optional

import torch


def sink_forward(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> tuple:
    """(O', L') of ``out`` [s, b, n, d] and ``lse`` [b, n, s] with ``sink`` [n] (new tensors;
    rows without keys get O' = 0, L' = sink)."""
    s = sink.detach().to(lse.dtype).view(1, -1, 1)
    weight = torch.sigmoid(lse - s)  # lse = -inf: 0
    scaled = out * weight.permute(2, 0, 1).unsqueeze(-1).to(out.dtype)
    return scaled, torch.logaddexp(lse, s)


def sink_grad(
    grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """d loss / d sink [n] from dO' and O' [s, b, n, d] and L' [b, n, s] (None: no sink)."""
    if sink is None:
        return None
    d = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # [s, b, n]
    p = torch.exp(sink.detach().to(lse.dtype).view(1, -1, 1) - lse)  # [b, n, s]
    return -(p * d.permute(1, 2, 0)).sum(dim=(0, 2)).to(sink.dtype)


def heads_share(sink: Optional[torch.Tensor], rank: int, size: int) -> Optional[torch.Tensor]:
    """The sinks of heads n/size * rank .. n/size * (rank + 1) (a2a's head split), as a
    differentiable slice (its gradient lands in those heads only)."""
    if sink is None or size == 1:
        return sink
    share = sink.shape[0] // size
    return sink[rank * share : (rank + 1) * share]
