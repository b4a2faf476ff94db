"""megatron-core's forward arguments of the GPT model, transformer block and layer, attention,
multi-latent attention, core attention and MLP are honoured or refused by name (SPEC section
8), never accepted and dropped: each refusal names the class, the argument and the value's
kind; attention mask types other than causal/padding are refused;
``inference_params`` reaches the KV cache; a ``sequence_len_offset`` equal to the cache's
offset is accepted and leaves the output unchanged, another one is refused."""

import pytest
import torch

from megatron.core.inference.contexts.static_context import StaticInferenceContext
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

pytestmark = pytest.mark.world(1)

SEQ, BATCH, HIDDEN = 4, 2, 8
COMMON = dict(
    num_layers=1,
    hidden_size=HIDDEN,
    num_attention_heads=2,
    ffn_hidden_size=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    params_dtype=torch.float64,
)


@pytest.fixture(scope="module")
def modules():
    """name -> module: a one-layer dense GPT (its block, layer, attention) and a one-layer
    multi-latent attention."""
    torch.manual_seed(0)
    groups = ProcessGroupCollection()
    model = GPTModel(
        TransformerConfig(**COMMON),
        get_gpt_layer_local_spec(),
        32,
        SEQ,
        position_embedding_type="rope",
        pg_collection=groups,
    )
    mla_config = MLATransformerConfig(
        **COMMON, kv_lora_rank=4, qk_head_dim=4, qk_pos_emb_head_dim=2, v_head_dim=4
    )
    mla = TransformerBlock(
        mla_config, get_gpt_layer_local_spec(multi_latent_attention=True), pg_collection=groups
    )
    with torch.no_grad():  # a bare block leaves its weights as allocated (GPTModel fills them)
        for param in mla.parameters():
            param.normal_(0.0, 0.3)
    layer = model.decoder.layers[0]
    return {
        "GPTModel": model,
        "TransformerBlock": model.decoder,
        "TransformerLayer": layer,
        "SelfAttention": layer.self_attention,
        "MLASelfAttention": mla.layers[0].self_attention,
        "MLP": layer.mlp,
    }


def _hidden() -> torch.Tensor:
    return torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)


def _call(modules, name: str, **kwargs):
    module = modules[name]
    if name == "GPTModel":  # megatron-core's route to the block's arguments
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        return module(ids, None, None, extra_block_kwargs=kwargs)
    return module(_hidden(), attention_mask=None, **kwargs)


TENSOR = torch.ones(SEQ, BATCH, HIDDEN)
REFUSED = [
    ("GPTModel", "context_mask", "TransformerBlock"),
    ("GPTModel", "context", "TransformerBlock"),
    ("TransformerBlock", "context", "TransformerBlock"),
    ("TransformerBlock", "context_mask", "TransformerBlock"),
    ("TransformerLayer", "context", "TransformerLayer"),
    ("TransformerLayer", "context_mask", "TransformerLayer"),
    ("TransformerLayer", "rotary_pos_cos_sin", "SelfAttention"),
    ("SelfAttention", "key_value_states", "SelfAttention"),
    ("SelfAttention", "rotary_pos_cos", "SelfAttention"),
    ("SelfAttention", "rotary_pos_sin", "SelfAttention"),
    ("SelfAttention", "rotary_pos_cos_sin", "SelfAttention"),
    ("SelfAttention", "sequence_len_offset", "SelfAttention"),
    ("MLASelfAttention", "key_value_states", "MLASelfAttention"),
    ("MLASelfAttention", "rotary_pos_emb", "MLASelfAttention"),
    ("MLASelfAttention", "rotary_pos_cos", "MLASelfAttention"),
    ("MLASelfAttention", "rotary_pos_sin", "MLASelfAttention"),
    ("MLASelfAttention", "rotary_pos_cos_sin", "MLASelfAttention"),
    ("MLASelfAttention", "position_ids", "MLASelfAttention"),
    ("MLASelfAttention", "sequence_len_offset", "MLASelfAttention"),
    ("MLASelfAttention", "attention_bias", "MLASelfAttention"),
    ("SelfAttention", "attention_bias", "DotProductAttention"),
    ("MLP", "per_token_scale", "MLP"),
]


@pytest.mark.parametrize("name, argument, owner", REFUSED)
def test_unsupported_argument_refused_by_name(modules, name, argument, owner):
    value = 3 if argument == "sequence_len_offset" else TENSOR
    kind = r"3 \(int\)" if argument == "sequence_len_offset" else r"a tensor of shape \(4, 2, 8\)"
    match = rf"^{owner}: {argument} is not supported \(.+\); got {kind}, expected None$"
    with pytest.raises(NotImplementedError, match=match):
        _call(modules, name, **{argument: value})


