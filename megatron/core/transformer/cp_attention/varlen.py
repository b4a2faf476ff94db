"""Packed sequences on the kernels: each sequence attended on its own, forward and backward.

``varlen_forward`` / ``varlen_backward`` take [t, n, d] tensors with the sequences' cumulative
lengths (``SeqLens``). CUDA half precision uses ``aten._flash_attention_forward`` with
cumulative lengths where the installed torch has it (detected at run time; if it raises, a
warning and this process falls back); otherwise a loop over sequences with the dense kernel
of ``kernels``.
"""

import dataclasses
import functools
import math
import warnings
from typing import List, NamedTuple, Tuple

import torch

from megatron.core.transformer.cp_attention.kernel_choice import resolve_kernel
from megatron.core.transformer.cp_attention.kernels import (
    Kernel,
    acc_dtype,
    attention_backward,
    attention_forward,
    backward_lse,
    expand_kv,
    finite_lse,
    flash_window,
    forward_rng,
    keep_rng,
    sum_groups,
)


class SeqLens(NamedTuple):
    """Packed sequences: query rows cu_q[i]:cu_q[i+1] and key rows cu_k[i]:cu_k[i+1] form
    sequence i (int tensors, on the tensors' device for the flash op); the longest of each."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def varlen_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: SeqLens,
    causal: bool,
    kernel: Kernel,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of packed sequences: each sequence's query rows see its key rows only
    (bottom-right causal within each sequence when ``causal``; ``kernel``'s window and
    soft-cap as in ``attention_forward``, within each sequence: the soft-cap sequence by
    sequence on the "math" kernel).

    ``query`` [t_q, n_q, d], ``key``/``value`` [t_k, n_kv, d]; returns ``out`` [t_q, n_q, d]
    and float32 ``lse`` [n_q, t_q]. Rows outside every sequence get out = 0, lse = -inf.
    """
    kernel = _resolved(kernel, query)
    if kernel.softcap is None and _use_varlen(query, lengths.cu_q):
        result = _guarded_varlen(
            _flash_varlen_forward, query, key, value, *lengths, causal, kernel.scale,
            kernel.window,
        )  # fmt: skip
        if result is not None:
            return result
    out = query.new_zeros(query.shape)
    lse = torch.full(
        (query.shape[1], query.shape[0]),
        -math.inf,
        device=query.device,
        dtype=acc_dtype(query.dtype),
    )
    for (q0, q1), (k0, k1) in _segments(lengths):
        if q1 == q0:
            continue
        blocks = (x.unsqueeze(0) for x in (query[q0:q1], key[k0:k1], value[k0:k1]))
        o, lse_blk = attention_forward(*blocks, causal, kernel)
        out[q0:q1], lse[:, q0:q1] = o[0], lse_blk[0]
    return out, lse


# The dense backward's arguments (``kernels.attention_backward``) with the sequences' lengths
# instead of a layout: the two signatures repeat by design.
def varlen_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    lengths: SeqLens,
    causal: bool,
    kernel: Kernel,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``varlen_forward``; dk/dv float32 where summed over sequences or groups."""
    kernel = _resolved(kernel, query)
    if kernel.softcap is None and _use_varlen(query, lengths.cu_q):
        grads = _guarded_varlen(
            _flash_varlen_backward, grad_out, query, key, value, out, lse, *lengths, causal,
            kernel.scale, kernel.window,
        )  # fmt: skip
        if grads is not None:
            return grads
    dq = torch.zeros_like(query)
    dk = torch.zeros(key.shape, device=key.device, dtype=acc_dtype(key.dtype))
    dv = torch.zeros(value.shape, device=value.device, dtype=acc_dtype(value.dtype))
    for (q0, q1), (k0, k1) in _segments(lengths):
        if q1 == q0 or k1 == k0:
            continue
        rows = (grad_out[q0:q1], query[q0:q1], key[k0:k1], value[k0:k1], out[q0:q1])
        g = attention_backward(
            *(x.unsqueeze(0) for x in rows), lse[:, q0:q1].unsqueeze(0), causal, kernel
        )
        dq[q0:q1] = g[0][0]
        dk[k0:k1] += g[1][0].to(dk.dtype)
        dv[k0:k1] += g[2][0].to(dv.dtype)
    return dq, dk, dv


def _resolved(kernel: Kernel, query: torch.Tensor) -> Kernel:
    """``kernel`` with its name resolved for ``query`` once, not once per sequence (a
    soft-capped one stays "math", as in ``attention_forward``)."""
    name = resolve_kernel(kernel.name, query, kernel.window is not None)
    if name == kernel.name or kernel.softcap is not None:
        return kernel
    return dataclasses.replace(kernel, name=name)


@functools.lru_cache(maxsize=None)
def varlen_available() -> bool:
    """Whether this torch has the flash varlen op on a CUDA device (checked once)."""
    return (
        torch.cuda.is_available()
        and hasattr(torch.ops.aten, "_flash_attention_forward")
        and hasattr(torch.ops.aten, "_flash_attention_backward")
        and torch.backends.cuda.is_flash_attention_available()
    )


def _segments(lengths: SeqLens) -> List[Tuple[Tuple[int, int], ...]]:
    q, k = lengths.cu_q.tolist(), lengths.cu_k.tolist()
    return [((q[i], q[i + 1]), (k[i], k[i + 1])) for i in range(len(q) - 1)]


def _use_varlen(query: torch.Tensor, cu_q: torch.Tensor) -> bool:
    """The flash varlen op serves packed sequences whatever dense kernel is chosen: CUDA,
    half precision, the op present and not found broken earlier in this process."""
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] % 8 == 0
        and cu_q.device == query.device
        and varlen_available()
        and not _VARLEN_FAILED
    )


_VARLEN_FAILED: list = []  # the error that made this process stop using the varlen op


def _guarded_varlen(fn, *args):
    """Run a varlen op; on a RuntimeError other than out-of-memory (an unsupported shape or
    build), warn once, stop using it in this process and return None (loop fallback)."""
    try:
        return fn(*args)
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError as error:
        _VARLEN_FAILED.append(str(error))
        warnings.warn(
            f"flash varlen attention failed ({error}); packed sequences fall back to one "
            "dense kernel call per document",
            stacklevel=3,
        )
        return None


def _flash_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    """The flash varlen op's (out, lse) (k, v with n_kv < n_q heads expanded first)."""
    k, v = expand_kv(k, v, q.shape[1])
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
        **flash_window(window),
    )  # fmt: skip
    keep_rng("flash", q.device, seed, offset)
    # Rows past the last sequence are never written by the kernel. They are found on the
    # device: reading cu_q[-1] on the host would synchronize every call.
    past = torch.arange(q.shape[0], device=q.device) >= cu_q[-1]
    lse = finite_lse(lse.float()).masked_fill_(past, -math.inf)
    return out.masked_fill_(past.view(-1, 1, 1), 0), lse


def _flash_varlen_backward(
    dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window=None
):
    """(dq, dk, dv) of the flash varlen op; with n_kv < n_q heads, dk and dv are float32
    sums over each group's query heads (``sum_groups``)."""
    n_kv = k.shape[1]
    k, v = expand_kv(k, v, q.shape[1])
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    seed, offset = forward_rng("flash", q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout.contiguous(),
        q,
        k,
        v,
        out.contiguous(),
        backward_lse(lse).contiguous(),
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        causal,
        seed,
        offset,
        scale=scale,
        **flash_window(window),
    )
    if k.shape[1] != n_kv:
        dk, dv = (sum_groups(x, n_kv) for x in (dk, dv))
    return dq, dk, dv
