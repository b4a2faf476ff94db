"""The MTP layer's and block's forward arguments of megatron-core 0.16.1 this core does not
implement (``context``, ``context_mask``, ``rotary_pos_cos``, ``rotary_pos_sin``) are refused
by name when not None (SPEC section 8); given as None they change nothing (the default path's
formula: ``test_multi_token_prediction.py``)."""

import pytest
import torch

from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.models.test_multi_token_prediction import HIDDEN, SEQ, VOCAB, _config, _model

pytestmark = pytest.mark.world(1)

UNSUPPORTED = ("context", "context_mask", "rotary_pos_cos", "rotary_pos_sin")


@pytest.fixture(scope="module")
def setup():
    """(a one-process GPT with MTP, ids [b, s], h_0 [s, b, h], rope angles)."""
    torch.manual_seed(0)
    model = _model(_config(), ProcessGroupCollection())
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(SEQ, 2, HIDDEN, dtype=torch.float64)
    return model, ids, hidden, model.rotary_pos_emb(SEQ)


def _call(module, setup, **extra):
    model, ids, hidden, angles = setup
    return module(
        ids, None, hidden, None, rotary_pos_emb=angles, embedding=model.embedding, **extra
    )


@pytest.mark.parametrize("name", UNSUPPORTED)
@pytest.mark.parametrize("owner", ["MultiTokenPredictionBlock", "MultiTokenPredictionLayer"])
def test_unsupported_arguments_refused_by_name(setup, owner, name):
    model = setup[0]
    module = model.mtp if owner == "MultiTokenPredictionBlock" else model.mtp.layers[0]
    value = torch.ones(SEQ, 2, HIDDEN, dtype=torch.float64)
    match = rf"{owner}: {name} is not supported \(.*\); got a tensor of shape \({SEQ}, 2, "
    with pytest.raises(NotImplementedError, match=match + rf"{HIDDEN}\), expected None"):
        _call(module, setup, **{name: value})


def test_missing_embedding_refused(setup):
    model, ids, hidden, angles = setup
    with pytest.raises(ValueError, match=r"MultiTokenPredictionLayer: embedding=None; expected"):
        model.mtp(ids, None, hidden, None, rotary_pos_emb=angles)


def test_explicit_nones_are_the_omitted_arguments(setup):
    """The refused arguments given as None change nothing: the block's output is bitwise
    the one without them (the formula itself: test_multi_token_prediction.py)."""
    with torch.no_grad():
        out = _call(setup[0].mtp, setup, **dict.fromkeys(UNSUPPORTED))
        omitted = _call(setup[0].mtp, setup)
    assert out.shape == (SEQ * 3, 2, HIDDEN)
    assert torch.equal(out, omitted)
