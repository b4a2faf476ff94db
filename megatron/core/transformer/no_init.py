"""Linear and embedding layers that allocate their parameters without initializing them.

The model fills every parameter from its own seeded generator afterwards, so construction
must neither spend time on a throw-away initialization nor draw from the global RNG.
"""

from torch import nn


class NoInitLinear(nn.Linear):
    """``nn.Linear`` whose parameters are left as allocated (``torch.empty``)."""

    def reset_parameters(self) -> None:
        """No-op: the owning model initializes the parameters."""


class NoInitEmbedding(nn.Embedding):
    """``nn.Embedding`` whose weight is left as allocated (``torch.empty``)."""

    def reset_parameters(self) -> None:
        """No-op: the owning model initializes the weight."""
