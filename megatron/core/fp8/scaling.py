"""Tensorwise FP8 current scaling from the GLOBAL amax, the casts and the scaled GEMM.

A tensor t is cast as q = cast_fp8(clamp(t * s, -m, m)) with m the format's largest finite
value and s = m / amax / 2**margin (s = 1 when amax is 0 or s is not finite); q / s is its
FP8 value. ``amax`` is max |t| over the WHOLE tensor: each rank's local max, then a MAX
all-reduce over every group the tensor is sharded across (``reduce_amax``). So every rank
holds bitwise the scale, and the FP8 elements, that one process computing the whole tensor
would hold, whatever the layout (Transformer Engine's current scaling reduces the weight amax
over no group: its FP8 weights depend on the TP size).

``scaled_mm`` is ``torch._scaled_mm`` on CUDA (the FP8 tensor-core GEMM on Hopper):
(a / s_a) @ (b / s_b) with fp32 accumulation. It needs a row-major ``a``, a column-major ``b``
and inner and output sizes that are multiples of 16: other sizes are padded with zeros, which
change no sum. On the CPU, torch 2.13's ``_scaled_mm`` is correct but a reference loop
(31 ms for 64 x 32 x 96, 24 s for 512 x 256 x 1024), so the same product is an fp32 matmul of
the dequantized FP8 values (exact in fp32): 0.2 and 9 ms.

The amax is one reduction kernel (the infinity norm; ``abs().amax()`` would write |t|
first, and a compiled full reduction with dynamic sizes runs as one thread block: 22 ms for
an 8k x 2k tensor on an H200). On CUDA the cast and the FP8 transposes are
``torch.compile``d (``jit_fuser``; inside a graph being compiled they are traced into it):
eagerly, a cast of a bf16 tensor is four kernels through fp32 copies (float, multiply,
clamp, cast), which cost more than the FP8 GEMM saves; compiled, one pass that reads the
tensor once; ``operands`` makes the scales, casts and transposes of one autograd step one
graph (for an output gradient, the row-major FP8 copy and the transposed one the
weight-gradient GEMM needs). The compiled kernels compute the same
float32 products and round-to-nearest-even casts, so their results are bitwise the eager
ones (checked on a GPU by ``tests/benchmarks/fp8_gpu_check.py``). The CPU runs them
eagerly: compiling costs seconds per shape.
"""

from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.distributed import ReduceOp

from megatron.core.communication import all_reduce
from megatron.core.jit import jit_fuser
from megatron.core.process_groups_config import get_pg_size

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_CUDA_MULTIPLE = 16


def fp8_dtypes(fmt: str) -> Tuple[torch.dtype, torch.dtype]:
    """(forward dtype, gradient dtype): "e4m3": both e4m3; "hybrid": e4m3 and e5m2."""
    if fmt == "e4m3":
        return E4M3, E4M3
    if fmt == "hybrid":
        return E4M3, E5M2
    raise ValueError(f"fp8={fmt!r}; expected 'e4m3' or 'hybrid'")


def local_amax(tensor: torch.Tensor) -> torch.Tensor:
    """max |tensor| as a float32 scalar (0 for an empty tensor)."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=tensor.device)
    return torch.linalg.vector_norm(tensor.detach(), ord=float("inf")).float()


def reduce_amax(amaxes: torch.Tensor, groups: Iterable[Optional[object]]) -> torch.Tensor:
    """The MAX of ``amaxes`` (a float32 vector, one entry per tensor: one collective for all)
    over each group in turn: over their union, the ranks the tensors are sharded across."""
    for group in groups:
        if get_pg_size(group) > 1:
            amaxes = all_reduce(amaxes, group, ReduceOp.MAX)
    return amaxes


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    """s = fp8_max / amax / 2**margin in float32; 1 where amax is 0 or s is not finite. The
    quotient is taken in float64 and rounded once: the correctly rounded float32 quotient,
    the same from an eager kernel and a compiled one (Triton's float32 division is not
    correctly rounded)."""
    scale = (torch.finfo(dtype).max / amax.double()).float() / float(2**margin)
    return torch.where((amax > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))


def operands(
    tensors: Sequence[torch.Tensor],
    amax: torch.Tensor,
    dtype: torch.dtype,
    margin: int,
    transposed_too: Sequence[int] = (),
    fp8_to_transpose: Sequence[torch.Tensor] = (),
    experts: bool = False,
) -> Tuple[List[torch.Tensor], List[torch.Tensor], torch.Tensor]:
    """The FP8 GEMM operands of one autograd step, in one call (one compiled graph on CUDA,
    so that a linear pays the Python cost of one call, not of ten small kernels): the scales
    ``scale_from_amax(amax)`` (``amax`` the global amaxes, one per tensor), ``tensors`` cast
    with them, the transposed FP8 copies of ``tensors[i]`` for i in ``transposed_too`` and of
    the FP8 tensors ``fp8_to_transpose``. Returns (casts, transposes, scales). ``experts``:
    compiled as a second function (dynamo keeps one cache per function: the experts' weight
    lists, one tensor per expert, then do not take the dense linears' entries; the experts'
    activations, whose token counts change, are cast by ``cast_rows``)."""
    if tensors and _compiled_here(tensors[0]):
        # Plain tensors without grad mode: dynamo guards on parameters' static shapes, on
        # requires_grad, on a view's base and on the grad mode (the backward's calls), each
        # a recompilation (eager FP8 runs hit the recompile limit of 8, then ran uncompiled).
        fused = _fused_expert_operands if experts else _fused_operands
        with torch.no_grad():
            plain = [t.detach() for t in tensors]
            fp8 = [q.detach() for q in fp8_to_transpose]
            return fused(plain, amax.detach(), dtype, margin, tuple(transposed_too), fp8)
    return _operands(tensors, amax, dtype, margin, tuple(transposed_too), fp8_to_transpose)


def cast_rows(
    tensor: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``tensor`` [T, k] cast to ``dtype`` row by row, row r with ``scales[rows[r]]``: the
    float32 products of casting each group of rows with its own scale, so bitwise those
    casts (the experts' activations, one scale per expert). Compiled on CUDA as
    ``operands``; its one tensor's row count is the only size that changes."""
    if tensor.numel() and _compiled_here(tensor):
        with torch.no_grad():
            return _fused_cast_rows(tensor.detach(), scales.detach(), rows, dtype)
    return _cast_rows(tensor.detach(), scales, rows, dtype)


