"""The loss auto-scalers (``LossAutoScaler``): megatron-core's ``MoEAuxLossAutoScaler`` and
``MTPLossAutoScaler`` are one implementation, and each keeps the scale set through it."""

import pytest
import torch

from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

pytestmark = pytest.mark.world(1)


def _loss_gradients() -> tuple:
    """(d/d router loss, d/d MTP loss) of sum(activation) with both losses attached."""
    activation = torch.ones(3, requires_grad=True)
    router, mtp = torch.tensor(0.5, requires_grad=True), torch.tensor(0.25, requires_grad=True)
    out = MTPLossAutoScaler.apply(MoEAuxLossAutoScaler.apply(activation, router), mtp)
    out.sum().backward()
    assert torch.equal(activation.grad, torch.ones(3))  # the activation's gradient passes
    return router.grad.item(), mtp.grad.item()


def test_each_scaler_keeps_its_own_scale(monkeypatch):
    """Unset: each loss gets gradient 1; each ``set_loss_scale`` sets its own class's scale
    (megatron-core keeps one per class), not the other's."""
    for scaler in (MoEAuxLossAutoScaler, MTPLossAutoScaler):
        monkeypatch.setattr(scaler, "main_loss_backward_scale", None)
    assert _loss_gradients() == (1.0, 1.0)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([2.0]))
    assert _loss_gradients() == (2.0, 1.0)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(3.0))
    assert _loss_gradients() == (2.0, 3.0)
    assert MoEAuxLossAutoScaler.main_loss_backward_scale.item() == 2.0


@pytest.mark.slow  # torch.compile: about 2 s
def test_scalers_run_under_torch_compile(monkeypatch):
    """``torch.compile`` runs a function attaching both losses (plain autograd functions:
    an ``apply`` of their own would break tracing) with the same gradients as eager."""
    for scaler in (MoEAuxLossAutoScaler, MTPLossAutoScaler):
        monkeypatch.setattr(scaler, "main_loss_backward_scale", None)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(2.0))

    def attach(activation, router, mtp):
        out = MoEAuxLossAutoScaler.apply(activation * 3, router * 1.0)
        return MTPLossAutoScaler.apply(out, mtp * 2.0).sum()

    activation = torch.ones(3, requires_grad=True)
    loss = torch.tensor(0.5, requires_grad=True)
    torch.compile(attach, backend="eager")(activation, loss, loss).backward()
    assert torch.equal(activation.grad, torch.full((3,), 3.0))
    assert loss.grad.item() == 2.0 * 1.0 + 1.0 * 2.0
