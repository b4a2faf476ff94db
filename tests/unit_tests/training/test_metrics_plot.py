"""The loss picture (``--save-metrics DIR`` writes DIR/loss.png): three panels, the loss,
the gradient norm and the learning rate against iteration, one line per run."""

import pytest

from megatron.training.metrics import loss_figure, save_metrics

pytest.importorskip("matplotlib", reason="the picture needs the plot extra (matplotlib)")
pytestmark = pytest.mark.world(1)


def _records(scale: float):
    return [
        {"iteration": i, "loss": scale * (5 - i), "grad_norm": scale * i, "lr": 1e-3 * i}
        for i in range(1, 5)
    ]


def test_the_picture_has_loss_grad_norm_and_lr_panels(tmp_path):
    """Each panel plots its own key for each curve; the PNG is written."""
    from matplotlib import pyplot as plt

    curves = {"cp2-pp1-dp1": _records(1.0), "1 process": _records(2.0)}
    figure = loss_figure(curves)
    try:
        panels = figure.get_axes()
        assert len(panels) == 3
        labels = [axes.get_ylabel() for axes in panels]
        assert "loss" in labels[0] and "gradient norm" in labels[1] and "learning rate" in labels[2]
        for axes, key in zip(panels, ("loss", "grad_norm", "lr")):
            lines = axes.get_lines()
            assert [line.get_label() for line in lines] == list(curves)
            for line, records in zip(lines, curves.values()):
                assert list(line.get_ydata()) == [r[key] for r in records]
    finally:
        plt.close(figure)
    written = save_metrics(str(tmp_path), _records(1.0), "cp2-pp1-dp1", _records(2.0))
    png = tmp_path / "loss.png"
    assert png in written and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_value_is_left_out_of_its_line():
    """A record without a gradient norm (None) does not break the picture."""
    from matplotlib import pyplot as plt

    records = _records(1.0)
    records[1]["grad_norm"] = None
    figure = loss_figure({"run": records})
    try:
        assert list(figure.get_axes()[1].get_lines()[0].get_xdata()) == [1, 3, 4]
    finally:
        plt.close(figure)