def _cast_rows(tensor, scales, rows, dtype):
    return _cast(tensor, scales[rows].unsqueeze(1), dtype)


def _operands(tensors, amax, dtype, margin, transposed_too, fp8_to_transpose):
    scales = scale_from_amax(amax, dtype, margin)
    casts = [_cast(t.detach(), scales[i], dtype) for i, t in enumerate(tensors)]
    transposes = [casts[i].t().contiguous() for i in transposed_too]
    transposes += [q.t().contiguous() for q in fp8_to_transpose]
    return casts, transposes, scales


def _expert_operands(*args):
    return _operands(*args)


# Dynamic from the first call: every FP8 linear calls these at its own shapes, and the
# structural variants (the format, which operands are transposed) already take several of
# dynamo's 8 graphs per function (a dense float32 model: 7 with shape-specialized first
# graphs, 3 dynamic).
_fused_operands = jit_fuser(_operands, dynamic=True)
_fused_expert_operands = jit_fuser(_expert_operands, dynamic=True)
_fused_cast_rows = jit_fuser(_cast_rows, dynamic=True)


def _compiled_here(tensor: torch.Tensor) -> bool:
    """Run the ``jit_fuser`` version: on CUDA, outside a graph being compiled."""
    return tensor.is_cuda and not torch.compiler.is_compiling()


def _cast(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    bound = torch.finfo(dtype).max
    return (tensor.float() * scale).clamp(-bound, bound).to(dtype)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    pad: Optional[bool] = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """(a / a_scale) @ (b / b_scale) for FP8 ``a`` [m, k] and ``b`` [k, n], fp32 accumulation,
    returned in ``out_dtype`` (``pad``: to CUDA's multiples of 16; default: on CUDA).
    ``a`` row-major and ``b`` column-major are used as they are, other layouts are copied.
    ``fast_accum``: Hopper's fast FP8 accumulation (partial sums promoted to fp32 less often;
    Transformer Engine's and torchao's choice for the forward GEMM), CUDA only."""
    n = b.shape[1]
    if a.is_cuda if pad is None else pad:
        a = _pad(a, 1)
        b = _pad(_pad(b, 0), 1)
    if a.is_cuda:
        out = torch._scaled_mm(
            a.contiguous(),
            b.t().contiguous().t(),
            scale_a=a_scale.reciprocal(),
            scale_b=b_scale.reciprocal(),
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
    else:  # torch's CPU _scaled_mm is a reference loop: 24 s for 512 x 256 x 1024
        out = (a.float() @ b.float()).mul_(a_scale.reciprocal() * b_scale.reciprocal())
        out = out.to(out_dtype)
    return out[:, :n].contiguous() if out.shape[1] != n else out


def _pad(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with zeros appended along ``dim`` up to a multiple of 16."""
    extra = -t.shape[dim] % _CUDA_MULTIPLE
    if not extra:
        return t
    pad = [0, extra] if dim == 1 else [0, 0, 0, extra]
    return F.pad(t.view(torch.uint8), pad).view(t.dtype)
