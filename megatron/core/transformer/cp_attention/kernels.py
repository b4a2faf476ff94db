"""Flash-class attention kernels with their log-sum-exp, called forward and backward by hand.

Context-parallel attention computes attention in blocks and merges the partial results, so it
needs each kernel's log-sum-exp (LSE) and its backward op, which PyTorch exposes only as aten
ops (``F.scaled_dot_product_attention`` returns neither, and the LSE is not differentiable).
This module wraps those ops behind one calling convention:

- ``Kernel``: what every block of a call is computed with (the kernel, the softmax scale,
  the sliding window, the logit soft-cap), built and checked once;
- ``attention_forward(q, k, v, causal, kernel)`` -> ``(out, lse)`` on [b, s, n, d] tensors
  (or [s, b, n, d], [b, n, s, d] by ``layout=``: one view to the kernels' layout),
  ``lse`` float32 [b, n, s_q] with lse_i = log sum_j exp(scale * q_i . k_j) over allowed j;
- ``attention_backward(dout, q, k, v, out, lse, causal, kernel)`` -> ``(dq, dk, dv)``, where
  ``out`` and ``lse`` may be the *merged* results of several blocks: the kernels rebuild
  P = exp(scale * Q K^T - lse) and D = rowsum(dout * out) from them, so each block then gets
  exactly its share of the gradient of the merged attention;
- packed sequences (``varlen_forward`` / ``varlen_backward``) are module ``varlen``'s.

``causal`` is always bottom-right aligned: query i of s_q attends key j of s_k when
j <= i + s_k - s_q (the queries are the last s_q positions of the keys' span). Kernels whose
own ``is_causal`` is top-left aligned for s_q != s_k (cuDNN, the CPU flash op) get the
rectangle split into a mask-free part and a square causal part, merged by LSE. Grouped-query
attention (fewer key/value heads) is expanded per call for kernels that lack it, and the key
and value gradients are summed back over each group in float32.

Kernels (``kernel=`` names; which one runs by default, and the config and environment
choices, is ``kernel_choice``'s):
``"flash"`` (CUDA: ``aten._scaled_dot_product_flash_attention``; bottom-right causal),
``"efficient"`` (CUDA: ``aten._efficient_attention_forward``, custom mask type 2 =
bottom-right; its LSE is padded along queries to a multiple of 32 and sliced here),
``"cudnn"`` (CUDA: ``aten._scaled_dot_product_cudnn_attention``; its causal alignment for
s_q != s_k is measured once at run time), ``"cpu"`` (CPU:
``aten._scaled_dot_product_flash_attention_for_cpu``, any float dtype, used by the tests).
``"math"`` (any device and dtype: one explicit [s_q, s_k] score block per call; the
fallback on CUDA for what the fused kernels refuse: float64, or a head dimension that is not
a multiple of 8, such as megatron-core's simple example with hidden 12 and 4 heads).
"""

import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron.core.transformer.cp_attention.kernel_choice import resolve_kernel


@dataclass(frozen=True)
class Kernel:
    """How every block of a call is computed: the kernel (``name``: ``kernel_choice``'s names;
    None or "auto": the default for the tensors), the softmax ``scale``, the sliding
    ``window`` (how many earlier keys a query sees; None: all) and the logit ``softcap``
    (None: none). The soft-cap is checked here, once, where the call or the layer is built:
    only the "math" kernel computes it, so ``name`` becomes "math" (``softcap_kernel``)."""

    name: Optional[str]
    scale: float
    window: Optional[int] = None
    softcap: Optional[float] = None

    def __post_init__(self) -> None:
        if self.softcap is not None:
            object.__setattr__(self, "name", softcap_kernel(self.name, self.softcap))