@pytest.mark.parametrize("argument", ["attention_bias", "packed_seq_params"])
def test_cached_attention_refuses_what_it_cannot_apply(modules, argument):
    value = PackedSeqParams(qkv_format="thd") if argument == "packed_seq_params" else TENSOR
    context = StaticInferenceContext(BATCH, SEQ)
    with pytest.raises(NotImplementedError, match=rf"^SelfAttention: {argument} is not supported"):
        _call(modules, "SelfAttention", inference_context=context, **{argument: value})


def test_a_refused_value_without_a_repr_of_its_own_is_described_by_its_class(modules):
    class Unprintable:
        pass

    match = r"^MLASelfAttention: packed_seq_params is not supported \(.+\); got a "
    with pytest.raises(NotImplementedError, match=match + r"Unprintable, expected None$"):
        _call(modules, "MLASelfAttention", packed_seq_params=Unprintable())


@pytest.mark.parametrize("mask_type", ["no_mask", "padding_causal", "arbitrary"])
def test_attention_mask_types_it_cannot_compute_are_refused(modules, mask_type):
    """Bidirectional or arbitrary masks were computed as causal: refused at build time and
    as a forward override; causal and padding (the GPT's causal mask) are accepted."""
    core = modules["SelfAttention"].core_attention
    match = rf"^DotProductAttention: attn_mask_type=AttnMaskType\.{mask_type} is not supported"
    with pytest.raises(NotImplementedError, match=match):
        DotProductAttention(core.config, 1, AttnMaskType[mask_type], "self")
    q = torch.zeros(SEQ, BATCH, 2, 4, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=match):
        core(q, q, q, None, attn_mask_type=AttnMaskType[mask_type])
    for accepted in (AttnMaskType.causal, AttnMaskType.padding):
        assert torch.equal(core(q, q, q, None, attn_mask_type=accepted), core(q, q, q, None))


def test_unknown_layer_keyword_is_an_error(modules):
    """The layer no longer swallows unknown keywords (a misspelt argument was dropped)."""
    with pytest.raises(TypeError, match="rotary_pos_embedding"):
        _call(modules, "TransformerLayer", rotary_pos_embedding=TENSOR)


@pytest.mark.parametrize("name", ["TransformerBlock", "TransformerLayer", "MLASelfAttention"])
def test_inference_params_reaches_the_kv_cache(modules, name):
    """The deprecated ``inference_params`` is the cache, as ``inference_context`` is: same
    output, keys and values stored."""
    hidden = _hidden()
    module = modules[name]
    contexts = [StaticInferenceContext(BATCH, SEQ) for _ in range(2)]
    with torch.no_grad():
        by_params = module(hidden, None, inference_params=contexts[0])
        by_context = module(hidden, None, inference_context=contexts[1])
    by_params, by_context = (
        out[0] if isinstance(out, tuple) else out for out in (by_params, by_context)
    )
    assert torch.equal(by_params, by_context)
    assert contexts[0].key_value_memory_dict.keys() == {1}
    assert torch.equal(
        contexts[0].key_value_memory_dict[1][0], contexts[1].key_value_memory_dict[1][0]
    )


@pytest.mark.parametrize("name", ["SelfAttention", "MLASelfAttention"])
def test_sequence_len_offset_is_the_cache_offset(modules, name):
    """Equal to the context's offset (an int, or one per sequence): accepted, same output;
    another offset: refused naming both."""
    attention = modules[name]
    hidden = _hidden()
    outputs = []
    with torch.no_grad():
        for offset in (None, 0, torch.zeros(BATCH, dtype=torch.long)):
            outputs.append(
                attention(
                    hidden,
                    None,
                    inference_context=StaticInferenceContext(BATCH, SEQ),
                    sequence_len_offset=offset,
                )[0]
            )
        assert all(torch.equal(out, outputs[0]) for out in outputs[1:])
        match = rf"^{name}: sequence_len_offset=\[0, 2\] disagrees with inference_context"
        with pytest.raises(
            ValueError, match=match + r"\.sequence_len_offset=0; expected None or 0"
        ):
            attention(
                hidden,
                None,
                inference_context=StaticInferenceContext(BATCH, SEQ),
                sequence_len_offset=torch.tensor([0, 2]),
            )
