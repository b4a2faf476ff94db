"""finalize_model_grads: what must happen to gradients between the last backward and the
optimizer step."""

from typing import List, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core.communication import all_reduce_, broadcast_
from megatron.core.device import comm_device
from megatron.core.process_groups_config import (
    ProcessGroupCollection,
    get_pg_size,
    resolve_pg_collection,
)
from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias
from megatron.core.utils import get_attr_wrapped_model


def finalize_model_grads(
    model: List[torch.nn.Module],
    num_tokens: Optional[torch.Tensor] = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
    force_all_reduce: Optional[bool] = False,
) -> None:
    """Finish the dp x cp reduction of every chunk, sum the gradients of parameters marked
    ``sequence_parallel`` over the TP group, sum tied word-embedding gradients over the
    embedding group and position-embedding gradients over theirs, and in per-token mode
    scale all gradients by ``1 / max(N, 1)``, N = the step's valid tokens over all ranks.

    Sequence parallelism: a parameter replicated over TP but fed a TP shard of the data
    (``param.sequence_parallel = True``: norm weights, row-parallel biases, any replicated
    parameter inside a sequence-parallel region) gets only its shard's share of dL/dp on
    each TP rank; the full gradient is the SUM over the TP group (``pg_collection.tp``, else
    the MPU fallback), done in one flat buffer per dtype, whatever the module.

    MoE routers with an expert bias (aux-loss-free balancing): the step's valid-token counts
    per expert are summed (int64) over the model's tp x dp x cp group and each bias moves by
    ``moe_router_bias_update_rate * sign(mean - count)``; the counts restart from zero.

    ``num_tokens`` (per-token mode): this rank's count; the last pipeline stage's value is
    broadcast over pp and summed over dp_cp. Groups: ``pg_collection``, else
    ``parallel_state`` (MPU fallback), else none (one process).
    """
    groups = resolve_pg_collection(pg_collection)
    if num_tokens is not None and groups is not None and groups.dp_cp is None:
        raise ValueError(
            "finalize_model_grads: num_tokens is given (per-token mode) but pg_collection has "
            f"no dp_cp group to sum it over; got {pg_collection!r}"
        )
    if pg_collection is not None and pg_collection.tp is None and _has_tp_summed_params(model):
        raise ValueError(
            "finalize_model_grads: parameters marked sequence_parallel need their gradients "
            "summed over the tensor-parallel group (tensor_model_parallel_size > 1), but "
            f"pg_collection has no tp group; got {pg_collection!r}"
        )
    for chunk in model:
        chunk.finish_grad_sync(force_all_reduce=force_all_reduce)
    if groups is not None:
        _allreduce_sequence_parallel_grads(model, groups.tp)
        _allreduce_word_embedding_grads(model, groups)
        _allreduce_position_embedding_grads(model, groups)
    if _may_have_expert_bias(model):
        _update_router_expert_bias(model, groups)
    if num_tokens is not None:
        total = _global_token_count(num_tokens, groups)
        scale = 1.0 / torch.clamp(total, min=1.0)
        for chunk in model:
            chunk.scale_gradients(scale)


def _may_have_expert_bias(model: List[torch.nn.Module]) -> bool:
    """False when every chunk's config says ``moe_router_enable_expert_bias`` is off (a dense
    model: no walk over its modules each step, as megatron-core); a chunk without a config
    is walked."""
    for chunk in model:
        try:
            config = get_attr_wrapped_model(chunk, "config", allow_none=False)
        except RuntimeError:
            return True
        if getattr(config, "moe_router_enable_expert_bias", True):
            return True
    return False


