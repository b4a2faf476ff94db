"""What the routed experts (``experts.py``) and their LoRA adapters (``expert_lora.py``) share
to compute per-expert products: when they run as one grouped GEMM (``torch._grouped_mm``)
instead of one product per expert, the rows grouped by expert (``ExpertRows``, built once per
forward) and the product itself (``grouped_linear``)."""

import functools
from typing import List, Sequence, Union

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
    GEMM's cumulative int32 ``offsets`` on ``device``; each built once, when first read."""

    def __init__(self, tokens_per_expert: torch.Tensor, device: torch.device) -> None:
        self.tokens_per_expert = tokens_per_expert
        self.device = device

    @functools.cached_property
    def sizes(self) -> List[int]:
        return [int(n) for n in self.tokens_per_expert.tolist()]

    @functools.cached_property
    def counts(self) -> torch.Tensor:
        return self.tokens_per_expert.to(self.device)

    @functools.cached_property
    def offsets(self) -> torch.Tensor:
        return torch.cumsum(self.counts, 0).to(torch.int32)


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
