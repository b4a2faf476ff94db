"""The router losses the trainer logs mean what megatron-core 0.16.1's mean (issue 38 item 8):
each divided by its coefficient (the router calls ``save_to_aux_losses_tracker`` with
``aux_loss / moe_aux_loss_coeff``), and present whenever megatron's ``training_log`` tracks
them (``force_initialize=True``: 0 when not computed), not only with a nonzero coefficient."""

import pytest

from megatron.training import TrainingConfig
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import fresh_layout

pytestmark = pytest.mark.world(1)

MOE = dict(num_experts=4, disable_bias_linear=True, num_layers=2, train_iters=1, progress=False)


def _record(**settings) -> dict:
    with fresh_layout():
        return pretrain(TrainingConfig(**MOE, **settings)).records[0]


def test_logged_router_losses_do_not_include_the_coefficient():
    """The first iteration's forward does not depend on the coefficients (same weights), so
    the logged losses, divided by them, are the same with coefficients 10x apart; with the
    coefficient included they were 10x apart."""
    small = _record(moe_aux_loss_coeff=1e-3, moe_z_loss_coeff=1e-4)
    large = _record(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    for name in ("moe_load_balancing_loss", "moe_z_loss"):
        assert small[name] == pytest.approx(large[name], rel=1e-6), (name, small, large)  # float32
    # a balanced router's load-balancing loss is about 1 (E / k * sum_e f_e p_e ~ 1)
    assert 0.5 < large["moe_load_balancing_loss"] < 2.0, large
    assert large["moe_z_loss"] > 0


def test_router_losses_are_logged_whenever_megatron_tracks_them():
    """Default --moe-router-load-balancing-type aux_loss with coefficient 0: load_balancing
    loss logged as 0 (megatron force-initializes the tracked names); no --moe-z-loss-coeff:
    no z_loss; seq_aux_loss also logs load_balancing_loss (megatron's name test)."""
    default = _record()
    assert default["moe_load_balancing_loss"] == 0.0 and "moe_z_loss" not in default, default
    assert "moe_seq_load_balancing_loss" not in default
    seq = _record(moe_router_load_balancing_type="seq_aux_loss", moe_z_loss_coeff=0.0)
    assert seq["moe_load_balancing_loss"] == 0.0 and seq["moe_z_loss"] == 0.0, seq
    assert seq["moe_seq_load_balancing_loss"] == 0.0
