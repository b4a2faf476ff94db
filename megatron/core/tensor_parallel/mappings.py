"""Differentiable collectives between the tensor-parallel (TP) regions of a model.

Each mapping is a pair (forward f, backward f*) where f* is the adjoint of f, so that
gradients through a TP layout equal the gradients of the dense computation
(forward / backward):

* ``copy_to_tensor_model_parallel_region``: identity / all-reduce (sum)
* ``reduce_from_tensor_model_parallel_region``: all-reduce (sum) / identity
* ``scatter_to_tensor_model_parallel_region``: keep own last-dim block / all-gather last dim
* ``gather_from_tensor_model_parallel_region``: all-gather last dim / keep own last-dim block
* ``scatter_to_sequence_parallel_region``: keep own dim-0 block / all-gather dim 0
* ``gather_from_sequence_parallel_region``: all-gather dim 0 / reduce-scatter dim 0 [*]
* ``reduce_scatter_to_sequence_parallel_region``: reduce-scatter dim 0 / all-gather dim 0
* ``all_gather_last_dim_from_tensor_parallel_region``: all-gather / reduce-scatter, last dim
* ``reduce_scatter_last_dim_to_tensor_parallel_region``: reduce-scatter / all-gather, last dim
* ``all_to_all`` (and ``all_to_all_sp2hp`` / ``all_to_all_hp2sp``): all-to-all / its reverse
* ``all_reduce_with_summed_grad``: all-reduce (sum) / all-reduce (sum), for a sum every rank
  uses differently (its own heads), unlike ``reduce_from_...`` whose consumer is replicated

[*] with ``tensor_parallel_output_grad=False``: keep own dim-0 block (the consumer of the
gathered tensor is replicated, so every rank already holds the full gradient).

Groups: ``group`` when given (it is the only group used, forward and backward); ``None`` is
the MPU fallback of ``process_groups_config.resolve_group("tp", ...)`` (``parallel_state``'s
TP group when initialized, else one rank: every mapping is then the identity). The
collectives are ``megatron.core.communication``'s (gloo fallbacks there). The caller's
tensors are never modified.
"""

from typing import List, Optional

import torch

from megatron.core.communication import (
    all_gather_along_first_dim,
    all_reduce,
    all_to_all_single,
    reduce_scatter_along_first_dim,
)
from megatron.core.process_groups_config import get_pg_rank, get_pg_size, resolve_group


def copy_to_tensor_model_parallel_region(input_, group=None):
    """Identity forward; the backward sums the gradient over the TP group."""
    return _apply(_CopyToModelParallelRegion, input_, group)


def reduce_from_tensor_model_parallel_region(input_, group=None):
    """Sum over the TP group forward; identity backward."""
    return _apply(_ReduceFromModelParallelRegion, input_, group)


def scatter_to_tensor_model_parallel_region(input_, group=None):
    """Keep this rank's 1/T block of the last dimension; backward all-gathers it."""
    return _apply(_ScatterToModelParallelRegion, input_, group)


def gather_from_tensor_model_parallel_region(input_, group=None):
    """Concatenate every rank's tensor along the last dimension (rank order); backward keeps
    this rank's block."""
    return _apply(_GatherFromModelParallelRegion, input_, group)


def scatter_to_sequence_parallel_region(input_, group=None):
    """Keep this rank's 1/T block of dim 0 (the sequence); backward all-gathers it."""
    return _apply(_ScatterToSequenceParallelRegion, input_, group)


