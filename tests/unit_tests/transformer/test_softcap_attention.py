"""Attention logit soft-capping (Gemma 2's ``attn_logit_softcapping``) on the explicit math
kernel, one process, float64: the output and the q/k/v gradients equal autograd through
softmax(c * tanh(scale * Q K^T / c) + mask) V, dense and packed (documents apart), with and
without a sliding window, with grouped-query attention; without the cap the result differs
(the cap bites); a kernel without soft-capping is refused by name."""

import math

import pytest
import torch

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.cp_attention import context_parallel_attention

pytestmark = pytest.mark.world(1)
S, B, NQ, NKV, D, CAP = 10, 1, 4, 2, 8, 1.5


def _reference(q, k, v, window, documents, sinks=None, cap=CAP):
    """[s, b, n, d] float64 autograd reference (``sinks``: one more score column per head,
    the sink logit, dropped after the softmax; ``cap`` None: no soft-cap)."""
    qh, kh, vh = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    kh, vh = (x.repeat_interleave(NQ // NKV, dim=1) for x in (kh, vh))
    scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(D)
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = (j <= i) & (documents[:, None] == documents[None, :])
    if window is not None:
        allowed &= j >= i - window
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is None:
        return (torch.softmax(scores, -1) @ vh).permute(2, 0, 1, 3)
    column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    return (probs @ vh).permute(2, 0, 1, 3)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((S, B, NQ, D), (S, B, NKV, D), (S, B, NKV, D))
    return [(torch.randn(s, generator=g, dtype=torch.float64) * 2).requires_grad_() for s in shapes]


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_softcapped_attention_equals_the_autograd_reference(window, packed):
    q, k, v = _inputs()
    bounds = [0, 4, 10] if packed else [0, S]
    documents = torch.zeros(S, dtype=torch.long)
    params = None
    if packed:
        documents[4:] = 1
        cu = torch.tensor(bounds, dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu, max_seqlen_q=6, max_seqlen_kv=6,
        )  # fmt: skip
    window_size = None if window is None else (window, 0)
    out = context_parallel_attention(
        q, k, v, softcap=CAP, window_size=window_size, packed_seq_params=params
    )
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    expected = _reference(q, k, v, window, documents)
    theirs = torch.autograd.grad(expected, (q, k, v), grad)
    assert torch.allclose(out, expected, rtol=1e-12, atol=1e-12)
    for name, a, b in zip("qkv", ours, theirs):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), f"d{name} differs"
    plain = context_parallel_attention(q, k, v, window_size=window_size, packed_seq_params=params)
    assert (plain - expected).abs().max() > 1e-2  # negative control: the cap matters


def test_a_kernel_without_soft_capping_is_refused_by_name():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="kernel 'cpu' has no logit soft-capping"):
        context_parallel_attention(q, k, v, softcap=CAP, kernel="cpu")


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
        (dict(final_logit_softcapping=float("inf")), "final_logit_softcapping"),
        (dict(window_size=(3, 0), window_attn_skip_freq=0), "window_attn_skip_freq"),
        (dict(window_size=(3, 0), window_attn_skip_freq=[1, 0, 1]), "window_attn_skip_freq"),
        (dict(local_rotary_base=1e4), "local_rotary_base"),
        (
            dict(
                layernorm_zero_centered_gamma=True,
                qk_layernorm=True,
                normalization="RMSNorm",
                qk_layernorm_whole_projection=True,
            ),
            "layernorm_zero_centered_gamma",
        ),
    ],
)
def test_the_gemma_fields_are_checked_by_name(changes, named):
    from megatron.core.transformer import TransformerConfig

    with pytest.raises(ValueError, match=named):
        TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, **changes)


def test_a_softcap_with_a_kernel_that_has_none_is_refused_at_build_time():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, attn_logit_softcapping=50.0,
        attention_backend="flash", attention_dropout=0.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="kernel 'flash' has no logit soft-capping"):
        DotProductAttention(config, 1, AttnMaskType.causal, "self")


SINKS = torch.tensor([-1.0, 0.5, 2.0, -0.25], dtype=torch.float64)


@pytest.mark.parametrize("window, packed", [(None, False), (3, True)])
def test_softcapped_attention_with_sinks_equals_the_autograd_reference(window, packed):
    """GPT-OSS's sinks on Gemma's capped scores (``softmax_offset`` and ``softcap``
    together): output, q/k/v and sink gradients equal autograd's; without the sinks, or
    without the cap, the output differs."""
    q, k, v = _inputs(3)
    sinks = SINKS.clone().requires_grad_()
    documents, params = torch.zeros(S, dtype=torch.long), None
    if packed:
        documents[4:] = 1
        cu = torch.tensor([0, 4, 10], dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu, max_seqlen_q=6, max_seqlen_kv=6,
        )  # fmt: skip
    window_size = None if window is None else (window, 0)
    out = context_parallel_attention(
        q, k, v, softcap=CAP, window_size=window_size, packed_seq_params=params,
        softmax_offset=sinks,
    )  # fmt: skip
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=out.dtype)
    ours = torch.autograd.grad(out, (q, k, v, sinks), grad)
    expected = _reference(q, k, v, window, documents, sinks)
    theirs = torch.autograd.grad(expected, (q, k, v, sinks), grad)
    assert torch.allclose(out, expected, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("q", "k", "v", "sinks"), ours, theirs):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), f"d{name} differs"
    capped_only = _reference(q, k, v, window, documents)
    assert (capped_only - expected).abs().max() > 1e-2  # negative control: the sinks matter
    uncapped = context_parallel_attention(
        q, k, v, window_size=window_size, packed_seq_params=params, softmax_offset=sinks
    )
    assert (uncapped - expected).abs().max() > 1e-2  # and the cap too


