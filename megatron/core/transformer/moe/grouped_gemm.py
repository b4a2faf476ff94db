"""What the routed experts (``experts.py``) and their LoRA adapters (``expert_lora.py``) share
to compute per-expert products: when they run as one grouped GEMM (``torch._grouped_mm``)
instead of one product per expert, the rows grouped by expert (``ExpertRows``, built once per
forward) and the product itself (``grouped_linear``)."""

from typing import List, Optional, Sequence, Union

import torch


def use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """One grouped GEMM on CUDA for bf16 (``torch._grouped_mm``), else a loop."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
    )


class ExpertRows:
    """Rows grouped by local expert (``tokens_per_expert`` [E_local] rows each, in order):
    ``sizes`` on the host (one synchronization, for the loops), ``counts`` and the grouped
    GEMM's cumulative int32 ``offsets`` on ``device``; each built once, when first read
    (plain attributes, not ``functools.cached_property``, whose lock ``torch.compile`` cannot
    trace: it split the grouped GEMM path's graph in three)."""

    def __init__(self, tokens_per_expert: torch.Tensor, device: torch.device) -> None:
        self.tokens_per_expert = tokens_per_expert
        self.device = device
        self._sizes: Optional[List[int]] = None
        self._counts: Optional[torch.Tensor] = None
        self._offsets: Optional[torch.Tensor] = None

    @property
    def sizes(self) -> List[int]:
        if self._sizes is None:
            self._sizes = [int(n) for n in self.tokens_per_expert.tolist()]
        return self._sizes

    @property
    def counts(self) -> torch.Tensor:
        if self._counts is None:
            self._counts = self.tokens_per_expert.to(self.device)
        return self._counts

    @property
    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            self._offsets = torch.cumsum(self.counts, 0).to(torch.int32)
        return self._offsets


def grouped_linear(
    x: torch.Tensor,
    weights: Union[torch.Tensor, Sequence[torch.Tensor]],
    rows: ExpertRows,
    grouped: bool,
) -> torch.Tensor:
    """The rows of expert i times ``weights[i]`` [in, out]: one ``torch._grouped_mm`` over the
    stacked [E_local, in, out] ``weights`` when ``grouped``, else one product per expert."""
    if grouped:
        return torch._grouped_mm(x, weights, offs=rows.offsets)
    parts = [xi @ w for xi, w in zip(torch.split(x, rows.sizes), weights)]
    if not parts:
        return x.new_zeros(x.shape[0], weights.shape[-1])
    return torch.cat(parts, dim=0)