def gather_from_sequence_parallel_region(
    input_,
    tensor_parallel_output_grad=True,
    group=None,
    output_split_sizes=None,
    use_global_buffer=False,
):
    """Concatenate every rank's [s/T, ...] tensor along dim 0 into [s, ...].

    Backward: the gradient of this rank's block summed over the group (reduce-scatter) when
    the consumer is tensor-parallel (``tensor_parallel_output_grad=True``), else this rank's
    block of its own gradient. ``output_split_sizes`` (uneven blocks) is not supported;
    ``use_global_buffer`` is accepted and ignored.
    """
    _reject_split_sizes("output_split_sizes", output_split_sizes)
    group = resolve_group("tp", group)
    if get_pg_size(group) == 1:
        return input_
    return _GatherFromSequenceParallelRegion.apply(input_, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(
    input_, group=None, input_split_sizes=None, use_global_buffer=False
):
    """Sum over the TP group and keep this rank's 1/T block of dim 0; backward all-gathers.

    ``input_split_sizes`` (uneven blocks) is not supported; ``use_global_buffer`` is ignored.
    """
    _reject_split_sizes("input_split_sizes", input_split_sizes)
    return _apply(_ReduceScatterToSequenceParallelRegion, input_, group)


def all_gather_last_dim_from_tensor_parallel_region(input_, group=None):
    """All-gather along the last dimension; backward reduce-scatters along it."""
    return _apply(_AllGatherFromTensorParallelRegion, input_, group)


def reduce_scatter_last_dim_to_tensor_parallel_region(input_, group=None):
    """Sum over the group and keep this rank's block of the last dimension; backward
    all-gathers along it."""
    return _apply(_ReduceScatterToTensorParallelRegion, input_, group)


def all_reduce_with_summed_grad(input_, group=None):
    """Sum over the TP group; backward sums the gradients over it too. For a sum each rank
    feeds into its own (different) computation, e.g. the sum of squares over all heads of a
    whole-projection q/k norm: dL/dx on rank q is the sum over ranks r of dL/dy_r."""
    return _apply(_AllReduceWithSummedGrad, input_, group)


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
    """Differentiable all-to-all along dim 0 (block r of rank q goes to rank r, arriving as
    block q); the backward is the reverse all-to-all. Uneven split sizes are supported."""
    if group is None:
        group = resolve_group("tp")
    if get_pg_size(group) == 1:
        return input_
    return _AllToAll.apply(group, input_, output_split_sizes_, input_split_sizes)


def all_to_all_sp2hp(input_, group=None):
    """[s/T * b, h] sequence-sharded -> [s * b, h/T] hidden-sharded (all-to-all over TP)."""
    group, size, rows = _tp_rows(input_, group)
    if size == 1:
        return input_
    blocks = torch.split(rows, _divide_dim(rows.shape[1], size, "hidden"), dim=1)
    return all_to_all(group, torch.cat(blocks, dim=0).contiguous())


def all_to_all_hp2sp(input_, group=None):
    """[s * b, h/T] hidden-sharded -> [s/T * b, h] sequence-sharded (all-to-all over TP);
    the inverse of ``all_to_all_sp2hp``."""
    group, size, rows = _tp_rows(input_, group)
    if size == 1:
        return input_
    _divide_dim(rows.shape[0], size, "sequence x batch")
    exchanged = all_to_all(group, rows.contiguous())
    return torch.cat(torch.chunk(exchanged, size, dim=0), dim=1)


def _tp_rows(input_: torch.Tensor, group) -> tuple:
    """(the TP group (MPU fallback for None), its size T, ``input_`` as [rows, h])."""
    group = resolve_group("tp", group)
    return group, get_pg_size(group), input_.reshape(-1, input_.shape[-1])


# ---------------------------------------------------------------------------------------------
# Collectives on tensors (no autograd). ``group`` is a real group of size > 1 here.
# ---------------------------------------------------------------------------------------------


def _reduce(input_: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` (a new tensor)."""
    return all_reduce(input_, group)


def _split_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """This rank's block of the last dimension (contiguous)."""
    size, rank = get_pg_size(group), get_pg_rank(group)
    _divide_dim(input_.shape[-1], size, "last")
    return input_.chunk(size, dim=-1)[rank].contiguous()


def _split_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """This rank's block of dim 0 (contiguous)."""
    size, rank = get_pg_size(group), get_pg_rank(group)
    _divide_dim(input_.shape[0], size, "first (sequence)")
    return input_.chunk(size, dim=0)[rank].contiguous()


def _gather_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """cat over ranks along the last dimension."""
    size = get_pg_size(group)
    stacked = all_gather_along_first_dim(input_.unsqueeze(0), group)
    return torch.cat(stacked.unbind(0), dim=-1) if size > 1 else input_


def _gather_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """cat over ranks along dim 0."""
    return all_gather_along_first_dim(input_, group)


def _reduce_scatter_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """Block ``rank`` of dim 0 of the sum over ranks."""
    _divide_dim(input_.shape[0], get_pg_size(group), "first (sequence)")
    return reduce_scatter_along_first_dim(input_, group)


def _reduce_scatter_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """Block ``rank`` of the last dimension of the sum over ranks."""
    _divide_dim(input_.shape[-1], get_pg_size(group), "last")
    moved = input_.movedim(-1, 0)
    return reduce_scatter_along_first_dim(moved, group).movedim(0, -1).contiguous()


# ---------------------------------------------------------------------------------------------
# Autograd functions (forward f, backward its adjoint).
# ---------------------------------------------------------------------------------------------


def adjoint_pair(name: str, doc: str, forward, backward) -> type:
    """An autograd Function ``y = forward(x, group)`` whose backward is
    ``dL/dx = backward(dL/dy, group)`` (the adjoint of ``forward``); ``group`` gets no
    gradient. The class is named ``name`` in ``forward``'s module."""

    class _Mapping(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input_, group):
            ctx.group = group
            return forward(input_, group)

        @staticmethod
        def backward(ctx, grad_output):
            return backward(grad_output, ctx.group), None

    _Mapping.__name__ = _Mapping.__qualname__ = name
    _Mapping.__module__ = forward.__module__
    _Mapping.__doc__ = doc
    return _Mapping


def _identity(input_: torch.Tensor, group) -> torch.Tensor:
    """y = x (a view, so autograd sees a new tensor)."""
    return input_.view_as(input_)


_CopyToModelParallelRegion = adjoint_pair(
    "_CopyToModelParallelRegion",
    "y = x; dL/dx = sum over ranks of dL/dy.",
    _identity,
    _reduce,
)
_ReduceFromModelParallelRegion = adjoint_pair(
    "_ReduceFromModelParallelRegion",
    "y = sum over ranks of x; dL/dx = dL/dy.",
    _reduce,
    lambda grad_output, group: grad_output,
)
_AllReduceWithSummedGrad = adjoint_pair(
    "_AllReduceWithSummedGrad",
    "y = sum over ranks of x (each rank using y its own way); dL/dx = sum over ranks of dL/dy.",
    _reduce,
    _reduce,
)
_ScatterToModelParallelRegion = adjoint_pair(
    "_ScatterToModelParallelRegion",
    "y = own last-dim block of x; dL/dx = all-gather of dL/dy along the last dim.",
    _split_along_last_dim,
    _gather_along_last_dim,
)
_GatherFromModelParallelRegion = adjoint_pair(
    "_GatherFromModelParallelRegion",
    "y = cat over ranks along the last dim; dL/dx = own block of dL/dy.",
    _gather_along_last_dim,
    _split_along_last_dim,
)
_ScatterToSequenceParallelRegion = adjoint_pair(
    "_ScatterToSequenceParallelRegion",
    "y = own dim-0 block of x; dL/dx = all-gather of dL/dy along dim 0.",
    _split_along_first_dim,
    _gather_along_first_dim,
)
_ReduceScatterToSequenceParallelRegion = adjoint_pair(
    "_ReduceScatterToSequenceParallelRegion",
    "y = own dim-0 block of the sum over ranks; dL/dx = all-gather of dL/dy along dim 0.",
    _reduce_scatter_along_first_dim,
    _gather_along_first_dim,
)
_AllGatherFromTensorParallelRegion = adjoint_pair(
    "_AllGatherFromTensorParallelRegion",
    "y = cat over ranks along the last dim; dL/dx = own block of the sum of dL/dy.",
    _gather_along_last_dim,
    _reduce_scatter_along_last_dim,
)
_ReduceScatterToTensorParallelRegion = adjoint_pair(
    "_ReduceScatterToTensorParallelRegion",
    "y = own last-dim block of the sum over ranks; dL/dx = all-gather along the last dim.",
    _reduce_scatter_along_last_dim,
    _gather_along_last_dim,
)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """y = cat over ranks along dim 0; dL/dx = own block of (sum over ranks of) dL/dy."""

    @staticmethod
    def forward(ctx, input_, group, tensor_parallel_output_grad=True):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad_output, ctx.group), None, None
        return _split_along_first_dim(grad_output, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0; its adjoint is the all-to-all with the split sizes swapped."""

    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        return all_to_all_single(input_, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        grad = all_to_all_single(
            grad_output, ctx.group, ctx.input_split_sizes, ctx.output_split_sizes
        )
        return None, grad, None, None


# ---------------------------------------------------------------------------------------------


def _apply(function, input_, group):
    """Resolve ``group`` (``resolve_group``) and apply ``function`` unless T = 1."""
    group = resolve_group("tp", group)
    if get_pg_size(group) == 1:
        return input_
    return function.apply(input_, group)


def _divide_dim(size: int, parts: int, which: str) -> int:
    """size / parts, or a ValueError naming the dimension."""
    if size % parts != 0:
        raise ValueError(
            f"tensor-parallel mapping: the {which} dimension has size {size}, which is not "
            f"divisible by the tensor-parallel size {parts}"
        )
    return size // parts


def _reject_split_sizes(name: str, sizes: Optional[List[int]]) -> None:
    """Uneven split sizes are a MoE feature this core does not implement."""
    if sizes is not None and len(set(sizes)) > 1:
        raise NotImplementedError(
            f"{name}={sizes!r}: uneven splits along the sequence dimension are not supported "
            "(expected None or equal sizes)"
        )
