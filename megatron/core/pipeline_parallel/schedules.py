"""Forward-backward schedules: no pipelining, 1F1B, and interleaved 1F1B (virtual pipeline).

The loss contract (README, "The loss contract"). ``forward_step_func(data_iterator, model)``
returns ``(output_tensor, loss_func)``; on the last pipeline stage ``loss_func(output_tensor)``
returns either ``(loss_sum, num_tokens, reported)`` -- this CP shard's masked loss sum S_c and
valid-token count N_c -- or the legacy ``(loss, reported)``. With D data-parallel replicas,
C context-parallel ranks and M microbatches, the gradient after ``finalize_model_grads`` is
that of

    averaged (default):           J = 1/(D*M) * sum_{d,m} S_{d,m} / max(N_{d,m}, 1)
    calculate_per_token_loss:     J = sum_{d,m} S_{d,m} / max(sum_{d,m} N_{d,m}, 1)
    legacy two values:            J = 1/(D*M) * sum_{d,m} loss_{d,m}

where S and N are over whole sequences. Gradients are averaged over the D*C ranks of the
dp_cp group (summed in per-token mode), so each shard's loss is scaled as
``normalize_microbatch_loss`` describes; the CP count all-reduce lives in
``reduce_loss_across_cp``.

One concern in ~1,000 lines: megatron-core's module path holds the three schedules, their
public helpers (``forward_step``, ``backward_step``, the schedule tables, ...) and the loss
contract above, and tests and users patch its names in place (``reduce_loss_across_cp``), so
they stay in this one module. The three schedules are three loops: ``_schedule`` gives each
megatron-core's signature and the shared steps, and they run on one runner (``_Run``).
"""

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.autograd.variable import Variable

from megatron.core import parallel_state
from megatron.core.communication import all_reduce_
from megatron.core.device import comm_device
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.token_counts import DeferredCountChecks
from megatron.core.pipeline_parallel.token_counts import check_num_tokens as _check_num_tokens
from megatron.core.process_groups_config import (
    ProcessGroupCollection,
    get_pg_size,
    resolve_group,
    resolve_pg_collection,
)
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
from megatron.core.utils import get_attr_wrapped_model, get_model_config

Model = Union[torch.nn.Module, List[torch.nn.Module]]
DataIterator = Union[Iterator, List[Iterator], None]


def get_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None):
    """The schedule for a layout: interleaved with VPP, 1F1B with PP > 1, else no pipelining.

    Sizes default to ``parallel_state``'s (MPU fallback; PP = 1 when not initialized).
    """
    if pp_size is None:
        initialized = parallel_state.model_parallel_is_initialized()
        pp_size = parallel_state.get_pipeline_model_parallel_world_size() if initialized else 1
    if vp_size is None:
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if pp_size > 1:
        if vp_size is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


def _schedule(pipelined: bool, interleaved: bool = False):
    """Give a schedule's loop megatron-core's keyword-only signature (the same for the three
    schedules: tests/unit_tests/test_api_compat.py) and the steps they share: ``_Run`` checks
    the arguments and holds the step, the loop runs the microbatches, ``_Run.finish`` syncs
    and finalizes the gradients. The loop's docstring is the schedule's."""

    def wrap(loop: Callable[["_Run"], None]) -> Callable[..., List[Any]]:
        def schedule(
            *,
            forward_step_func,
            data_iterator: DataIterator,
            model: Model,
            num_microbatches: int,
            seq_length: int,
            micro_batch_size: int,
            decoder_seq_length: Optional[int] = None,
            forward_only: bool = False,
            collect_non_loss_data: bool = False,
            first_val_step: Optional[bool] = None,
            adjust_tensor_shapes_fn: Optional[Callable] = None,
            p2p_communicator: Optional[P2PCommunicator] = None,
            pg_collection: Optional[ProcessGroupCollection] = None,
            force_all_reduce: Optional[bool] = False,
        ) -> List[Any]:
            if adjust_tensor_shapes_fn is not None and interleaved:
                raise ScheduleArgumentError(
                    "adjust_tensor_shapes_fn is not supported by the interleaved schedule; got "
                    f"{adjust_tensor_shapes_fn!r}, expected None"
                )
            run = _Run(
                forward_step_func,
                data_iterator,
                model,
                num_microbatches,
                pg_collection,
                forward_only,
                collect_non_loss_data,
                pipelined=pipelined,
                interleaved=interleaved,
                p2p_communicator=p2p_communicator,
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
                first_val_step=first_val_step,
            )
            if not interleaved and len(run.models) != 1:
                raise ScheduleArgumentError(
                    f"{loop.__name__}: model must be one module (or a list of one), got a list "
                    f"of {len(run.models)}"
                    + ("; use the interleaved schedule for model chunks" if pipelined else "")
                )
            loop(run)
            return run.finish(force_all_reduce)

        schedule.__name__ = schedule.__qualname__ = loop.__name__
        schedule.__doc__, schedule.__module__ = loop.__doc__, loop.__module__
        return schedule

    return wrap


