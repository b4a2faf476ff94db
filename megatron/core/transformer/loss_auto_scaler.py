"""Attaching a loss to an activation so that it reaches the gradient: megatron-core's
``MoEAuxLossAutoScaler`` (router losses) and ``MTPLossAutoScaler`` (multi-token prediction)
are this one function, each subclass with a scale of its own."""

from typing import Optional

import torch
from torch import Tensor


class LossAutoScaler(torch.autograd.Function):
    """``apply(output, loss)``: the forward returns ``output``; the backward gives ``loss`` the
    gradient ``main_loss_backward_scale`` of the class it was applied through (set by the
    schedules each step with ``set_loss_scale``; 1 when unset)."""

    main_loss_backward_scale: Optional[Tensor] = None

    @classmethod
    def apply(cls, output: Tensor, loss: Tensor) -> Tensor:
        """``output`` with ``loss`` attached (its scale: this class's)."""
        return super().apply(output, loss, cls)

    @staticmethod
    def forward(ctx, output: Tensor, loss: Tensor, scaler: type) -> Tensor:
        """The activation, unchanged; remembers the loss and whose scale it takes."""
        ctx.scaler = scaler
        ctx.save_for_backward(loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        """dJ/d(activation) passes through; d(scale * loss)/d(loss) = scale."""
        (loss,) = ctx.saved_tensors
        scale = ctx.scaler.main_loss_backward_scale
        if scale is None:
            return grad_output, torch.ones_like(loss), None
        scale = scale.detach().to(device=loss.device, dtype=loss.dtype)
        return grad_output, scale.expand_as(loss).clone(), None

    @classmethod
    def set_loss_scale(cls, scale: Tensor) -> None:
        """The gradient the losses attached through this class receive in the backward (a
        one-element tensor)."""
        cls.main_loss_backward_scale = scale.detach().clone().reshape(())