def test_the_cached_forward_with_sinks_and_soft_caps_equals_the_full_forward():
    """``Attention``'s cached forward (generation) with sinks, a soft-cap, a window on every
    other layer and a local RoPE base: the prompt, a chunk and single tokens give the full
    forward's logits (float64); the sinks and the cap both bite."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    def logits(**features):
        config = TransformerConfig(
            num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2,
            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.5,
            params_dtype=torch.float64, window_size=(2, 0), window_attn_skip_freq=2,
            local_rotary_base=100.0, **features,
        )  # fmt: skip
        model = GPTModel(
            config, get_gpt_layer_local_spec(), 32, 8, position_embedding_type="rope",
            pg_collection=ProcessGroupCollection(),
        )  # fmt: skip
        model.eval()
        for layer in model.decoder.layers:
            sinks = layer.self_attention.core_attention.softmax_offset
            if isinstance(sinks, torch.nn.Parameter):
                with torch.no_grad():
                    sinks.copy_(SINKS)
        ids = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            full = model(ids, torch.arange(8)[None])
            context, steps = StaticInferenceContext(1, 8), []
            for start, stop in [(0, 4), (4, 6), (6, 7), (7, 8)]:
                positions = torch.arange(start, stop)[None]
                steps.append(model(ids[:, start:stop], positions, inference_context=context))
                context.increment_sequence_len_offset(stop - start)
        return full, torch.cat(steps, dim=1)

    both = dict(softmax_type="learnable", attn_logit_softcapping=0.5)
    full, cached = logits(**both)
    assert (cached - full).abs().max() <= 1e-12 * full.abs().max()
    for left_out in ("softmax_type", "attn_logit_softcapping"):
        other, _ = logits(**{k: v for k, v in both.items() if k != left_out})
        assert (other - full).abs().max() > 1e-3, left_out


@pytest.mark.parametrize("features", [
    dict(softmax_type="learnable", attn_logit_softcapping=CAP, window_size=(2, 0)),
    dict(attn_logit_softcapping=CAP), dict(softmax_type="learnable"),
], ids=["both-window", "softcap", "sinks"])  # fmt: skip
def test_the_cached_attention_with_sinks_or_soft_caps_equals_the_reference(features):
    """The cached forward of a prompt with sinks, a soft-cap and a window (and the full
    forward) equal the independent autograd reference ``_reference`` (float64)."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=NQ, num_query_groups=NKV,
        kv_channels=D, attention_backend="unfused", attention_dropout=0.0,
        params_dtype=torch.float64, **features,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec().submodules.self_attention
    attention = SelfAttention(config, spec.submodules, 1, AttnMaskType.causal)
    torch.manual_seed(0)
    for param in attention.parameters():
        torch.nn.init.normal_(param, std=0.5)
    x = torch.randn(S, B, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    window = features.get("window_size", (None,))[0]
    sinks = attention.core_attention.softmax_offset
    with torch.no_grad():
        full, _ = attention(x, None)
        cached, _ = attention(x, None, inference_context=StaticInferenceContext(B, S))
        q, k, v = attention.get_query_key_value_tensors(x)
        cap = features.get("attn_logit_softcapping")
        context = _reference(q, k, v, window, torch.zeros(S), sinks, cap)
        expected, _ = attention.linear_proj(context.reshape(S, B, -1))
        plain = _reference(q, k, v, None, torch.zeros(S), None, None)
        plain, _ = attention.linear_proj(plain.reshape(S, B, -1))
    assert (plain - expected).abs().max() > 1e-3  # the features bite
    for got in (cached, full):
        assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(window_attn_skip_freq=2), r"window_attn_skip_freq=2 needs window_size \(LEFT, 0\)"),
        (
            dict(window_size=(-1, 0), window_attn_skip_freq=[1, 0]),
            r"window_attn_skip_freq=\[1, 0\] needs window_size",
        ),
    ],
)
def test_a_window_pattern_without_a_window_is_refused_by_name(changes, message):
    """``window_attn_skip_freq`` picks the layers that keep ``window_size``: one rule
    (``config_rules.window_attn_skip_freq_problems``) for the library and the trainer."""
    from megatron.core.transformer import TransformerConfig

    with pytest.raises(ValueError, match=message):
        TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, **changes)


def test_a_local_rotary_base_with_yarn_positions_is_refused_by_name():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, window_size=(2, 0),
        local_rotary_base=100.0, yarn_rotary_scaling_factor=4.0,
        yarn_original_max_position_embeddings=16, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="local_rotary_base=100.0 with position_emb"):
        GPTModel(config, get_gpt_layer_local_spec(), 32, 8, position_embedding_type="yarn")


def test_the_softcap_is_checked_once_when_the_layer_is_built_not_per_call(monkeypatch):
    """``DotProductAttention`` builds its kernel options (``Kernel``) once, the soft-cap
    checked there; its forward and backward check it no more (they did per call, and the
    kernels per block)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.cp_attention import kernels
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=2,
        kv_channels=D, attn_logit_softcapping=CAP, attention_dropout=0.0,
    )  # fmt: skip
    attention = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    checks = []
    check = kernels.softcap_kernel
    monkeypatch.setattr(kernels, "softcap_kernel", lambda *a: checks.append(a) or check(*a))
    q, k, v = _inputs()
    for _ in range(2):
        attention(q, k, v, None).sum().backward()
    assert not checks and q.grad is not None
    expected = _reference(q, k, v, None, torch.zeros(S))
    assert torch.allclose(attention(q, k, v, None).view_as(expected), expected, atol=1e-12)
