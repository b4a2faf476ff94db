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


def _reference(q, k, v, window, documents):
    """[s, b, n, d] float64 autograd reference."""
    qh, kh, vh = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    kh, vh = (x.repeat_interleave(NQ // NKV, dim=1) for x in (kh, vh))
    scores = torch.tanh((qh @ kh.transpose(-1, -2)) / math.sqrt(D) / CAP) * CAP
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = (j <= i) & (documents[:, None] == documents[None, :])
    if window is not None:
        allowed &= j >= i - window
    scores = scores.masked_fill(~allowed, -math.inf)
    return (torch.softmax(scores, -1) @ vh).permute(2, 0, 1, 3)


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