@_schedule(pipelined=False)
def forward_backward_no_pipelining(run: "_Run") -> None:
    """Run M microbatches forward and backward on one stage, syncing gradients on the last.

    Returns the list of ``reported`` dicts of the loss function, one per microbatch.
    """
    M = run.num_microbatches
    run.grad_sync.disable()
    for microbatch in range(M):
        if microbatch == M - 1:
            run.grad_sync.enable()
        output = run.forward(0, microbatch, None, is_last_stage=True)
        if not run.forward_only:
            run.backward(None, output, None)


@_schedule(pipelined=True)
def forward_backward_pipelining_without_interleaving(run: "_Run") -> None:
    """1F1B: ``_warmup_microbatches`` forwards, then one forward and one backward per
    step, then the remaining backwards; gradients sync during the last backward."""
    p2p, first, last = run.p2p, run.pp_rank == 0, run.pp_rank == run.pp_size - 1
    recv_shapes = send_shapes = run.tensor_shape()
    if run.adjust_tensor_shapes_fn is not None:
        recv_shapes, send_shapes = run.adjust_tensor_shapes_fn([recv_shapes], [send_shapes])
    M, forward_only = run.num_microbatches, run.forward_only
    warmup = min(_warmup_microbatches(M, run.pp_size, run.pp_rank, forward_only=forward_only), M)
    pending = []  # (input, output) of microbatches awaiting their backward

    run.grad_sync.disable()
    for microbatch in range(warmup):
        input_tensor = p2p.recv_forward(recv_shapes, first)
        output = run.forward(0, microbatch, input_tensor, is_last_stage=last)
        p2p.send_forward(output, last)
        run.keep(pending, input_tensor, output)
        run.release(None if last else output)

    input_tensor = p2p.recv_forward(recv_shapes, first) if warmup < M else None
    for microbatch in range(warmup, M):
        final = microbatch == M - 1
        output = run.forward(0, microbatch, input_tensor, is_last_stage=last)
        if forward_only:
            p2p.send_forward(output, last)
            input_tensor = None if final else p2p.recv_forward(recv_shapes, first)
            continue
        output_grad = p2p.send_forward_recv_backward(output, send_shapes, last)
        run.keep(pending, input_tensor, output)
        run.release(None if last else output)
        if warmup == 0 and final:
            run.grad_sync.enable()
        input_grad = run.backward(*pending.pop(0), output_grad)
        if final:
            p2p.send_backward(input_grad, first)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_grad, recv_shapes, first)

    if not forward_only:
        for i in range(warmup):
            if i == warmup - 1:
                run.grad_sync.enable()
            input_tensor, output = pending.pop(0)
            output_grad = p2p.recv_backward(send_shapes, last)
            p2p.send_backward(run.backward(input_tensor, output, output_grad), first)


@_schedule(pipelined=True, interleaved=True)
def forward_backward_pipelining_with_interleaving(run: "_Run") -> None:
    """Interleaved 1F1B over V model chunks per rank (chunk v on rank p is stage v*PP + p).

    The k-th forward runs chunk ``(k mod g*V) div g`` on microbatch ``(k div g*V)*g + k mod g``
    (g = ``microbatch_group_size_per_vp_stage``); backwards use the same table with the
    chunk mirrored. Warm-up: ``_warmup_microbatches`` forwards, at most M*V.
    """
    V, PP, p = len(run.models), run.pp_size, run.pp_rank
    forward_only = run.forward_only
    table = interleaved_schedule_table(
        run.num_microbatches, V, run.config.microbatch_group_size_per_vp_stage, PP
    )
    total = len(table)
    fwd_chunk = [chunk for _, chunk in table]
    bwd_chunk = [V - 1 - chunk for _, chunk in table]
    last_backward_of = {chunk: k for k, chunk in enumerate(bwd_chunk)}
    shape = run.tensor_shape()
    p2p = run.p2p

    def first_stage(chunk: int) -> bool:
        return p == 0 and chunk == 0

    def last_stage(chunk: int) -> bool:
        return p == PP - 1 and chunk == V - 1

    def forward(k: int, input_tensor):
        microbatch, chunk = table[k]
        output = run.forward(chunk, microbatch, input_tensor, last_stage(chunk), vp_stage=chunk)
        run.keep(inflight[chunk], input_tensor, output)
        return None if last_stage(chunk) else output

    def backward(k: int, output_grad):
        chunk = bwd_chunk[k]
        if k == last_backward_of[chunk]:
            run.grad_sync.enable()
        input_grad = run.backward(*inflight[chunk].pop(0), output_grad)
        run.grad_sync.disable()
        return None if first_stage(chunk) else input_grad

    def recv_prev_for(k: int) -> bool:
        return k < total and not first_stage(fwd_chunk[k])

    def recv_next_for(k: int) -> bool:
        return k < total and not last_stage(bwd_chunk[k])

    inflight = [[] for _ in range(V)]  # per chunk: (input, output) awaiting the backward
    warmup = _warmup_microbatches(
        total, PP, p, forward_only=forward_only, num_chunks=V, group_size=table.group_size
    )
    warmup = min(warmup, total)
    run.grad_sync.disable()

    input_tensor = p2p.recv_forward(shape, not recv_prev_for(0))
    output_grad = None
    for k in range(warmup):
        output = forward(k, input_tensor)
        if k == warmup - 1 and warmup < total:
            input_tensor, output_grad = p2p.send_forward_backward_recv_forward_backward(
                output, None, recv_prev_for(k + 1), recv_next_for(0), shape
            )
        else:
            input_tensor = p2p.send_forward_recv_forward(output, recv_prev_for(k + 1), shape)
        run.release(output)
    if not forward_only and warmup == total:
        output_grad = p2p.recv_backward(shape, not recv_next_for(0))

    for b in range(total - warmup):
        k = warmup + b
        output = forward(k, input_tensor)
        input_grad = backward(b, output_grad)
        input_tensor, output_grad = p2p.send_forward_backward_recv_forward_backward(
            output, input_grad, recv_prev_for(k + 1), recv_next_for(b + 1), shape
        )
        run.release(output)

    if not forward_only:
        for b in range(total - warmup, total):
            input_grad = backward(b, output_grad)
            output_grad = p2p.send_backward_recv_backward(input_grad, recv_next_for(b + 1), shape)
        run.grad_sync.enable()


