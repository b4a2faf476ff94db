"""Linear and embedding layers that allocate their parameters without initializing them.

The model fills every parameter from its own seeded generator afterwards, so construction
must neither spend time on a throw-away initialization nor draw from the global RNG.
"""

import torch
from torch import nn

from megatron.core.transformer.grad_accumulation_fusion import (
    linear_with_grad_accumulation_fusion,
)


class NoInitLinear(nn.Linear):
    """``nn.Linear`` whose parameters are left as allocated (``torch.empty``).

    With ``gradient_accumulation_fusion`` the weight gradient of a training forward goes
    straight into ``weight.main_grad`` (see ``grad_accumulation_fusion``).
    """

    def __init__(self, *args, gradient_accumulation_fusion: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gradient_accumulation_fusion = gradient_accumulation_fusion

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """x W^T + b."""
        if (
            self.gradient_accumulation_fusion
            and torch.is_grad_enabled()
            and self.weight.requires_grad
        ):
            return linear_with_grad_accumulation_fusion(input, self.weight, self.bias)
        return super().forward(input)

    def reset_parameters(self) -> None:
        """No-op: the owning model initializes the parameters."""


class NoInitEmbedding(nn.Embedding):
    """``nn.Embedding`` whose weight is left as allocated (``torch.empty``)."""

    def reset_parameters(self) -> None:
        """No-op: the owning model initializes the weight."""
