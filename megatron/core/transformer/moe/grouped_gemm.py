"""When the routed experts' products run as one grouped GEMM (``torch._grouped_mm``) instead
of one product per expert: the rule the experts (``experts.py``) and their LoRA adapters
(``expert_lora.py``) share."""

import torch


def use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """One grouped GEMM on CUDA for bf16 (``torch._grouped_mm``), else a loop."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
    )