def softcap_kernel(kernel: Optional[str], softcap: float) -> str:
    """The kernel that computes logit soft-capping: "math" (for ``kernel`` None, "auto" or
    "math"); a ValueError naming the kernel and the cap otherwise."""
    if not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(
            f"context_parallel_attention: softcap must be a finite number > 0, got {softcap!r}"
        )
    if kernel not in (None, "auto", "math"):
        raise ValueError(
            f"attention kernel {kernel!r} has no logit soft-capping (attn_logit_softcapping="
            f"{softcap}); only the explicit 'math' kernel has (attention_backend 'unfused', "
            "'local' or 'auto')"
        )
    return "math"


def attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    causal: bool,
    kernel: Kernel,
    layout: str = "bsnd",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale * Q K^T [+ causal mask]) V and its LSE, for [b, s, n, d] inputs.

    Returns ``out`` [b, s_q, n_q, d] (input dtype) and ``lse`` float32 [b, n_q, s_q].
    A causal block needs s_q <= s_k (bottom-right alignment). Rows without keys (s_k = 0)
    get out = 0 and lse = -inf. ``layout``: inputs and ``out`` are [s, b, n, d] for "sbnd"
    (megatron's), [b, n, s, d] for "bnsd" (the kernels' own); the LSE is [b, n, s] always.
    ``kernel.window`` (causal only): a sliding window, query i (at key position
    p = i + s_k - s_q) sees keys p - window .. p. ``kernel.softcap`` (Gemma 2's attention
    logit soft-capping): the scores are softcap * tanh(scale * Q K^T / softcap).
    """
    spec = kernel_spec(resolve_kernel(kernel.name, query, kernel.window is not None))
    q, k, v = (_heads_first(x, layout) for x in (query, key, value))
    b, n_q, s_q, d = q.shape
    s_k = k.shape[2]
    if causal and s_q > s_k:
        raise ValueError(
            f"attention_forward: a causal block needs s_q <= s_k (bottom-right), got "
            f"s_q={s_q}, s_k={s_k}"
        )
    if s_q == 0 or s_k == 0:
        lse = torch.full(
            (b, n_q, s_q), -math.inf, device=query.device, dtype=acc_dtype(query.dtype)
        )
        return query.new_zeros(query.shape), lse
    route = _route(spec, causal, kernel, s_q, s_k, query.device)
    if route == "unmasked":
        out, lse = _unmasked_forward(q, k, v, kernel.scale, spec)
        return _from_heads_first(out, layout), lse
    k, v = expand_kv(k, v, n_q)
    scale, window = kernel.scale, kernel.window
    if route == "softcap":
        out, lse = _math_forward(q, k, v, causal, scale, window, kernel.softcap)
    elif route == "window":
        out, lse = spec.window_forward(q, k, v, scale, window)
    elif route == "split":
        out, lse = _split_forward(q, k, v, scale, spec)
    else:
        out, lse = spec.forward(q, k, v, causal, scale)
    return _from_heads_first(out, layout), lse


def attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    kernel: Kernel,
    layout: str = "bsnd",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the block (query, key, value) given the final ``out`` and ``lse``.

    ``out`` [b, s_q, n_q, d] and ``lse`` [b, n_q, s_q] are those of the whole (merged)
    attention these queries take part in. dk, dv have key's head count; with grouped-query
    attention they are float32 sums over the query heads of each group. ``layout`` and
    ``kernel`` as in ``attention_forward``. Every row has a key here (s_k > 0, and a causal
    block is bottom-right), so ``lse`` is finite and goes to the kernel as it is.
    """
    spec = kernel_spec(resolve_kernel(kernel.name, query, kernel.window is not None))
    if query.numel() == 0 or key.numel() == 0:
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    tensors = (grad_out, query, key, value, out)
    do, q, k, v, o = (_heads_first(x, layout) for x in tensors)
    n_q, n_kv = q.shape[1], k.shape[1]
    route = _route(spec, causal, kernel, q.shape[2], k.shape[2], query.device)
    if route == "unmasked":
        grads = _unmasked_backward(do, q, k, v, o, lse, kernel.scale, spec)
        return tuple(_from_heads_first(x, layout) for x in grads)
    k_exp, v_exp = expand_kv(k, v, n_q)
    scale, window = kernel.scale, kernel.window
    if route == "softcap":
        grads = _math_backward(do, q, k_exp, v_exp, o, lse, causal, scale, window, kernel.softcap)
    elif route == "window":
        grads = spec.window_backward(do, q, k_exp, v_exp, o, lse, scale, window)
    elif route == "split":
        grads = _split_backward(do, q, k_exp, v_exp, o, lse, scale, spec)
    else:
        grads = spec.backward(do, q, k_exp, v_exp, o, lse, causal, scale)
    dq, dk, dv = grads
    if k_exp.shape[1] != n_kv:
        dk, dv = (sum_groups(x, n_kv) for x in (dk, dv))
    return tuple(_from_heads_first(x, layout) for x in (dq, dk, dv))