class ScheduleArgumentError(ValueError, AssertionError):
    """A misuse megatron-core reports with ``assert`` (model chunking, missing groups, the
    loss callback's arity, ...): a ValueError carrying a clear message that code written for
    megatron-core still catches as an AssertionError."""


class ScheduleTypeError(TypeError, AssertionError):
    """A wrong type megatron-core reports with ``assert``; see ``ScheduleArgumentError``."""


class MicrobatchRemainderError(ValueError, RuntimeError):
    """A last microbatch group the interleaved schedule cannot run (megatron-core raises
    ``RuntimeError`` here; earlier versions of this core a ``ValueError``: it is both)."""


class ScheduleTable(list):
    """The ordered ``(microbatch, chunk)`` forwards of an interleaved step."""

    group_size: int = 1


def interleaved_schedule_table(
    num_microbatches: int, num_chunks: int, group_size: int, pp_size: int
) -> ScheduleTable:
    """Forward order of the interleaved schedule: groups of g microbatches, each run
    through chunks 0..V-1; the last group takes the remaining microbatches.

    Raises ValueError for microbatch counts the schedule cannot run (megatron's limits):
    g must lie in [PP, M], and the remainder M mod g must be 0 or at least PP.
    """
    M, g = num_microbatches, group_size
    if not (pp_size <= g <= M):
        raise ValueError(
            f"interleaved schedule: microbatch_group_size_per_vp_stage={g} must lie in "
            f"[pipeline_model_parallel_size={pp_size}, num_microbatches={M}]; use at least "
            f"{pp_size} microbatches"
        )
    if 0 < M % g < pp_size:
        raise MicrobatchRemainderError(
            f"interleaved schedule: num_microbatches={M} leaves a last group of {M % g} "
            f"microbatches (microbatch_group_size_per_vp_stage={g}); it must be 0 or at least "
            f"pipeline_model_parallel_size={pp_size}: choose a multiple of {g}"
        )
    table = ScheduleTable(get_schedule_table(M, num_chunks, g))
    table.group_size = g
    return table


def get_schedule_table(num_microbatches, num_model_chunks, microbatch_group_size_per_vp_stage):
    """The interleaved forward order as ``(microbatch, chunk)`` pairs: groups of
    ``g = microbatch_group_size_per_vp_stage`` microbatches, each run through chunks
    0..V-1; the last group takes the remaining microbatches (no checks; see
    ``interleaved_schedule_table`` for the limits the schedule enforces)."""
    M, g = num_microbatches, microbatch_group_size_per_vp_stage
    table = []
    for start in range(0, M, g):
        stop = M if start + g >= M else start + g
        table.extend((m, chunk) for chunk in range(num_model_chunks) for m in range(start, stop))
    return table


def get_pp_rank_microbatches(
    num_microbatches,
    num_model_chunks,
    microbatch_group_size_per_vp_stage,
    forward_only=False,
    overlap_moe_expert_parallel_comm=False,
    p2p_communicator: Optional[P2PCommunicator] = None,
):
    """``(total, all_in_warmup, warmup, remaining)`` microbatch counts of this pipeline rank.

    total = M * V. Warmup: all of them when ``forward_only``; PP - r - 1 for 1F1B;
    2 * (PP - r - 1) + (V - 1) * g (+1 with ``overlap_moe_expert_parallel_comm``) for the
    interleaved schedule; 0 without pipelining; capped at total (then ``all_in_warmup``).
    Sizes come from ``p2p_communicator`` (its pp group and virtual pipeline size), else
    from ``parallel_state`` (MPU fallback).
    """
    if p2p_communicator is not None:
        pp_size = p2p_communicator.pp_group.size()
        pp_rank = p2p_communicator.pp_group.rank()
        vp_size = p2p_communicator.virtual_pipeline_model_parallel_size
    else:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    total = num_microbatches * num_model_chunks
    interleaved = vp_size is not None and pp_size > 1
    warmup = _warmup_microbatches(
        total,
        pp_size,
        pp_rank,
        forward_only=forward_only,
        num_chunks=num_model_chunks if interleaved else None,
        group_size=microbatch_group_size_per_vp_stage,
        extra=1 if interleaved and overlap_moe_expert_parallel_comm else 0,
    )
    all_in_warmup = warmup >= total
    warmup = min(warmup, total)
    return total, all_in_warmup, warmup, total - warmup


