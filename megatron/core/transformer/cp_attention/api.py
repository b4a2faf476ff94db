"""``context_parallel_attention``: the entry point the model calls, its checks and dispatch."""

import math
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core import config_rules
from megatron.core.config_rules import CP_COMM_TYPES
from megatron.core.process_groups_config import get_pg_size
from megatron.core.transformer.cp_attention.kernels import Kernel
from megatron.core.transformer.cp_attention.local import local_attention
from megatron.core.transformer.cp_attention.registry import STRATEGIES
from megatron.core.transformer.cp_attention.strategy import AttentionCall, Strategy


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cp_group: Union[None, dist.ProcessGroup, Sequence[dist.ProcessGroup]] = None,
    cp_comm_type: Optional[str] = "all_gather",
    softmax_scale: Optional[float] = None,
    packed_seq_params=None,
    kernel: Optional[str] = None,
    num_head_groups: Optional[int] = None,
    window_size: Optional[Tuple[int, int]] = None,
    softmax_offset: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    ``query`` is [s_local, b, np, d]; ``key`` and ``value`` are [s_local, b, ng, d] with np a
    multiple of ng (grouped-query attention: query head i uses key/value head i // (np/ng)).
    ``cp_group`` None or of size 1 means the shard is the whole sequence; for
    ``cp_comm_type="a2a+p2p"`` it is the pair [all-to-all group of A ranks, ring group of P
    ranks] that ``parallel_state.get_hierarchical_context_parallel_groups()`` returns for
    ``hierarchical_context_parallel_sizes=[A, P]`` (the CP rank is ring rank * A + rank in
    the all-to-all group). Returns
    [s_local, b, np, d]: softmax(scale * Q K^T + causal mask) V, scale = ``softmax_scale``
    or 1/sqrt(d).

    ``packed_seq_params`` (``qkv_format="thd"``, b = 1): documents given by
    ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``) never attend to each other; each padded
    document is split over the CP ranks with the load-balanced rule (its padded length a
    multiple of 2C), tokens past the last document form one more document of padding. Rows
    at or past a document's real length (``cu_seqlens_q``) are padding: their output is 0
    and they pass no gradient. ``kernel`` picks the attention kernel (``kernels``' names;
    None or "auto": the one PyTorch's SDPA would pick, see ``kernel_choice``);
    ``num_head_groups`` how many K/V head groups the all-gather is split into (default: one,
    unless the gathered K/V would exceed 2 GiB; see ``all_gather.head_groups``).
    ``window_size`` (megatron-core's (left, right); right 0 or -1): sliding-window attention,
    query i sees keys i - left .. i (of its own document); at C = 1 and with a2a
    (``check_window_size`` says which settings can have one). ``softmax_offset`` [np]
    (megatron-core's name): attention sinks, one logit per query head added to the softmax
    denominator, exp(sink_h) + sum_j exp(s_ij) (``sinks``; differentiable), in every mode.
    ``softcap`` (Gemma 2's ``attn_logit_softcapping``): scores softcap * tanh(scale * Q K^T
    / softcap), on the explicit "math" kernel (``kernel`` must be it, or None / "auto", which
    then picks it), every strategy and packed sequences alike; with sinks too (the sink joins
    the soft-capped scores' log-sum-exp).
    """
    strategy = _check_arguments(query, key, value, cp_comm_type, cp_group, packed_seq_params)
    cp_size = 0 if strategy.group_pair else get_pg_size(cp_group)
    window = check_window_size(window_size, strategy.name, cp_size)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
    kernel = Kernel(kernel, scale, window, softcap)  # checks the soft-cap
    call = AttentionCall(kernel, packed_seq_params, num_head_groups, softmax_offset)
    return _run(query, key, value, cp_group, strategy, call)


def attention_with_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kernel: Kernel,
    *,
    cp_group: Union[None, dist.ProcessGroup, Sequence[dist.ProcessGroup]] = None,
    cp_comm_type: Optional[str] = "all_gather",
    packed_seq_params=None,
    softmax_offset: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``context_parallel_attention`` with its kernel options built and checked beforehand,
    once, where a layer is built: ``kernel`` (its window one that ``check_window_size``
    allows for ``cp_comm_type`` at this group's size). The tensors, the group and the sinks
    are checked per call."""
    strategy = _check_arguments(query, key, value, cp_comm_type, cp_group, packed_seq_params)
    call = AttentionCall(kernel, packed_seq_params, None, softmax_offset)
    return _run(query, key, value, cp_group, strategy, call)


def _run(query, key, value, cp_group, strategy: Strategy, call: AttentionCall) -> torch.Tensor:
    """The strategy's and the sinks' checks of this call, then the strategy (or local
    attention at C = 1)."""
    strategy.validate(query, key, cp_group)
    _check_sink(call.sink, query)
    if not strategy.group_pair and get_pg_size(cp_group) == 1:
        return local_attention(query, key, value, call.packed, call.kernel, call.sink)
    return strategy.run(query, key, value, cp_group, call)


def check_window_size(window_size, cp_comm_type: Optional[str], cp_size: int) -> Optional[int]:
    """How many earlier keys a query sees under ``window_size`` (None: all), or a ValueError
    naming the settings when ``cp_comm_type`` at ``cp_size`` ranks (0: unknown, for group
    pairs) cannot compute it exactly: every strategy can at C = 1, at C > 1 only those
    registered with ``sliding_window``."""
    if not config_rules.window_size_valid(window_size):
        raise ValueError(
            "context_parallel_attention: window_size must be None or (left, right) with left "
            f">= 0 (or -1: no limit) and right 0 or -1, got {window_size!r}"
        )
    window = config_rules.window_left(window_size)
    name = "all_gather" if cp_comm_type is None else cp_comm_type
    if window is not None and cp_size != 1 and not STRATEGIES[name].sliding_window:
        able = [s.name for s in STRATEGIES.values() if s.sliding_window]
        raise ValueError(
            f"window_size={tuple(window_size)!r} (sliding-window attention) is implemented at "
            f"context_parallel_size 1 and with cp_comm_type in {able}; got "
            f"cp_comm_type={name!r} at context_parallel_size "
            f"{cp_size if cp_size else '> 1 (hierarchical)'}"
        )
    return window


def _check_sink(sink: Optional[torch.Tensor], query: torch.Tensor) -> None:
    """``softmax_offset`` is None or one value per query head, on the query's device."""
    if sink is None:
        return
    if sink.dim() != 1 or sink.shape[0] != query.shape[2] or sink.device != query.device:
        raise ValueError(
            f"context_parallel_attention: softmax_offset must be [{query.shape[2]}] (one "
            f"sink logit per query head) on {query.device}, got {tuple(sink.shape)} on "
            f"{sink.device}"
        )


def _check_arguments(query, key, value, cp_comm_type, cp_group, packed) -> Strategy:
    """Validate shapes and options before any collective; returns the strategy."""
    comm = "all_gather" if cp_comm_type is None else cp_comm_type
    if not isinstance(comm, str) or comm not in STRATEGIES:
        raise ValueError(
            f"context_parallel_attention: cp_comm_type must be one of {CP_COMM_TYPES} or None, "
            f"got {cp_comm_type!r}"
        )
    strategy = STRATEGIES[comm]
    pair = isinstance(cp_group, (list, tuple))
    if strategy.group_pair and not (
        pair and len(cp_group) == 2 and all(isinstance(g, dist.ProcessGroup) for g in cp_group)
    ):
        raise ValueError(
            f"context_parallel_attention: cp_comm_type={comm!r} needs cp_group = [all-to-all "
            "group, ring group] (parallel_state.get_hierarchical_context_parallel_groups() of "
            f"hierarchical_context_parallel_sizes=[A, P]), got {cp_group!r}"
        )
    if not strategy.group_pair and pair:
        takers = " or ".join(
            f"cp_comm_type={s.name!r}" for s in STRATEGIES.values() if s.group_pair
        )
        raise ValueError(
            f"context_parallel_attention: cp_group is a list of groups, which only {takers} "
            f"takes; got cp_comm_type={comm!r}"
        )
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        raise ValueError(
            "context_parallel_attention: query must be [s, b, np, d] and key/value [s, b, ng, d] "
            f"of equal shapes, got {tuple(query.shape)}, {tuple(key.shape)}, "
            f"{tuple(value.shape)}"
        )
    dtypes = {name: x.dtype for name, x in (("query", query), ("key", key), ("value", value))}
    if len(set(dtypes.values())) != 1 or not query.dtype.is_floating_point:
        raise ValueError(
            "context_parallel_attention: query, key and value must have one floating-point "
            "dtype, got "
            + ", ".join(f"{n} {str(t).replace('torch.', '')}" for n, t in dtypes.items())
        )
    devices = {name: x.device for name, x in (("query", query), ("key", key), ("value", value))}
    if len(set(devices.values())) != 1:
        raise ValueError(
            "context_parallel_attention: query, key and value must be on one device, got "
            + ", ".join(f"{n} {d}" for n, d in devices.items())
        )
    s, b, n_q, d = query.shape
    if key.shape[0] != s or key.shape[1] != b or key.shape[3] != d or n_q % key.shape[2]:
        raise ValueError(
            f"context_parallel_attention: key/value {tuple(key.shape)} do not fit query "
            f"{tuple(query.shape)} (same s, b, d; np a multiple of ng)"
        )
    if packed is not None and b != 1:
        raise ValueError(
            f"context_parallel_attention: packed sequences (thd) need batch size 1, got {b}"
        )
    return strategy