def _route(spec, causal: bool, kernel: Kernel, s_q: int, s_k: int, device) -> str:
    """How a non-empty block runs, decided once for its forward and its backward:
    ``"softcap"`` (soft-capped scores: the explicit maths, the kernel being "math"),
    ``"window"`` (the kernel's sliding-window op), ``"unmasked"`` (causal with one query:
    bottom-right, it is the last position and sees every key, so the kernel runs without a
    mask: a decoding step's one call), ``"split"`` (causal with s_q < s_k on a kernel whose
    own causal mask is top-left: a mask-free prefix plus a square causal block, merged by
    LSE) or ``"plain"`` (the kernel's own op)."""
    if kernel.window is not None:
        _check_window(spec, causal, kernel.window)
    if kernel.softcap is not None:
        return "softcap"
    if kernel.window is not None:
        return "window"
    if causal and s_q == 1:
        return "unmasked"
    if causal and s_q < s_k and not bottom_right_causal(spec, device):
        return "split"
    return "plain"


# layout -> (the permutation to the kernels' [b, n, s, d], and back)
_LAYOUTS = {
    "bsnd": ((0, 2, 1, 3), (0, 2, 1, 3)),
    "sbnd": ((1, 2, 0, 3), (2, 0, 1, 3)),
    "bnsd": ((0, 1, 2, 3), (0, 1, 2, 3)),
}


