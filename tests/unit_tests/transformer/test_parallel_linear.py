"""The GPT's tensor-parallel linear layers are built through one helper (``parallel_linear``):
the keywords every layer shares, and the row-parallel ``output_projection`` on top of it."""

import pytest

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import leave_as_allocated, output_projection, parallel_linear

pytestmark = pytest.mark.world(1)


class Recorded:
    """A layer class that keeps what it was built with."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


CONFIG = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)


def test_a_layer_is_built_with_the_shared_keywords_and_its_own():
    layer = parallel_linear(Recorded, 4, 6, CONFIG, "tp", gather_output=False, bias=False)
    assert layer.args == (4, 6)
    assert layer.kwargs == dict(
        config=CONFIG, init_method=leave_as_allocated, is_expert=False, tp_group="tp",
        gather_output=False, bias=False,
    )  # fmt: skip


def test_an_own_init_method_overrides_leave_as_allocated():
    def init(weight):
        pass

    assert (
        parallel_linear(Recorded, 4, 6, CONFIG, None, init_method=init).kwargs["init_method"]
        is init
    )


def test_the_output_projection_is_row_parallel_to_hidden_size_with_the_bias_unadded():
    layer = output_projection(Recorded, 4, CONFIG, "fc2", "tp")
    assert layer.args == (4, CONFIG.hidden_size)
    assert layer.kwargs == dict(
        config=CONFIG, init_method=leave_as_allocated, is_expert=False, tp_group="tp",
        bias=CONFIG.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
        tp_comm_buffer_name="fc2",
    )  # fmt: skip
