"""Groups resolved once (issue 37 item 6): the attention and the GPT model resolve their CP
group at build time, not at every forward, and again only after ``parallel_state`` is
re-initialized; groups of the MPU fallback are held weakly (``parallel_groups.ResolvedGroup``).
"""

import copy
import pickle

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig, parallel_groups
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.parallel_groups import ResolvedGroup

pytestmark = pytest.mark.world(1)


def _config(**kwargs) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=8, num_attention_heads=2, attention_dropout=0.0, **kwargs
    )


@pytest.fixture
def resolutions(monkeypatch):
    """Counts the group resolutions of ``parallel_groups`` (every CP/TP/PP getter's)."""
    calls = []
    resolve = parallel_groups.resolve_group

    def counted(*args, **kwargs):
        calls.append(args)
        return resolve(*args, **kwargs)

    monkeypatch.setattr(parallel_groups, "resolve_group", counted)
    return calls


def test_dot_product_attention_resolves_its_cp_group_once(resolutions):
    attention = DotProductAttention(_config(), 1, AttnMaskType.causal, "self")
    built = len(resolutions)
    assert built >= 1  # resolved and checked at build time
    q = torch.randn(4, 1, 2, 4)
    for _ in range(3):
        attention(q, q, q, None)
    assert len(resolutions) == built, "the CP group was resolved again at forward"


def test_gpt_model_with_rope_resolves_its_cp_group_once(resolutions):
    model = GPTModel(
        _config(),
        get_gpt_layer_local_spec(),
        vocab_size=16,
        max_sequence_length=8,
        position_embedding_type="rope",
    )
    built = len(resolutions)
    tokens = torch.arange(8).view(1, -1)
    for _ in range(2):
        model(tokens, tokens, None)
    assert len(resolutions) == built


def test_a_reinitialized_parallel_state_is_resolved_again(resolutions, monkeypatch):
    attention = DotProductAttention(_config(), 1, AttnMaskType.causal, "self")
    built = len(resolutions)
    q = torch.randn(4, 1, 2, 4)
    attention(q, q, q, None)
    generation = parallel_state.groups_generation()
    monkeypatch.setattr(parallel_state, "groups_generation", lambda: generation + 1)
    attention(q, q, q, None)
    attention(q, q, q, None)
    assert len(resolutions) == built + 1


class _Group:
    """Stands for a process group (weakly referenceable, like one)."""


def test_mpu_fallback_groups_are_held_weakly_explicit_ones_strongly():
    made = []

    def resolve(pg_collection, config):
        made.append(_Group())
        return made[-1] if pg_collection is None else pg_collection.cp

    fallback = ResolvedGroup(resolve, None, None)
    first = fallback.get()
    assert fallback.get() is first and len(made) == 1
    del first, made[0]
    assert isinstance(fallback.get(), _Group) and len(made) == 1  # freed: resolved again

    group = _Group()
    explicit = ResolvedGroup(resolve, ProcessGroupCollection(cp=group), None)
    del group
    assert isinstance(explicit.get(), _Group)


def test_modules_with_resolved_groups_copy_and_pickle():
    attention = DotProductAttention(_config(), 1, AttnMaskType.causal, "self")
    q = torch.randn(4, 1, 2, 4)
    expected = attention(q, q, q, None)
    for clone in (copy.deepcopy(attention), pickle.loads(pickle.dumps(attention))):
        torch.testing.assert_close(clone(q, q, q, None), expected)


def test_a_mismatched_cp_group_still_fails_at_build_time():
    with pytest.raises(ValueError, match="context_parallel_size is 2"):
        DotProductAttention(
            _config(context_parallel_size=2), 1, AttnMaskType.causal, "self", pg_collection=None
        )