def _heads_first(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x in ``layout`` as the kernels' [b, n, s, d] (a view)."""
    if layout not in _LAYOUTS:
        raise ValueError(f"attention layout must be one of {sorted(_LAYOUTS)}, got {layout!r}")
    return x.permute(_LAYOUTS[layout][0])


def _from_heads_first(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.permute(_LAYOUTS[layout][1])


# ----------------------------------------------------------------------------- LSE merging


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for LSEs, merged outputs and summed gradients: float32, or float64
    for float64 inputs (the CPU kernel computes float64 end to end)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """LSE with the +inf that flash kernels give rows without keys replaced by -inf.

    A row with no keys has an empty sum, log 0 = -inf; merging a +inf would make that row's
    weight 1 and wipe out the real blocks, so it never reaches a merge as +inf.
    """
    return torch.where(lse == math.inf, -math.inf, lse)


def backward_lse(lse: torch.Tensor) -> torch.Tensor:
    """LSE for a backward op: rows without keys get +inf, so exp(s - lse) = 0 there.

    (-inf would turn the kernel's exp(s - lse) into inf for such rows.)
    """
    return torch.where(lse == -math.inf, math.inf, lse)


def merge_into(
    acc_out: torch.Tensor,
    acc_lse: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    layout: str = "bsnd",
    rows_have_keys: bool = False,
) -> None:
    """Merge a block (out, lse) into the running float32 (acc_out, acc_lse), in place.

    L = log(e^{L_a} + e^{L_b}); O = O_a + w (O_b - O_a) with the block's weight
    w = e^{L_b - L} = sigmoid(L_b - L_a) (one ``lerp``). ``acc_out``/``out`` [b, s, n, d]
    (``layout``: or [s, b, n, d], [b, n, s, d]); lse [b, n, s]. Rows where both are -inf
    (no keys yet) stay 0 / -inf, and a block's +inf (a row without keys on flash kernels)
    counts as -inf; ``rows_have_keys`` (every row of both has a key: finite LSEs) skips
    those two guards.
    """
    if not rows_have_keys:
        lse = finite_lse(lse)
    weight = torch.sigmoid(lse - acc_lse)
    if not rows_have_keys:
        weight = weight.nan_to_num_(0.0)  # -inf - -inf: no keys in either
    torch.logaddexp(acc_lse, lse, out=acc_lse)
    weight = _from_heads_first(weight.unsqueeze(-1), layout)
    acc_out.lerp_(out.to(acc_out.dtype), weight)


# ----------------------------------------------------------------------------- kernel table


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: forward/backward callables on [b, n, s, d] (SDPA's layout, so the fused
    ops take their inputs as views) and what it supports."""

    name: str
    forward: object
    backward: object
    bottom_right_causal: Optional[bool]  # None: measured at run time
    # causal with a sliding window (q, k, v, scale, window) / (dout, ..., lse, scale, window);
    # None: the kernel has none here
    window_forward: object = None
    window_backward: object = None


def _check_window(spec: KernelSpec, causal: bool, window: int) -> None:
    if not causal or not isinstance(window, int) or window < 0:
        raise ValueError(
            f"attention: a sliding window needs a causal block and window >= 0, got "
            f"causal={causal}, window={window!r}"
        )
    if spec.window_forward is None:
        raise ValueError(
            f"attention kernel {spec.name!r} has no sliding window (window_size); the flash "
            "kernel (CUDA fp16/bf16), the CPU kernel and 'math' have one (attention_backend "
            "'flash', 'unfused' or 'auto')"
        )


def bottom_right_causal(spec: KernelSpec, device: torch.device) -> bool:
    """Whether the kernel's own causal mask is bottom-right aligned for s_q < s_k.

    Fixed for flash, efficient (bottom-right) and the CPU op (top-left); for cuDNN it
    depends on the installed torch, so it is measured once per device with a tiny call.
    """
    if spec.bottom_right_causal is not None:
        return spec.bottom_right_causal
    return _measure_bottom_right(spec.name, device)


@functools.lru_cache(maxsize=None)
def _measure_bottom_right(name: str, device: torch.device) -> bool:
    """Query 0 of 64 against 128 keys: bottom-right sees keys 0..64, top-left key 0 only;
    with v = one-hot key index the output's mass beyond key 0 tells them apart."""
    spec = _SPECS[name]
    q = torch.zeros(1, 1, 64, 64, device=device, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 128, 64, device=device, dtype=torch.bfloat16)
    v = torch.zeros(1, 1, 128, 64, device=device, dtype=torch.bfloat16)
    v[0, 0, 1:, 0] = 1.0  # every key but the first carries 1 in channel 0
    out, _ = spec.forward(q, k, v, True, 1.0)
    return bool(out[0, 0, 0, 0].float() > 0.5)  # top-left: 0; bottom-right: 64/65


def kernel_spec(name: str) -> KernelSpec:
    """The ``KernelSpec`` of kernel ``name``."""
    return _SPECS[name]


def _flash_forward(q, k, v, causal, scale):
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    keep_rng("flash", q.device, res[6], res[7])
    return res[0], res[1]


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    seed, offset = forward_rng("flash", q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), _UNDEFINED, _UNDEFINED, q.shape[2], k.shape[2],
        0.0, causal, seed, offset, scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def _efficient_forward(q, k, v, causal, scale):
    """The efficient kernel takes [b, s, n, d]."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    res = torch.ops.aten._efficient_attention_forward(
        q, k, v, None, None, None, None, None, 0.0, 2 if causal else 0, True, scale=scale
    )
    keep_rng("efficient", q.device, res[2], res[3])
    return res[0].transpose(1, 2), res[1][:, :, : q.shape[1]]


def _efficient_backward(dout, q, k, v, out, lse, causal, scale):
    dout, q, k, v, out = (x.transpose(1, 2) for x in (dout, q, k, v, out))
    s_q = q.shape[1]
    padded = 32 * math.ceil(s_q / 32)
    lse = torch.nn.functional.pad(lse, (0, padded - s_q)).contiguous()
    seed, offset = forward_rng("efficient", q.device)
    dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
        dout.contiguous(), q, k, v, None, out.contiguous(), None, None, s_q, k.shape[1], lse,
        0.0, seed, offset, 2 if causal else 0, False, scale=scale,
    )  # fmt: skip
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _cudnn_forward(q, k, v, causal, scale):
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    keep_rng("cudnn", q.device, res[6], res[7])
    return res[0], res[1].reshape(q.shape[:3])


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    seed, offset = forward_rng("cudnn", q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.unsqueeze(-1).contiguous(), seed, offset, _UNDEFINED,
        _UNDEFINED, _UNDEFINED, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def _window_mask(s_q: int, s_k: int, window: int, dtype, device) -> torch.Tensor:
    """Additive [s_q, s_k] mask: 0 where query i (key position p = i + s_k - s_q) may see key
    j, p - window <= j <= p; -inf elsewhere."""
    return torch.zeros((s_q, s_k), dtype=dtype, device=device).masked_fill_(
        ~_window_allowed(s_q, s_k, window, device), -math.inf
    )


def _window_allowed(s_q: int, s_k: int, window: Optional[int], device) -> torch.Tensor:
    """Boolean [s_q, s_k]: bottom-right causal, and within ``window`` keys when given."""
    rows = torch.arange(s_q, device=device).unsqueeze(1) + (s_k - s_q)
    cols = torch.arange(s_k, device=device).unsqueeze(0)
    allowed = cols <= rows
    if window is not None:
        allowed &= cols >= rows - window
    return allowed


def _cpu_window_forward(q, k, v, scale, window):
    """The CPU op with an explicit additive mask ([s_q, s_k]: the CPU op has no window)."""
    mask = _window_mask(q.shape[2], k.shape[2], window, q.dtype, q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale
    )


def _cpu_window_backward(dout, q, k, v, out, lse, scale, window):
    mask = _window_mask(q.shape[2], k.shape[2], window, q.dtype, q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.to(acc_dtype(q.dtype)).contiguous(), 0.0, False,
        attn_mask=mask, scale=scale,
    )  # fmt: skip


def _flash_window_forward(q, k, v, scale, window):
    """flash-attn's own op (``_flash_attention_forward``, [b, s, n, d]) with its left window;
    SDPA's flash op has no window argument."""
    q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
    out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
        q_t, k_t, v_t, None, None, q.shape[2], k.shape[2], 0.0, True, False, scale=scale,
        **flash_window(window),
    )  # fmt: skip
    keep_rng("flash", q.device, seed, offset)
    return out.transpose(1, 2), lse


def _flash_window_backward(dout, q, k, v, out, lse, scale, window):
    seed, offset = forward_rng("flash", q.device)
    dout_t, q_t, k_t, v_t, out_t = (x.transpose(1, 2) for x in (dout, q, k, v, out))
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout_t.contiguous(), q_t, k_t, v_t, out_t.contiguous(), lse.contiguous(), None, None,
        q.shape[2], k.shape[2], 0.0, True, seed, offset, scale=scale, **flash_window(window),
    )  # fmt: skip
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _cpu_forward(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )


def _cpu_backward(dout, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.to(acc_dtype(q.dtype)).contiguous(), 0.0, causal, scale=scale
    )


def _math_forward(q, k, v, causal, scale, window=None, softcap=None):
    """Explicit block: lse = logsumexp(S [+ bottom-right mask]), out = P V, with
    S = scale * Q K^T (or softcap * tanh(scale * Q K^T / softcap))."""
    qh, kh, vh = (x.to(acc_dtype(q.dtype)) for x in (q, k, v))
    probs, lse, _ = _math_probs(qh, kh, None, causal, scale, window, softcap)
    return (probs @ vh).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, scale, window=None, softcap=None):
    """With P = exp(S - lse) and D = rowsum(dO * O): dS = P (dO V^T - D) (times
    1 - tanh^2 under ``softcap``), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO
    (``out``/``lse`` may be a merge of several blocks)."""
    dtype = acc_dtype(q.dtype)
    qh, kh, vh, do, oh = (x.to(dtype) for x in (q, k, v, dout, out))
    probs, _, tanh = _math_probs(qh, kh, lse.to(dtype), causal, scale, window, softcap)
    dscores = probs * (do @ vh.transpose(-1, -2) - (do * oh).sum(-1, keepdim=True))
    if tanh is not None:
        dscores = dscores * (1 - tanh * tanh)
    dq = (dscores @ kh) * scale
    dk = (dscores.transpose(-1, -2) @ qh) * scale
    dv = probs.transpose(-1, -2) @ do
    return tuple(g.to(q.dtype) for g in (dq, dk, dv))


