"""``TransformerConfig``'s init methods (issue 21): ``init_method``,
``output_layer_init_method``, ``embedding_init_method`` and ``embedding_init_method_std``
with megatron-core 0.16.1's roles and defaults, applied to the full tensor so that every
TP layout gets the same weights.

References are independent of the model's code path: ``seeded_normal`` draws a Normal
directly from a generator seeded with the (seed, name) stream, and custom methods are
applied by hand to a full tensor under that seed.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import _stream_seed, seeded_normal
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.dist_utils import assert_no_failures, reset_layout

VOCAB, SEQ, SEED = 32, 8, 1234
LAYERS, STD = 3, 0.3


def make_config(**overrides) -> TransformerConfig:
    fields = dict(
        num_layers=LAYERS,
        hidden_size=16,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=24,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=STD,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build(config, pg_collection=None, **kwargs) -> GPTModel:
    return GPTModel(
        config,
        get_gpt_layer_local_spec(normalization=config.normalization),
        VOCAB,
        SEQ,
        pg_collection=pg_collection if pg_collection is not None else ProcessGroupCollection(),
        seed=SEED,
        **kwargs,
    )


def by_hand(method, shape, name) -> torch.Tensor:
    """``method`` applied to a full float32 tensor with the CPU generator seeded from the
    (SEED, name) stream."""
    full = torch.empty(shape, dtype=torch.float32)
    torch.manual_seed(_stream_seed(SEED, name))
    method(full)
    return full


@pytest.mark.world(1)
def test_defaults_are_megatron_cores():
    """init_method: N(0, std); output layers (proj, fc2): N(0, std / sqrt(2 L)); embeddings:
    N(0, embedding_init_method_std), which defaults to std."""
    model = build(make_config(), position_embedding_type="learned_absolute")
    scaled = STD / math.sqrt(2 * LAYERS)
    for name, param in model.named_parameters():
        if "layernorm" in name or name.endswith("final_layernorm.weight"):
            continue
        if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            std = scaled
        else:
            std = STD  # qkv, fc1, embeddings (word and position), untied output layer
        expected = seeded_normal(tuple(param.shape), SEED, name, std)
        assert torch.equal(param.detach(), expected), name


@pytest.mark.world(1)
def test_each_init_field_reaches_its_weights():
    config = make_config(
        init_method=torch.nn.init.xavier_uniform_,
        output_layer_init_method=lambda t: torch.nn.init.constant_(t, 0.125),
        embedding_init_method_std=0.7,
    )
    model = build(config, share_embeddings_and_output_weights=False)
    for name, param in model.named_parameters():
        shape = tuple(param.shape)
        if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            expected = torch.full(shape, 0.125)
        elif name == "embedding.word_embeddings.weight":
            expected = seeded_normal(shape, SEED, name, 0.7)  # embedding std given
        elif name.endswith(("linear_qkv.weight", "linear_fc1.weight", "output_layer.weight")):
            expected = by_hand(torch.nn.init.xavier_uniform_, shape, name)
        else:
            continue
        assert torch.equal(param.detach(), expected), name
    embedding_method = make_config(embedding_init_method=torch.nn.init.ones_)
    assert torch.equal(
        build(embedding_method).embedding.word_embeddings.weight.detach(),
        torch.ones(VOCAB, 16),
    )


@pytest.mark.world(1)
def test_embedding_follows_a_given_init_method_when_the_stds_agree():
    """megatron-core: with ``init_method`` given and no separate embedding std, the
    embeddings use ``init_method``; a different ``embedding_init_method_std`` wins."""
    same = make_config(init_method=torch.nn.init.ones_)
    assert same.embedding_init_method is torch.nn.init.ones_
    other = make_config(init_method=torch.nn.init.ones_, embedding_init_method_std=0.5)
    assert other.embedding_init_method is not torch.nn.init.ones_
    assert other.embedding_init_method.std == 0.5


@pytest.mark.world(1)
def test_a_non_callable_init_method_is_refused_by_name():
    with pytest.raises(TypeError, match=r"output_layer_init_method must be a callable .* 0\.5"):
        make_config(output_layer_init_method=0.5)


@pytest.mark.world(2)
def test_tp_shards_are_slices_of_the_one_rank_weights_for_custom_methods():
    """A fan-dependent method (xavier: bound from the FULL shape) and a scaled one: the TP = 2
    shards equal the slices of the one-rank model's weights."""
    overrides = dict(
        init_method=torch.nn.init.xavier_uniform_,
        output_layer_init_method=torch.nn.init.kaiming_normal_,
        embedding_init_method_std=0.05,
    )
    reset_layout()
    full = dict(build(make_config(**overrides)).named_parameters())
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        groups = ProcessGroupCollection.use_mpu_process_groups()
        rank, failures = groups.tp.rank(), []
        split = build(make_config(tensor_model_parallel_size=2, **overrides), groups)
        for name, param in split.named_parameters():
            expected = full[name]
            if getattr(param, "tensor_model_parallel", False):
                blocks = expected.chunk(2 * param.partition_stride, dim=param.partition_dim)
                expected = torch.cat(blocks[rank::2], dim=param.partition_dim)
            if not torch.equal(param.detach(), expected.detach()):
                failures.append(f"{name}: not the slice of the one-rank weight")
        assert_no_failures(failures)
    finally:
        reset_layout()