def _warmup_microbatches(
    total: int,
    pp_size: int,
    pp_rank: int,
    *,
    forward_only: bool = False,
    num_chunks: Optional[int] = None,
    group_size: int = 1,
    extra: int = 0,
) -> int:
    """Forwards pipeline rank r of PP runs before its first backward (not capped at total).

    All ``total`` when ``forward_only``; 1F1B (``num_chunks`` None): PP - r - 1; interleaved
    over V = ``num_chunks`` chunks in groups of g = ``group_size``: 2 (PP - r - 1) + (V - 1) g
    (+ ``extra``). The one place the schedules and ``get_pp_rank_microbatches`` take it from.
    """
    if forward_only:
        return total
    if num_chunks is None:
        return pp_size - pp_rank - 1
    return 2 * (pp_size - pp_rank - 1) + (num_chunks - 1) * group_size + extra


# ----------------------------------------------------------------------------- steps


def forward_step(
    forward_step_func,
    data_iterator,
    model,
    num_microbatches,
    input_tensor,
    forward_data_store,
    config,
    cp_group_size,
    collect_non_loss_data=False,
    checkpoint_activations_microbatch=None,
    is_first_microbatch=False,
    current_microbatch=None,
    vp_stage=None,
    is_last_stage=True,
    cp_group: Optional[dist.ProcessGroup] = None,
):
    """Run one microbatch through one model chunk; on the last stage also compute the
    normalized loss (``forward_step_calc_loss``). Returns ``(output_tensor, num_tokens)``.

    ``cp_group``: the context-parallel group of the loss normalization; None falls back to
    ``parallel_state`` (MPU fallback), or C = 1 when it is not initialized.
    """
    if config.timers is not None:
        config.timers("forward-compute", log_level=2).start()
    if getattr(config, "num_moe_experts", None) or getattr(config, "mtp_num_layers", None):
        set_router_loss_scale(config, _loss_cp_group(cp_group, cp_group_size), num_microbatches)
    if is_first_microbatch:
        _set_is_first_microbatch(model)
    unwrap = not isinstance(input_tensor, list)
    get_attr_wrapped_model(model, "set_input_tensor")(
        input_tensor if not unwrap else [input_tensor]
    )
    autocast = (
        torch.autocast(comm_device().type, dtype=config.autocast_dtype)
        if config.enable_autocast
        else contextlib.nullcontext()
    )
    with autocast:
        output_tensor, loss_func = _call_forward_step_func(
            forward_step_func,
            data_iterator,
            model,
            checkpoint_activations_microbatch,
            current_microbatch,
            num_microbatches,
        )
    output_tensor, num_tokens = forward_step_calc_loss(
        model,
        output_tensor,
        loss_func,
        config,
        vp_stage,
        collect_non_loss_data,
        num_microbatches,
        forward_data_store,
        cp_group_size,
        is_last_stage,
        cp_group,
    )
    if config.timers is not None:
        config.timers("forward-compute").stop()
    return (output_tensor, num_tokens) if unwrap else ([output_tensor], num_tokens)


def check_first_val_step(first_val_step: Optional[bool], forward_only: bool, cond: bool) -> bool:
    """``is_first_microbatch`` of a microbatch (``cond``: the first of its chunk): in a
    forward-only run with ``first_val_step`` given, ``first_val_step and cond``."""
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond


def _set_is_first_microbatch(model) -> None:
    """megatron-core's ``model.set_is_first_microbatch()``, through wrappers without it
    (DDP); nothing for a model without it."""
    try:
        set_first = get_attr_wrapped_model(model, "set_is_first_microbatch")
    except RuntimeError:  # no module on the ``.module`` chain has it
        return
    set_first()


