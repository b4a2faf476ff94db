"""An independent dense GPT for the parity tests: float64, one process, the whole sequence,
written with plain torch ops from the architecture's math (not from the model's modules).

``dense_gpt_losses(params, arch, tokens, labels)`` maps a dict of full parameters, named as in
the one-chunk megatron GPT (``decoder.layers.{i}.self_attention.linear_qkv.weight``, ...), to
per-token losses [b, s]:

    x = E[tokens] (+ P[positions])                       embeddings
    per layer: x += proj(attn(norm1(x))) ; x += fc2(act(fc1(norm2(x))))
    logits = norm_f(x) W_out^T, W_out = E when tied
    loss = label-smoothed cross-entropy (megatron's convention: the label keeps 1 - eps,
           the other V - 1 entries share eps)

Attention: the fused QKV output is, per query group g, [q_(g,1..h/g), k_g, v_g] (each d
wide); query head j uses key/value group j // (h/g); causal softmax(q k^T / sqrt(d)) v.
``qk_norm``: queries and keys are normalized per head (weights [d]) before RoPE; with
``qk_norm_whole`` over all heads of the projection at once (weights [h d] and [g d], OLMoE).
RoPE (``rope``): the first and second halves of q and k are rotated by angle
p * base^(-2i/d). SwiGLU (``swiglu``): fc1's output is [gate | up], act = silu(gate) * up.

Gemma's knobs: ``one_p`` norms y = norm(x) * (1 + w); ``sandwich`` norms the attention and
MLP outputs too (``post_self_attn_layernorm``, ``post_mlp_layernorm``) before each residual
add; ``embed_scale`` multiplies the embeddings by sqrt(hidden) rounded to float32;
``softmax_scale`` replaces 1/sqrt(d); ``geglu``: act = gelu_tanh(gate) * up;
``attn_softcap`` c: scores c tanh(s / c); ``final_softcap`` likewise on the logits;
``window`` W: a query sees keys i - W .. i on the window layers (all, or all but every
``skip_freq``-th, 1-based), which rotate by base ``local_base`` when given; the other
layers' positions are divided by ``rope_factor`` (linear RoPE scaling).
"""

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Arch:
    """The architecture knobs the reference follows."""

    name: str
    layers: int
    hidden: int
    heads: int
    groups: int
    ffn: int
    vocab: int
    norm: str  # "LayerNorm" | "RMSNorm"
    swiglu: bool
    rope: bool
    bias: bool
    tied: bool
    eps: float = 1e-5
    label_smoothing: float = 0.0
    qk_norm: bool = False
    qk_norm_whole: bool = False
    one_p: bool = False
    sandwich: bool = False
    embed_scale: bool = False
    softmax_scale: Optional[float] = None
    geglu: bool = False
    attn_softcap: Optional[float] = None
    final_softcap: Optional[float] = None
    window: Optional[int] = None
    skip_freq: Optional[int] = None
    local_base: Optional[float] = None
    rope_factor: float = 1.0  # linear scaling of the full-attention layers' positions

    def window_layer(self, layer: int) -> bool:
        """Whether 0-based ``layer`` has the sliding window."""
        if self.window is None:
            return False
        return self.skip_freq is None or (layer + 1) % self.skip_freq != 0


MLP = Callable[[int, torch.Tensor, Dict[str, torch.Tensor]], torch.Tensor]


