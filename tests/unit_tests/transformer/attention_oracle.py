"""The test oracle for core attention: an explicit score matrix, float64, whole sequence.

Written without the kernels or the CP code under test. ``reference_attention`` is the
reference every CP attention test compares against.
"""

import math
from typing import Optional, Sequence

import torch


def explicit_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """softmax(scale * Q K^T, restricted to ``allowed``) V on [b, n, s, d] tensors.

    ``allowed`` is a boolean [s_q, s_k] mask; half-precision scores use a float32 softmax.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    softmax_dtype = torch.float32 if scores.element_size() < 4 else scores.dtype
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(value.dtype)
    return torch.matmul(probs, value)


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: Optional[Sequence[int]] = None,
    cu_seqlens_padded: Optional[Sequence[int]] = None,
    softmax_scale: Optional[float] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of whole [s, b, np, d] / [s, b, ng, d] sequences, natural order.

    With document offsets: position i sees j <= i of its own padded document only; rows at or
    past a document's real length, and rows after the last document, are 0. With ``window``:
    only j >= i - window as well (sliding-window attention).
    """
    s = query.shape[0]
    rep = query.shape[2] // key.shape[2]
    q = query.permute(1, 2, 0, 3)
    k = key.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
    v = value.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
    pos = torch.arange(s)
    allowed = pos.unsqueeze(0) <= pos.unsqueeze(1)
    if window is not None:
        allowed = allowed & (pos.unsqueeze(1) - pos.unsqueeze(0) <= window)
    valid = torch.ones(s, dtype=torch.bool)
    if cu_seqlens is not None:
        padded = list(cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens)
        real = list(cu_seqlens)
        doc = torch.full((s,), -1)
        valid = torch.zeros(s, dtype=torch.bool)
        for i in range(len(padded) - 1):
            doc[padded[i] : padded[i + 1]] = i
            valid[padded[i] : padded[i] + real[i + 1] - real[i]] = True
        allowed = allowed & (doc.unsqueeze(0) == doc.unsqueeze(1)) & (doc >= 0).unsqueeze(1)
        allowed = allowed | ~valid.unsqueeze(1)  # padding rows: anything finite, zeroed below
    out = explicit_causal_attention(q, k, v, allowed, softmax_scale).permute(2, 0, 1, 3)
    return out * valid.view(s, 1, 1, 1).to(out.dtype)
