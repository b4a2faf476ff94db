"""Attaching a loss to an activation so that it reaches the gradient: megatron-core's
``MoEAuxLossAutoScaler`` (router losses) and ``MTPLossAutoScaler`` (multi-token prediction)
are two classes of this one implementation, each with a scale of its own."""

from typing import Optional

import torch
from torch import Tensor


def loss_auto_scaler(name: str, doc: str, module: str) -> type:
    """A ``torch.autograd.Function`` class ``name`` (of ``module``): ``apply(output, loss)``
    returns ``output``, and the backward gives ``loss`` the gradient
    ``main_loss_backward_scale``, the class's own (set each step by the schedules through
    ``set_loss_scale``, a one-element tensor; 1 when unset). Its methods are plain static
    ones, so ``torch.compile`` traces it as any autograd function."""
    scaler: Optional[type] = None

    def forward(ctx, output: Tensor, loss: Tensor) -> Tensor:
        """The activation, unchanged; remembers the loss."""
        ctx.save_for_backward(loss)
        return output

    def backward(ctx, grad_output: Tensor):
        """dJ/d(activation) passes through; d(scale * loss)/d(loss) = scale."""
        (loss,) = ctx.saved_tensors
        scale = scaler.main_loss_backward_scale
        if scale is None:
            return grad_output, torch.ones_like(loss)
        scale = scale.detach().to(device=loss.device, dtype=loss.dtype)
        return grad_output, scale.expand_as(loss).clone()

    def set_loss_scale(scale: Tensor) -> None:
        """The gradient the losses attached through this class receive in the backward."""
        scaler.main_loss_backward_scale = scale.detach().clone().reshape(())

    namespace = dict(
        __doc__=doc,
        __module__=module,
        __qualname__=name,
        main_loss_backward_scale=None,
        forward=staticmethod(forward),
        backward=staticmethod(backward),
        set_loss_scale=staticmethod(set_loss_scale),
    )
    scaler = type(name, (torch.autograd.Function,), namespace)
    return scaler