def dense_gpt_losses(
    params: Dict[str, torch.Tensor],
    arch: Arch,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    mlp: Optional[MLP] = None,
) -> torch.Tensor:
    """Per-token losses [b, s] of the dense model on [b, s] tokens and labels.

    ``mlp(layer, h, p)``, when given, replaces the dense MLP: it maps the normalized hidden
    states h [b, s, hidden] of layer ``layer`` (p: that layer's parameters, unprefixed) to
    the MLP's output (the mixture-of-experts reference plugs in here)."""
    b, s = tokens.shape
    d = arch.hidden // arch.heads
    x = params["embedding.word_embeddings.weight"][tokens]
    if arch.embed_scale:
        x = x * float(torch.tensor(arch.hidden**0.5, dtype=torch.float32))
    if not arch.rope:
        x = x + params["embedding.position_embeddings.weight"][torch.arange(s)]
    for layer in range(arch.layers):
        p = _prefixed(params, f"decoder.layers.{layer}.")
        h = _norm(x, p, "input_layernorm", arch)
        qkv = _linear(h, p, "self_attention.linear_qkv")
        per_group = arch.heads // arch.groups
        qkv = qkv.view(b, s, arch.groups, per_group + 2, d)
        q = qkv[:, :, :, :per_group].reshape(b, s, arch.heads, d)
        k, v = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]
        if arch.qk_norm_whole:  # over all h d (q) and g d (k) channels of a token
            q = _norm(q.reshape(b, s, -1), p, "self_attention.q_layernorm", arch).view(q.shape)
            k = _norm(k.reshape(b, s, -1), p, "self_attention.k_layernorm", arch).view(k.shape)
        elif arch.qk_norm:  # over each head's d channels
            q = _norm(q, p, "self_attention.q_layernorm", arch)
            k = _norm(k, p, "self_attention.k_layernorm", arch)
        windowed = arch.window_layer(layer)
        if arch.rope:
            local = windowed and arch.local_base
            base = arch.local_base if local else 10000.0
            factor = 1.0 if local else arch.rope_factor
            q, k = _rope(q, d, base, factor), _rope(k, d, base, factor)
        k = k.repeat_interleave(per_group, dim=2)
        v = v.repeat_interleave(per_group, dim=2)
        scale = arch.softmax_scale or 1 / math.sqrt(d)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
        if arch.attn_softcap is not None:
            scores = torch.tanh(scores / arch.attn_softcap) * arch.attn_softcap
        allowed = torch.ones(s, s, dtype=torch.bool).tril()
        if windowed:
            allowed &= torch.ones(s, s, dtype=torch.bool).triu(-arch.window)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        context = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, arch.heads * d)
        out = _linear(context, p, "self_attention.linear_proj")
        x = x + (_norm(out, p, "post_self_attn_layernorm", arch) if arch.sandwich else out)
        h = _norm(x, p, "pre_mlp_layernorm", arch)
        out = mlp(layer, h, p) if mlp is not None else dense_mlp(h, p, "mlp", arch.swiglu, arch)
        x = x + (_norm(out, p, "post_mlp_layernorm", arch) if arch.sandwich else out)
    x = _norm(x, params, "decoder.final_layernorm", arch)
    out = params["embedding.word_embeddings.weight" if arch.tied else "output_layer.weight"]
    logits = x @ out.t()
    if arch.final_softcap is not None:
        logits = torch.tanh(logits / arch.final_softcap) * arch.final_softcap
    return _smoothed_cross_entropy(logits, labels, arch.label_smoothing)


def dense_mlp(
    h: torch.Tensor,
    p: Dict[str, torch.Tensor],
    prefix: str,
    swiglu: bool,
    arch: Optional[Arch] = None,
):
    """fc2(act(fc1(h))) with the weights ``{prefix}.linear_fc1/2``; SwiGLU: fc1's output is
    [gate | up], act = silu(gate) * up; GeGLU (``arch.geglu``): gelu_tanh(gate) * up; else
    gelu."""
    u = _linear(h, p, f"{prefix}.linear_fc1")
    if arch is not None and arch.geglu:
        gate, up = u.chunk(2, dim=-1)
        u = F.gelu(gate, approximate="tanh") * up
    elif swiglu:
        gate, up = u.chunk(2, dim=-1)
        u = F.silu(gate) * up
    else:
        u = F.gelu(u)
    return _linear(u, p, f"{prefix}.linear_fc2")


def _prefixed(params: Dict[str, torch.Tensor], prefix: str) -> Dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}


def _linear(x: torch.Tensor, p: Dict[str, torch.Tensor], name: str) -> torch.Tensor:
    y = x @ p[f"{name}.weight"].t()
    bias = p.get(f"{name}.bias")
    return y if bias is None else y + bias


def _norm(x: torch.Tensor, p: Dict[str, torch.Tensor], name: str, arch: Arch) -> torch.Tensor:
    weight = p[f"{name}.weight"] + (1 if arch.one_p else 0)
    if arch.norm == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + arch.eps) * weight
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + arch.eps) * weight + p[f"{name}.bias"]


def _rope(t: torch.Tensor, d: int, base: float = 10000.0, factor: float = 1.0) -> torch.Tensor:
    """Rotate channel pairs (i, i + d/2) of t [b, s, n, d] by position / factor *
    base^(-2i/d)."""
    s = t.shape[1]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    positions = torch.arange(s, dtype=torch.float64) / factor
    angles = positions[:, None] * inv_freq[None, :]  # [s, d/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    first, second = t[..., : d // 2], t[..., d // 2 :]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def _smoothed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, eps: float):
    """-(1 - eps) log p_label - eps/(V - 1) sum_{j != label} log p_j, per token."""
    logp = logits.log_softmax(dim=-1)
    nll = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if eps == 0.0:
        return nll
    vocab = logits.shape[-1]
    others = -(logp.sum(-1)) - nll
    return (1 - eps) * nll + eps / (vocab - 1) * others