def _math_probs(qh, kh, lse, causal, scale, window=None, softcap=None):
    """P = exp(S - lse) on [b, n, s_q, s_k] (lse computed here when None), the lse, and
    tanh(scale * Q K^T / softcap) under ``softcap`` (else None)."""
    scores, tanh = (qh @ kh.transpose(-1, -2)) * scale, None
    if softcap is not None:
        tanh = torch.tanh(scores / softcap)
        scores = tanh * softcap
    if causal:
        s_q, s_k = scores.shape[-2:]
        allowed = _window_allowed(s_q, s_k, window, scores.device)
        scores = scores.masked_fill(~allowed, -math.inf)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)), lse, tanh


# An undefined tensor for the backward ops' unused cumulative-length arguments (dense mode),
# as the dense forward ops return them.
_UNDEFINED = None

# The (philox seed, offset) a forward op returned, per (kernel, device): dropout is 0, so
# the backward ops never read them, but they expect tensors of the forward's kind. Every
# CUDA forward keeps its pair here (``keep_rng``) and every backward passes it back
# (``forward_rng``), the packed-sequence ops of ``varlen`` included.
_RNG_STATE: dict = {}


def keep_rng(name: str, device: torch.device, seed: torch.Tensor, offset: torch.Tensor) -> None:
    """Keep the first (seed, offset) pair kernel ``name``'s forward returned on ``device``."""
    _RNG_STATE.setdefault((name, device), (seed, offset))


