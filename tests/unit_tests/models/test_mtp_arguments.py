"""The MTP layer's and block's forward arguments of megatron-core 0.16.1 this core does not
implement (``context``, ``context_mask``, ``rotary_pos_cos``, ``rotary_pos_sin``) are refused
by name when not None (SPEC section 8), and the default path (all None) is the formula
h_1 = final_norm(layer(eh_proj([enorm(E(t rolled by 1)); hnorm(h_0)])))."""

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


def test_default_path_is_the_formula(setup):
    """All refused arguments None (given explicitly): h_0 and h_1 of the block are h_0 and
    the depth's formula on the ids shifted by one (zero past the end)."""
    model, ids, hidden, angles = setup
    depth = model.mtp.layers[0]
    with torch.no_grad():
        out = _call(model.mtp, setup, **dict.fromkeys(UNSUPPORTED))
        shifted = torch.zeros_like(ids)
        shifted[:, :-1] = ids[:, 1:]
        embedded = model.embedding(input_ids=shifted, position_ids=None)
        combined = torch.cat((depth.enorm(embedded), depth.hnorm(hidden)), dim=-1)
        layer_out, _ = depth.transformer_layer(
            depth.eh_proj(combined)[0], attention_mask=None, rotary_pos_emb=angles
        )
        expected = depth.final_layernorm(layer_out)
    assert out.shape == (SEQ * 3, 2, HIDDEN)
    assert torch.equal(out[:SEQ], hidden)
    assert torch.equal(out[SEQ : 2 * SEQ], expected)
