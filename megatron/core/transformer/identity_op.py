"""Placeholders for optional parts of a layer spec (e.g. no cross-attention)."""

import torch


class IdentityOp(torch.nn.Module):
    """A module that returns its first input unchanged (extra arguments ignored)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()

    def forward(self, x, *args, **kwargs):
        """x."""
        return x


class IdentityFuncOp(IdentityOp):
    """A module whose forward returns the identity function (for bias-dropout-add slots)."""

    def forward(self, *args, **kwargs):
        """The function ``x -> x``."""
        return super().forward