def forward_step_calc_loss(
    model,
    output_tensor,
    loss_func,
    config,
    vp_stage,
    collect_non_loss_data,
    num_microbatches,
    forward_data_store,
    cp_group_size=None,
    is_last_stage=None,
    cp_group: Optional[dist.ProcessGroup] = None,
):
    """On the last stage, call ``loss_func`` and return ``(normalized loss, local count)``.

    The ``reported`` dict goes to ``forward_data_store``; elsewhere returns
    ``(output_tensor, 0)``. Group resolution: ``cp_group``, else ``parallel_state``, else
    C = 1; ``is_last_stage=None`` asks ``parallel_state`` (True when not initialized).
    """
    if is_last_stage is None:
        is_last_stage = (
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
            if parallel_state.model_parallel_is_initialized()
            else True
        )
    if not is_last_stage:
        return output_tensor, _no_tokens()
    if loss_func is None:
        forward_data_store.append(output_tensor)
        return output_tensor, _no_tokens()
    if collect_non_loss_data:
        forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
        return output_tensor, _no_tokens()
    outputs = loss_func(output_tensor)
    cp_group = _loss_cp_group(cp_group, cp_group_size)
    loss, num_tokens, reported = _unpack_loss_outputs(outputs)
    loss = normalize_microbatch_loss(
        loss, num_tokens, cp_group, num_microbatches, _per_token_loss(config)
    )
    forward_data_store.append(reported)
    return loss, (num_tokens if num_tokens is not None else _no_tokens())


def _no_tokens() -> torch.Tensor:
    """The count returned where no three-value loss was computed: 0 (int32, CPU)."""
    return torch.zeros((), dtype=torch.int)


def normalize_microbatch_loss(
    loss: torch.Tensor,
    num_tokens: Optional[torch.Tensor],
    cp_group: Optional[dist.ProcessGroup],
    num_microbatches: int,
    calculate_per_token_loss: bool,
) -> torch.Tensor:
    """The one loss-normalization rule of all schedules (new tensors; inputs untouched).

    three values, averaged:  reduce_loss_across_cp(S_c, N_c, cp) / M  = S_c * C / (max(N,1) * M)
    three values, per-token: S_c (finalize_model_grads divides by the global count)
    two values (legacy):     loss * C / M
    """
    if num_tokens is None:
        return loss * get_pg_size(cp_group) / num_microbatches
    if calculate_per_token_loss:
        return loss + 0.0
    return reduce_loss_across_cp(loss, num_tokens, cp_group) / num_microbatches


def set_router_loss_scale(
    config, cp_group: Optional[dist.ProcessGroup], num_microbatches: int
) -> None:
    """The gradient MoE router losses (``MoEAuxLossAutoScaler``) and the multi-token
    prediction loss (``MTPLossAutoScaler``, normalized by the whole sequence's count)
    receive, the counterpart of ``normalize_microbatch_loss`` for the losses a MoE layer or
    the MTP block adds to the objective:

    averaged and legacy modes: g * C / M (each shard's part of aux_m + z_m; gradient
    averaging over dp_cp divides by D C): the step trains (1/(D M)) sum_m (aux_m + z_m);
    per-token mode: g (the router weights each part by T_m itself and
    ``finalize_model_grads`` divides by the global token count N): sum_m T_m (aux_m + z_m) / N.

    g = ``config.grad_scale_func(1)`` (the loss scale), or 1.
    """
    device = comm_device(cp_group)
    one = torch.ones(1, device=device)
    scale = config.grad_scale_func(one) if config.grad_scale_func is not None else one
    if not config.calculate_per_token_loss:
        scale = scale * get_pg_size(cp_group) / num_microbatches
    MoEAuxLossAutoScaler.set_loss_scale(scale)
    MTPLossAutoScaler.set_loss_scale(scale)


