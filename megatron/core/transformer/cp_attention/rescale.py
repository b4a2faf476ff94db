"""bf16 attention on the fp16 kernels, through exact power-of-two factors (``Rescale``).

Used by the strategies whose results are sums of several kernel calls (all_gather, p2p).
"""

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core.transformer.cp_attention.collectives import max_over_group

HALF_PARTIALS = True  # bf16 through the fp16 kernels (``Rescale``); False: bf16 kernels

# A factor applied as partials are accumulated: None (1), a float, or a 0-d float32 tensor.
Factor = Union[None, float, torch.Tensor]


@dataclass(frozen=True)
class GradFactors:
    """The factors that undo the rescaling of the kernels' (dQ', dK', dV')."""

    dq: Factor = None
    dk: Factor = None
    dv: Factor = None


class Rescale:
    """bf16 attention on the fp16 kernels, through exact power-of-two factors.

    Why: in the all-gather and ring modes every output row, query gradient and key/value
    gradient is a sum of several kernel calls' results, and a bf16 kernel rounds each
    result to bf16 (8 significant bits) before the float32 sum: m partials carry m
    roundings where the one-device kernel has one (measured 1.24x its error on dK/dV at
    C = 2). No PyTorch kernel returns float32 gradients, but the same kernels run in fp16
    (11 significant bits, the same speed), and a bf16 value converts to fp16 exactly once it
    is in fp16's range. Powers of two are exact factors, so (from max |x|; a and b over the
    whole CP group, g per rank):

    - Q' = Q a, K' = K / a with a balancing their magnitudes (Q'K'^T = QK^T: the softmax,
      its scale and the LSE are unchanged);
    - V' = V b with |V'| < 1, hence |O'| < 1;
    - dO' = dO g, g the largest power of two with every kernel output below 2^15 by the
      bounds |dV'| <= n max|dO'|, |dK'| <= 2 scale d n max|Q'| max|dO'|,
      |dQ'| <= 2 scale d max|K'| max|dO'| and |dS'| <= 2 d max|dO'| (n query rows per call
      times the query heads per key head; d the head dimension);

    and O = O' / b, dQ = dQ' a / (g b), dK = dK' / (g b a), dV = dV' / g, applied as the
    partials are added into float32 (before gradients leave the rank), the sums rounded to
    bf16 once. The exponents are Python numbers when the device is idle and 0-d tensors
    otherwise (``device_idle``): the same values either way. Values below 2^-24 of the
    fp16 scale are flushed (far below bf16's own rounding of the results). Limitation:
    max|Q| max|K| must stay below about 2^30, or Q' and K' overflow fp16. Other dtypes run
    as they are.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled

    @classmethod
    def for_inputs(cls, query, key, value, group) -> "Rescale":
        """a and b from max |Q|, |K|, |V| over the group."""
        rescale = cls(query.dtype == torch.bfloat16 and HALF_PARTIALS)
        if not rescale.enabled:
            return rescale
        idle = device_idle(query)  # asked before this queues its own work
        norms = [_amax(x) for x in (query, key, value)]
        amax = torch.stack(norms)
        max_over_group(amax, group)
        if idle:
            e_q, e_k, e_v = (math.frexp(x)[1] for x in amax.tolist())  # max|x| < 2^e
            shift = (e_k - e_q) // 2
        else:
            e = torch.frexp(amax)[1]
            e_q, e_k, e_v = e[0], e[1], e[2]
            shift = torch.div(e_k - e_q, 2, rounding_mode="floor")
        # log2 of a, 1/a, b, 1/b, a/b, 1/(ab); then the exponents of max|Q'| and max|K'|
        exps = [shift, -shift, -e_v, e_v, e_v + shift, e_v - shift, e_q + shift, e_k - shift]
        if isinstance(shift, int):
            rescale.exps = [min(100, max(-100, x)) for x in exps]
            rescale.f = [2.0**x for x in rescale.exps[:6]]
        else:
            rescale.exps = torch.stack(exps).clamp(-100, 100)
            rescale.f = torch.exp2(rescale.exps[:6].float())
        return rescale

    def query(self, query: torch.Tensor) -> torch.Tensor:
        return _half(query, self.f[0]) if self.enabled else query

    def key_values(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """K' and V' side by side along the heads, [s, b, 2 n_kv, d]: the buffer the
        gather and the ring send, written in one pass per tensor."""
        if not self.enabled:
            return torch.cat([key, value], dim=2)
        s, b, n, d = key.shape
        kv = torch.empty((s, b, 2 * n, d), dtype=torch.float16, device=key.device)
        torch.mul(key, self.f[1], out=kv[:, :, :n])
        torch.mul(value, self.f[2], out=kv[:, :, n:])
        return kv

    def output(self, acc: torch.Tensor, dtype, valid) -> torch.Tensor:
        out = _scaled(acc, self.f[3], dtype) if self.enabled else acc.to(dtype)
        return out if valid is None else out * valid

    def grad_inputs(self, grad_out, out, rows: int, scale: float, head_dim: int):
        """(dO', O') for the kernels and the ``GradFactors`` that undo the scaling of (dQ',
        dK', dV') (all None when disabled). g is this rank's own: gradients are unscaled as
        they are accumulated, before they leave the rank."""
        if not self.enabled:
            return grad_out, out, GradFactors()
        idle = device_idle(grad_out)
        amax = _amax(grad_out)
        unit = 2.0 * scale * head_dim  # exponents of the bounds, powers of two rounded up
        c_q, c_k = math.ceil(math.log2(unit * rows)), math.ceil(math.log2(unit))
        floor = math.ceil(math.log2(max(rows, 2 * head_dim)))
        if idle:
            e_do, e_q, e_k = math.frexp(amax.item())[1], self.exps[6], self.exps[7]
            bound = max(e_q + c_q, e_k + c_k, floor)
            if not isinstance(bound, int):
                bound = int(bound)  # exponents from a forward that kept them on the device
            g = 2.0 ** min(100, max(-100, 15 - e_do - bound))
            f = [float(x) for x in self.f]
        else:
            e_do = torch.frexp(amax)[1]
            if isinstance(self.exps, list):  # the forward's exponents are on the host
                bound = max(self.exps[6] + c_q, self.exps[7] + c_k, floor)
            else:
                bound = torch.maximum(self.exps[6] + c_q, self.exps[7] + c_k).clamp(min=floor)
            g = torch.exp2((15 - e_do - bound).clamp(-100, 100).float())
            f = self.f
        inv_g = 1 / g
        factors = GradFactors(inv_g * f[4], inv_g * f[5], inv_g)
        return _half(grad_out, g), _half(out, f[2]), factors


def kernel_grad_inputs(
    grad_out, out, q, k, valid: Optional[torch.Tensor], scale: float, rescale: Rescale
):
    """dO (padding rows zeroed by ``valid``) and O as the kernels take them, and the
    ``GradFactors`` that undo the rescaling of the kernels' gradients."""
    if valid is not None:
        grad_out = grad_out * valid
    rows = q.shape[0] * (q.shape[2] // k.shape[2])  # query rows per key row in one call
    return rescale.grad_inputs(grad_out, out, rows, scale, q.shape[-1])


def device_idle(x: torch.Tensor) -> bool:
    """True when reading a value back from x's device costs nothing: a CPU tensor, or a GPU
    whose current stream has finished all its work (the CPU, not the GPU, is the
    bottleneck). Asked before the rescaling queues its own reductions, whose wait is then
    the only cost of reading them back. The factors are then computed on the host (a few
    Python operations) rather than as ~30 tiny device operations; both ways give the same
    powers of two."""
    return x.device.type != "cuda" or torch.cuda.current_stream(x.device).query()


def _amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 0-d tensor (one reduction)."""
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)


def _half(x: torch.Tensor, factor) -> torch.Tensor:
    """x * factor (a power of two: exact) in fp16."""
    return _scaled(x, factor, torch.float16)


def _scaled(x: torch.Tensor, factor, dtype: torch.dtype) -> torch.Tensor:
    """x * factor (a float or a 0-d float32 tensor) written as ``dtype``: one pass, one
    rounding."""
    return torch.mul(x, factor, out=torch.empty(x.shape, dtype=dtype, device=x.device))