def _update_router_expert_bias(model: List[torch.nn.Module], groups) -> None:
    """Update every router's ``expert_bias`` from its counts (see ``finalize_model_grads``);
    one all-reduce of all of this rank's routers' counts."""
    routers = [
        module
        for chunk in model
        for module in chunk.modules()
        if getattr(module, "expert_bias", None) is not None
        and getattr(module, "local_tokens_per_expert", None) is not None
    ]
    if not routers:
        return
    group = None if groups is None else groups.tp_dp_cp
    counts = torch.stack([r.local_tokens_per_expert for r in routers])
    rate = routers[0].config.moe_router_bias_update_rate
    with torch.no_grad():
        updated = get_updated_expert_bias(
            counts, torch.stack([r.expert_bias for r in routers]), rate, group=group
        )
        for router, bias in zip(routers, updated):
            router.expert_bias.copy_(bias)
            router.local_tokens_per_expert.zero_()


def _global_token_count(num_tokens: torch.Tensor, groups) -> torch.Tensor:
    """N = sum over dp_cp of the last pipeline stage's count (a float64 clone)."""
    total = num_tokens.detach().clone().to(device=comm_device(), dtype=torch.float64)
    if groups is None:
        return total
    pp = groups.pp
    broadcast_(total, pp, src=get_pg_size(pp) - 1)
    return all_reduce_(total, groups.dp_cp)


def _allreduce_sequence_parallel_grads(
    model: List[torch.nn.Module], tp_group: Optional[dist.ProcessGroup]
) -> None:
    """Sum over ``tp_group`` the gradient of every parameter with ``sequence_parallel=True``
    (coalesced: one all-reduce per gradient dtype)."""
    if tp_group is None or tp_group.size() == 1:
        return
    by_dtype = {}
    for chunk in model:
        for param in chunk.parameters():
            if not getattr(param, "sequence_parallel", False) or not param.requires_grad:
                continue
            grad = _grad_of(param)
            if grad is not None:
                by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = all_reduce_(_flatten_dense_tensors(grads), tp_group)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)


def _has_tp_summed_params(model: List[torch.nn.Module]) -> bool:
    """Whether the model runs with TP > 1 and has parameters marked ``sequence_parallel``."""
    config = getattr(model[0], "config", None) if model else None
    if getattr(config, "tensor_model_parallel_size", 1) <= 1:
        return False
    return any(getattr(p, "sequence_parallel", False) for c in model for p in c.parameters())


def _allreduce_word_embedding_grads(model: List[torch.nn.Module], groups) -> None:
    """Sum the tied word-embedding/output-weight gradient over the first and last stage;
    with multi-token prediction the last stage's copy of the word embeddings (which the MTP
    depths embed with) is summed with the first stage's, tied or not."""
    embd, pp = groups.embd, groups.pp
    if embd is None or embd.size() == 1 or pp is None or embd.rank() < 0:
        return
    chunk = model[0] if pp.rank() == 0 else model[-1]
    owner = _find(chunk, "share_embeddings_and_output_weights")
    if owner is None:
        return
    if not (
        owner.share_embeddings_and_output_weights or getattr(owner.config, "mtp_num_layers", None)
    ):
        return
    weight = owner.shared_embedding_or_output_weight()
    if not weight.requires_grad:  # frozen (a LoRA base): no gradient to sum
        return
    all_reduce_(_grad_of(weight), embd)


def _allreduce_position_embedding_grads(model: List[torch.nn.Module], groups) -> None:
    """Sum position-embedding gradients over the position-embedding group (if > 1 rank)."""
    pos, pp = groups.pos_embd, groups.pp
    if pos is None or pos.size() == 1 or pos.rank() < 0:
        return
    owner = _find(model[0] if pp is None or pp.rank() == 0 else model[-1], "embedding")
    weight = getattr(getattr(owner, "embedding", None), "position_embeddings", None)
    if weight is not None and weight.weight.requires_grad:
        all_reduce_(_grad_of(weight.weight), pos)


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor:
    """The gradient DDP keeps (``main_grad``), else ``.grad``."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def _find(chunk: torch.nn.Module, attr: str):
    """The (unwrapped) module that has ``attr``, or None."""
    try:
        return get_attr_wrapped_model(chunk, attr, return_model_obj=True)
    except RuntimeError:
        return None