def reduce_loss_across_cp(
    loss_sum: torch.Tensor, num_tokens: torch.Tensor, cp_group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """``loss_sum * C / max(N, 1)`` with N = sum of ``num_tokens`` over the CP group.

    Gradient averaging over dp_cp divides by C, which the factor C undoes, so the step
    trains S / max(N, 1) of the whole sequence whatever the split of valid tokens. The
    count is all-reduced on a clone (the caller's tensor keeps its value); with C = 1 or no
    group there is no collective and the result is ``loss_sum / max(num_tokens, 1)``.
    """
    cp_size = get_pg_size(cp_group)
    if cp_size == 1:
        return loss_sum / _count_denominator(num_tokens, loss_sum)
    total = all_reduce_(num_tokens.detach().clone().to(comm_device(cp_group)), cp_group)
    return loss_sum * cp_size / _count_denominator(total, loss_sum)


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    """Backpropagate one microbatch through one chunk; returns the gradient of its input.

    On the last stage (no ``output_tensor_grad``) the loss is first scaled by
    ``config.grad_scale_func``.
    """
    if config.timers is not None:
        config.timers("backward-compute", log_level=2).start()
    unwrap = not isinstance(input_tensor, list)
    inputs = [input_tensor] if unwrap else input_tensor
    outputs = output_tensor if isinstance(output_tensor, list) else [output_tensor]
    output_grads = (
        output_tensor_grad if isinstance(output_tensor_grad, list) else [output_tensor_grad]
    )
    for tensor in inputs:
        if tensor is not None and tensor.requires_grad:
            tensor.retain_grad()
    if output_grads[0] is None and config.grad_scale_func is not None:
        outputs[0] = config.grad_scale_func(outputs[0])
    if config.deallocate_pipeline_outputs:
        custom_backward(outputs[0], output_grads[0])
    else:
        torch.autograd.backward(outputs[0], grad_tensors=output_grads[0])
    input_grads = [None if t is None else t.grad for t in inputs]
    if config.timers is not None:
        config.timers("backward-compute").stop()
    return input_grads[0] if unwrap else input_grads


def deallocate_output_tensor(out, deallocate_pipeline_outputs=False):
    """Free the storage of an activation already sent to the next stage, keeping its graph.

    Only its ``grad_fn`` is needed for the backward (run through ``custom_backward``).
    """
    if out is None or not deallocate_pipeline_outputs:
        return
    if not isinstance(out, torch.Tensor):
        raise ScheduleTypeError(
            f"deallocate_output_tensor: expected a Tensor, got {type(out).__name__}"
        )
    if out._base is not None:
        raise ScheduleArgumentError(
            "deallocate_output_tensor: refusing to free a view of another tensor"
        )
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output, grad_output):
    """Backward from ``output`` without autograd's shape check, which a deallocated output
    (one element left) would fail; calls the autograd engine directly."""
    if not isinstance(output, torch.Tensor) or output.numel() != 1:
        raise ScheduleArgumentError("custom_backward: output should be pseudo-freed (one element)")
    if grad_output is None:
        if output.numel() != 1:
            raise ScheduleArgumentError("custom_backward: implicit grad requires a scalar output")
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad_output,),
        keep_graph=False,
        create_graph=False,
        inputs=tuple(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _loss_cp_group(
    cp_group: Optional[dist.ProcessGroup], cp_group_size: Optional[int] = None
) -> Optional[dist.ProcessGroup]:
    """The CP group of the loss normalization: None (C = 1) when no group is given and the
    caller says ``cp_group_size`` is 1; else ``resolve_group("cp", cp_group)`` (the MPU
    fallback without a group).

    Raises ValueError when ``cp_group_size`` contradicts the group found.
    """
    if cp_group is None and cp_group_size == 1:
        return None
    cp_group = resolve_group("cp", cp_group)
    size = get_pg_size(cp_group)
    if cp_group_size not in (None, 0) and cp_group_size != size:
        raise ValueError(
            f"cp_group_size={cp_group_size} but the context-parallel group has {size} ranks "
            "(pass cp_group, or initialize parallel_state with that context_parallel_size)"
        )
    return cp_group


# ----------------------------------------------------------------------------- helpers


class _GradSync:
    """Enter/exit ``config.no_sync_func`` (one function or one per chunk) on demand."""

    def __init__(self, no_sync_func) -> None:
        if isinstance(no_sync_func, (list, tuple)):
            funcs = list(no_sync_func)
            self._factory = lambda: _stack(f() for f in funcs)
        else:
            self._factory = no_sync_func or contextlib.nullcontext
        self._active = None

    def disable(self) -> None:
        """Stop gradient reduction (enter the no-sync context) if it is running."""
        if self._active is None:
            self._active = self._factory()
            self._active.__enter__()

    def enable(self) -> None:
        """Let gradient reduction run again (exit the no-sync context)."""
        if self._active is not None:
            self._active.__exit__(None, None, None)
            self._active = None


class _Run:
    """What the three schedules share: argument checks, groups, per-microbatch forward and
    backward, the per-token count, and the finalization."""

    def __init__(
        self,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        pg_collection,
        forward_only,
        collect_non_loss_data,
        pipelined,
        interleaved=False,
        p2p_communicator=None,
        seq_length=None,
        micro_batch_size=None,
        adjust_tensor_shapes_fn=None,
        first_val_step=None,
    ) -> None:
        self.models = list(model) if isinstance(model, (list, tuple)) else [model]
        if not self.models or not all(isinstance(m, torch.nn.Module) for m in self.models):
            raise ScheduleTypeError(
                f"model must be a torch.nn.Module or a list of them, got {model!r}"
            )
        self.config = get_model_config(self.models[0])
        _check_num_microbatches(num_microbatches)
        _check_vpp(self.models, self.config, pipelined, interleaved)
        self.iterators = _per_chunk(data_iterator, len(self.models))
        self.forward_step_func, self.num_microbatches = forward_step_func, num_microbatches
        self.forward_only, self.collect_non_loss_data = forward_only, collect_non_loss_data
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        self.adjust_tensor_shapes_fn = adjust_tensor_shapes_fn
        self.pg_collection = _resolve_pg_collection(pg_collection, self.config, pipelined)
        self.cp_group = self.pg_collection.cp if self.pg_collection is not None else None
        self.cp_size = get_pg_size(self.cp_group)
        self.pp_size, self.pp_rank, self.p2p = 1, 0, None
        if pipelined:
            self.p2p = p2p_communicator or P2PCommunicator(self.pg_collection.pp, self.config)
            self.pp_size, self.pp_rank = self.p2p.pp_size, self.p2p.pp_rank
            if self.pp_size > 1 and self.config.pipeline_dtype is None:
                raise ValueError(
                    "config.pipeline_dtype is None; set it (e.g. torch.float32) when "
                    f"pipeline_model_parallel_size is {self.pp_size} > 1"
                )
        self.grad_sync = _GradSync(self.config.no_sync_func)
        self.store: List[Any] = []
        self.num_tokens = torch.zeros((), dtype=torch.float64, device=comm_device())
        self.count_checks = DeferredCountChecks()
        self._microbatches_run = [0] * len(self.models)
        self.first_val_step: Optional[bool] = first_val_step
        if self.config.timers is not None:
            self.config.timers("forward-backward", log_level=1).start()

    def tensor_shape(self) -> List[int]:
        """Pipeline message shape ``(seq_length // (C * T), micro_batch_size, hidden_size)``,
        T = the tensor-parallel size under sequence parallelism, else 1 (megatron-core's)."""
        seq_length, cp = self.seq_length, self.cp_size
        if getattr(self.config, "sequence_parallel", False):
            cp *= self.config.tensor_model_parallel_size
        if seq_length % cp and not self.config.variable_seq_lengths:
            raise ValueError(
                f"seq_length={seq_length} is not divisible by the context-parallel size "
                f"{self.cp_size} (x the tensor-parallel size under sequence parallelism)"
            )
        return [seq_length // cp, self.micro_batch_size, self.config.hidden_size]

    def forward(
        self, chunk: int, microbatch: int, input_tensor, is_last_stage: bool, vp_stage=None
    ):
        """``forward_step`` for one microbatch of one chunk; counts tokens on the last stage."""
        if self._microbatches_run[chunk] == 0:
            self._sync_params(chunk)
        if vp_stage is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(vp_stage)
        with self.count_checks:
            output, num_tokens = forward_step(
                self.forward_step_func,
                self.iterators[chunk],
                self.models[chunk],
                self.num_microbatches,
                input_tensor,
                self.store,
                self.config,
                self.cp_size,
                self.collect_non_loss_data,
                is_first_microbatch=check_first_val_step(
                    self.first_val_step, self.forward_only, self._microbatches_run[chunk] == 0
                ),
                current_microbatch=microbatch,
                vp_stage=vp_stage,
                is_last_stage=is_last_stage,
                cp_group=self.cp_group,
            )
        self._microbatches_run[chunk] += 1
        if not self.forward_only and is_last_stage and _is_number(output):
            raise ValueError(
                f"loss_func returned a Python number as the loss ({output!r} after "
                "normalization) in training; return a scalar tensor that requires grad "
                "(a number is accepted only with forward_only=True)"
            )
        if is_last_stage and _per_token_loss(self.config) and not self.collect_non_loss_data:
            self.num_tokens = self.num_tokens + num_tokens.detach().to(self.num_tokens)
        return output

    def keep(self, queue: list, input_tensor, output) -> None:
        """Remember a microbatch for its backward (training only)."""
        if not self.forward_only:
            queue.append((input_tensor, output))

    def release(self, sent_output) -> None:
        """Free the storage of an activation once sent (``deallocate_pipeline_outputs``)."""
        if self.forward_only or sent_output is None:
            return
        for tensor in sent_output if isinstance(sent_output, list) else [sent_output]:
            deallocate_output_tensor(tensor, self.config.deallocate_pipeline_outputs)

    def backward(self, input_tensor, output, output_grad):
        """``backward_step`` for one microbatch."""
        return backward_step(
            input_tensor, output, output_grad, ModelType.encoder_or_decoder, self.config
        )

    def finish(self, force_all_reduce) -> List[Any]:
        """Check the step's accelerator counts, restore gradient sync, run ``grad_sync_func``
        and ``finalize_model_grads_func``."""
        self.count_checks.verify()
        config = self.config
        if not self.forward_only:
            self.grad_sync.enable()
            for chunk, model in enumerate(self.models):
                grad_sync = _per_chunk_func(config.grad_sync_func, chunk)
                if grad_sync is not None:
                    grad_sync(model.parameters())
            if config.finalize_model_grads_func is not None:
                config.finalize_model_grads_func(
                    self.models,
                    self.num_tokens if _per_token_loss(config) else None,
                    pg_collection=self.pg_collection,
                    force_all_reduce=force_all_reduce,
                )
        else:
            self.grad_sync.enable()
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return self.store

    def _sync_params(self, chunk: int) -> None:
        """``config.param_sync_func`` before a chunk's first forward (training only)."""
        param_sync = _per_chunk_func(self.config.param_sync_func, chunk)
        if param_sync is not None and not self.forward_only:
            param_sync(self.models[chunk].parameters())


def _call_forward_step_func(
    func, data_iterator, model, checkpoint_microbatch, microbatch, num_microbatches=None
):
    """Call ``forward_step_func`` and check it returned ``(output_tensor, loss_func)``."""
    try:
        if checkpoint_microbatch is None:
            result = func(data_iterator, model)
        else:
            result = func(data_iterator, model, checkpoint_microbatch)
    except StopIteration as exc:
        raise RuntimeError(
            f"data_iterator ran out (StopIteration in forward_step_func) at microbatch "
            f"{microbatch} of num_microbatches={num_microbatches}: it must yield one batch "
            "per microbatch for every model chunk that reads it"
        ) from exc
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise TypeError(
            "forward_step_func must return (output_tensor, loss_func); got "
            f"{_describe(result)} for microbatch {microbatch}"
        )
    return result


def _unpack_loss_outputs(outputs):
    """Validate what ``loss_func`` returned; returns ``(loss, num_tokens or None, reported)``.

    A legacy two-value ``loss_func`` may return a Python number as its loss (as megatron-core
    accepts); ``_Run.forward`` rejects it in training, where a tensor is needed for backward.
    Runs before any collective so that bad input fails on the rank that produced it; only
    the value of a count on an accelerator waits for the end of the schedule
    (``token_counts``), to spare a host sync per microbatch.
    """
    if not isinstance(outputs, (tuple, list)) or len(outputs) not in (2, 3):
        raise ScheduleArgumentError(
            "loss_func must return (loss_sum, num_tokens, reported) or (loss, reported); "
            f"got {_describe(outputs)}"
        )
    loss, num_tokens = outputs[0], (outputs[1] if len(outputs) == 3 else None)
    legacy_number = len(outputs) == 2 and _is_number(loss)
    if not legacy_number and (not isinstance(loss, torch.Tensor) or loss.numel() != 1):
        raise ValueError(
            "loss_func returned a loss that is not a scalar tensor: got "
            f"{_describe(loss)}; expected a one-element tensor (sum the per-token losses)"
        )
    if len(outputs) == 3:
        _check_num_tokens(num_tokens)
    return loss, num_tokens, outputs[-1]


def _per_token_loss(config) -> bool:
    """``config.calculate_per_token_loss``; False for a plain ``ModelParallelConfig``, which
    lacks the field (megatron-core's own schedule tests run with one)."""
    return bool(getattr(config, "calculate_per_token_loss", False))


def _is_number(value) -> bool:
    """A plain Python number (not a bool): a legacy loss allowed when ``forward_only``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count_denominator(count: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``max(count, 1)`` as a floating tensor on the loss's device (no NaN for empty)."""
    dtype = torch.promote_types(loss.dtype, torch.float32)
    return torch.clamp(count.detach().to(device=loss.device, dtype=dtype), min=1.0)


def _resolve_pg_collection(pg_collection, config, pipelined: bool):
    """The groups of this step: ``resolve_pg_collection`` (the caller's, checked here; else
    the MPU fallback; else None: one process, no groups)."""
    if pg_collection is None:
        resolved = resolve_pg_collection()
        if resolved is None and pipelined:
            raise RuntimeError(
                "pipeline schedules need groups: pass pg_collection (with pp) or call "
                "parallel_state.initialize_model_parallel first"
            )
        return resolved
    needed = ["pp"] if pipelined else []
    if config.context_parallel_size > 1:
        needed += ["cp", "dp_cp"]
    missing = [name for name in needed if getattr(pg_collection, name) is None]
    if missing:
        raise ScheduleArgumentError(
            f"pg_collection is missing {', '.join(missing)} (needed with "
            f"context_parallel_size={config.context_parallel_size}"
            f"{', pipeline parallelism' if pipelined else ''}); got {pg_collection!r}"
        )
    return pg_collection


def _check_num_microbatches(num_microbatches) -> None:
    """``num_microbatches`` must be an int >= 1."""
    if (
        isinstance(num_microbatches, bool)
        or not isinstance(num_microbatches, int)
        or (num_microbatches < 1)
    ):
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")


def _check_vpp(
    models: Sequence[torch.nn.Module], config, pipelined: bool, interleaved: bool = False
) -> None:
    """With virtual pipelining the model list holds exactly one chunk per virtual stage
    (the interleaved schedule checks a list of one chunk too)."""
    vpp = config.virtual_pipeline_model_parallel_size
    if vpp is None and parallel_state.model_parallel_is_initialized():
        vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if (len(models) > 1 or interleaved) and vpp is not None and len(models) != vpp:
        raise ScheduleArgumentError(
            f"model is a list of {len(models)} chunks but virtual_pipeline_model_parallel_size "
            f"is {vpp}; pass one chunk per virtual pipeline stage"
        )


def _per_chunk(data_iterator: DataIterator, num_chunks: int) -> list:
    """One data iterator per chunk: a list is used as is, one iterator serves every chunk."""
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != num_chunks:
            raise ScheduleArgumentError(
                f"data_iterator is a list of {len(data_iterator)} but the model has "
                f"{num_chunks} chunks; pass one iterator per chunk"
            )
        return list(data_iterator)
    return [data_iterator] * num_chunks


def _per_chunk_func(func, chunk: int):
    """``func`` for one chunk when ``func`` is a list of per-chunk functions."""
    if isinstance(func, (list, tuple)):
        return func[chunk]
    return func


@contextlib.contextmanager
def _stack(contexts):
    """Enter several context managers as one."""
    with contextlib.ExitStack() as stack:
        for ctx in contexts:
            stack.enter_context(ctx)
        yield


def _describe(value) -> str:
    """Short description of a value for error messages."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} values"
    return f"{type(value).__name__} {value!r}"[:200]