def forward_rng(name: str, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The (seed, offset) kept by ``keep_rng`` (int64 zeros before any forward ran)."""
    if (name, device) not in _RNG_STATE:
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return zero, zero
    return _RNG_STATE[(name, device)]


def flash_window(window: Optional[int]) -> dict:
    """The flash ops' window arguments: left ``window``, right 0 (none: no arguments)."""
    return {} if window is None else {"window_size_left": window, "window_size_right": 0}


_SPECS = {
    "flash": KernelSpec(
        "flash", _flash_forward, _flash_backward, True,
        _flash_window_forward, _flash_window_backward,
    ),  # fmt: skip
    "efficient": KernelSpec("efficient", _efficient_forward, _efficient_backward, True),
    "cudnn": KernelSpec("cudnn", _cudnn_forward, _cudnn_backward, None),
    "cpu": KernelSpec(
        "cpu", _cpu_forward, _cpu_backward, False, _cpu_window_forward, _cpu_window_backward
    ),
    "math": KernelSpec(
        "math", _math_forward, _math_backward, True,
        lambda q, k, v, scale, window: _math_forward(q, k, v, True, scale, window),
        lambda do, q, k, v, o, lse, scale, window: _math_backward(
            do, q, k, v, o, lse, True, scale, window
        ),
    ),  # fmt: skip
}


# ----------------------------------------------------------------------------- helpers


def _unmasked_forward(q, k, v, scale, spec: KernelSpec):
    """A causal block of one query ([b, n, s, d] tensors, s_q = 1): bottom-right, the query
    is the last position and sees every key, so one call without a mask. Grouped-query
    heads need no expanded keys: the g = n_q / n_kv query heads of each key/value head run
    as g queries of that head (a decoding step does not copy its whole cache per layer)."""
    b, n_q, s_q, d = q.shape
    n_kv = k.shape[1]
    out, lse = spec.forward(_fold_heads(q, n_kv), k, v, False, scale)
    return out.reshape(b, n_q, s_q, out.shape[-1]), lse.reshape(b, n_q, s_q)


def _unmasked_backward(do, q, k, v, o, lse, scale, spec: KernelSpec):
    """The backward of ``_unmasked_forward``: dk and dv come out with the key heads (float32
    under grouped-query attention, as ``sum_groups``' sums)."""
    n_kv = k.shape[1]
    do_, q_, o_ = (_fold_heads(x, n_kv) for x in (do, q, o))
    lse_ = lse.reshape(lse.shape[0], n_kv, -1)
    dq, dk, dv = spec.backward(do_, q_, k, v, o_, lse_, False, scale)
    if n_kv != q.shape[1]:
        dk, dv = dk.to(acc_dtype(dk.dtype)), dv.to(acc_dtype(dv.dtype))
    return dq.reshape(q.shape), dk, dv


def _fold_heads(x: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[b, n_q, s, d] -> [b, n_kv, (n_q / n_kv) s, d]: query heads h = j g + i (key head j,
    as ``expand_kv`` pairs them) become rows of key head j."""
    b, n_q, s, d = x.shape
    return x.reshape(b, n_kv, (n_q // n_kv) * s, d)


def _split_forward(q, k, v, scale, spec: KernelSpec):
    """Bottom-right causal with s_q < s_k as a mask-free prefix plus a square causal block
    ([b, n, s, d] tensors, key/value heads already expanded)."""
    prefix = k.shape[2] - q.shape[2]
    out, lse = spec.forward(q, k[:, :, :prefix], v[:, :, :prefix], False, scale)
    acc, acc_lse = out.to(acc_dtype(q.dtype)), lse.to(acc_dtype(q.dtype))
    o2, l2 = spec.forward(q, k[:, :, prefix:], v[:, :, prefix:], True, scale)
    merge_into(acc, acc_lse, o2, l2, layout="bnsd", rows_have_keys=True)
    return acc.to(q.dtype), acc_lse


def _split_backward(dout, q, k, v, out, lse, scale, spec: KernelSpec):
    """The backward of ``_split_forward`` (key/value heads expanded; the caller sums them)."""
    prefix = k.shape[2] - q.shape[2]
    dq1, dk1, dv1 = spec.backward(
        dout, q, k[:, :, :prefix], v[:, :, :prefix], out, lse, False, scale
    )
    dq2, dk2, dv2 = spec.backward(
        dout, q, k[:, :, prefix:], v[:, :, prefix:], out, lse, True, scale
    )
    dq = (dq1.to(acc_dtype(q.dtype)) + dq2).to(q.dtype)
    return dq, torch.cat([dk1, dk2], dim=2), torch.cat([dv1, dv2], dim=2)


def expand_kv(k, v, n_q: int, head_dim: int = 1):
    """Repeat each key/value head for its n_q / n_kv query heads (head dim 1 of [b, n, s, d]
    or of [t, n, d]): none of the kernels here takes grouped-query attention natively."""
    n_kv = k.shape[head_dim]
    if n_kv == n_q:
        return k, v
    rep = n_q // n_kv
    return (x.repeat_interleave(rep, dim=head_dim) for x in (k, v))


def sum_groups(grad: torch.Tensor, n_kv: int, head_dim: int = 1) -> torch.Tensor:
    """Sum a gradient over each group of n_q / n_kv heads (head dim 1 of [b, n_q, s, d] or of
    [t, n_q, d], as in ``expand_kv``), in float32."""
    shape = grad.shape
    groups = shape[:head_dim] + (n_kv, shape[head_dim] // n_kv) + shape[head_dim + 1 :]
    return grad.to(acc_dtype(grad.dtype)).view(groups).sum(dim=head_dim + 1)
