"""The process-wide tracker of the MoE router losses and token counts: each layer adds its
shard's part; ``reduced_moe_metrics`` / ``track_moe_metrics`` reduce them over the ranks
(the same values on every layout) for logging."""

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import communication
from megatron.core.device import comm_device
from megatron.core.process_groups_config import (
    ProcessGroupCollection,
    get_pg_size,
    resolve_pg_collection,
)

_TRACKER: Dict[str, dict] = {}


def get_moe_layer_wise_logging_tracker() -> dict:
    """The tracker: name -> {"values": [num_layers] (or [num_layers, E] for the load),
    "reduce_group": the group whose ranks hold parts of the same micro-batch (summed),
    "avg_group": the data-parallel group (averaged; summed for counts)}."""
    return _TRACKER


def save_to_aux_losses_tracker(
    name: str,
    loss: torch.Tensor,
    layer_number: int,
    num_layers: int,
    reduce_group: Optional[dist.ProcessGroup] = None,
    avg_group: Optional[dist.ProcessGroup] = None,
    reduce_group_has_dp: bool = False,
) -> None:
    """Add this shard's part of a layer's loss (``layer_number`` 1-based, global) to the
    tracker; the parts are summed over ``reduce_group`` and averaged over ``avg_group``
    when the metrics are reduced."""
    if layer_number is None:
        return
    entry = _TRACKER.setdefault(name, {})
    values = entry.get("values")
    if (
        values is None
        or values.shape[0] != num_layers
        or values.dtype != loss.dtype
        or values.device != loss.device
    ):  # another model's entry (a float32 one would round a float64 model's losses)
        values = torch.zeros(num_layers, dtype=loss.dtype, device=loss.device)
    entry["values"] = values
    values[layer_number - 1] += loss.detach().to(values.dtype)
    entry["reduce_group"] = reduce_group
    entry["avg_group"] = avg_group
    entry["reduce_group_has_dp"] = reduce_group_has_dp


def save_tokens_per_expert(
    tokens_per_expert: torch.Tensor,
    layer_number: int,
    num_layers: int,
    reduce_group: Optional[dist.ProcessGroup],
    dp_group: Optional[dist.ProcessGroup],
) -> None:
    """Add this shard's per-expert count of valid tokens (the dispatch map, int64) to the
    tracker entry "tokens_per_expert" [num_layers, E] (an extra of this core); summed over
    ``reduce_group`` and ``dp_group`` when reduced."""
    if layer_number is None:
        return
    entry = _TRACKER.setdefault("tokens_per_expert", {})
    values = entry.get("values")
    shape = (num_layers, tokens_per_expert.numel())
    if values is None or tuple(values.shape) != shape or values.device != tokens_per_expert.device:
        values = torch.zeros(shape, dtype=torch.int64, device=tokens_per_expert.device)
    entry["values"] = values
    values[layer_number - 1] += tokens_per_expert.detach().to(torch.int64)
    entry.update(reduce_group=reduce_group, sum_group=dp_group, avg_group=None)


def reset_aux_losses_tracker() -> None:
    """Drop every tracker entry (a new model): the tracker is process-wide, and an entry of
    another model would be reduced over that model's groups (a collective the new model's
    ranks never join). ``clear_aux_losses_tracker`` only zeroes the values (a new step)."""
    _TRACKER.clear()


def clear_aux_losses_tracker() -> None:
    """Zero every tracked value (start of an iteration)."""
    for entry in _TRACKER.values():
        if entry.get("values") is not None:
            entry["values"].zero_()


def reduce_aux_losses_tracker_across_ranks(
    track_names: Optional[List[str]] = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
) -> None:
    """In place: sum every entry over its ``reduce_group``, average it over ``avg_group``
    (sum counts over ``sum_group``), then sum it over the pipeline group (each layer lives on
    one stage). A stage without the entry (no MoE layer there, e.g. DeepSeek's first dense
    layers) joins with zeros: the stages agree on the entries first.
    Groups: ``pg_collection.pp``, else ``parallel_state``'s (MPU fallback), else none."""
    groups = resolve_pg_collection(pg_collection)
    pp = None if groups is None else groups.pp
    names = track_names if track_names is not None else list(_TRACKER)
    if pp is not None and get_pg_size(pp) > 1:
        names = _agree_over_pipeline(names, pp)
    for name in names:
        entry = _TRACKER.get(name)
        if entry is None or entry.get("values") is None:
            continue
        values = entry["values"]
        for group in (entry.get("reduce_group"), entry.get("sum_group")):
            values = communication.all_reduce(values, group)
        avg_group = entry.get("avg_group")
        if avg_group is not None and get_pg_size(avg_group) > 1:
            values = communication.all_reduce(values, avg_group) / get_pg_size(avg_group)
        values = communication.all_reduce(values, pp)
        entry["values"] = values.to(entry["values"].dtype)


def _agree_over_pipeline(names: List[str], pp: dist.ProcessGroup) -> List[str]:
    """The entries of ``names`` any stage holds, in one order on every stage; an entry this
    stage lacks is added as zeros of the others' shape and dtype (no group of its own)."""
    mine = {
        name: (tuple(entry["values"].shape), str(entry["values"].dtype).split(".")[-1])
        for name in names
        if (entry := _TRACKER.get(name)) is not None and entry.get("values") is not None
    }
    held: Dict[str, tuple] = {}
    for other in communication.all_gather_object(mine, pp):
        held.update(other)
    for name, (shape, dtype) in held.items():
        entry = _TRACKER.setdefault(name, {})
        if entry.get("values") is None:
            zeros = torch.zeros(shape, dtype=getattr(torch, dtype), device=comm_device())
            entry.update(values=zeros, reduce_group=None, avg_group=None, sum_group=None)
    return sorted(held)


def reduced_moe_metrics(
    loss_scale: float,
    num_layers: Optional[int] = None,
    moe_layer_freq=None,
    pg_collection: Optional[ProcessGroupCollection] = None,
    track_names: Optional[List[str]] = None,
    mtp_num_layers: Optional[int] = None,
) -> Dict[str, torch.Tensor]:
    """The step's tracked values reduced over ranks (``reduce_aux_losses_tracker_across_
    ranks``), losses times ``loss_scale`` (1/M): name -> per-layer values of the MoE layers
    ([L_moe], [L_moe, E] for "tokens_per_expert"), then of the ``mtp_num_layers`` MTP depths
    (filed after the decoder's layers; megatron-core counts each depth as a MoE layer). The
    same on every rank and layout."""
    reduce_aux_losses_tracker_across_ranks(track_names, pg_collection)
    from megatron.core.config_rules import moe_layer_pattern

    mtp = mtp_num_layers or 0
    out = {}
    for name in track_names if track_names is not None else list(_TRACKER):
        entry = _TRACKER.get(name)
        if entry is None or entry.get("values") is None:
            continue
        values = entry["values"]
        layers = values.shape[0] - mtp if num_layers is None else num_layers
        pattern = moe_layer_pattern(moe_layer_freq if moe_layer_freq is not None else 1, layers)
        pattern = list(pattern or [1] * layers) + [1] * mtp
        keep = [i for i, flag in enumerate(pattern) if flag and i < len(values)]
        values = values[keep]
        out[name] = values if name == "tokens_per_expert" else values * loss_scale
    return out


def track_moe_metrics(
    loss_scale: float,
    iteration: int,
    writer=None,
    wandb_writer=None,
    total_loss_dict: Optional[dict] = None,
    per_layer_logging: bool = False,
    force_initialize: bool = False,
    track_names: Optional[List[str]] = None,
    num_layers: Optional[int] = None,
    moe_layer_freq=None,
    mtp_num_layers: Optional[int] = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
) -> None:
    """Reduce the tracked router losses over ranks, add each loss's mean over the MoE
    layers (times ``loss_scale``) to ``total_loss_dict``, write them (and, with
    ``per_layer_logging``, each layer's) to ``writer`` / ``wandb_writer``, and clear the
    tracker. The values are the same on every layout (see the module docstring). With
    ``mtp_num_layers`` the MTP depths' routers count as MoE layers after the decoder's (as
    megatron-core 0.16.1: the mean is over the MoE layers and the depths)."""
    if force_initialize and track_names:
        for name in track_names:
            _TRACKER.setdefault(name, {}).setdefault("values", None)
    metrics = reduced_moe_metrics(
        loss_scale, num_layers, moe_layer_freq, pg_collection, track_names, mtp_num_layers
    )
    for name, values in metrics.items():
        if name == "tokens_per_expert" or values.numel() == 0:
            continue
        mean = values.double().mean()
        if total_loss_dict is not None:
            total_loss_dict[name] = total_loss_dict.get(name, 0.0) + mean
        if writer is not None:
            writer.add_scalar(name, float(mean), iteration)
            if per_layer_logging:
                for i, value in enumerate(values.tolist()):
                    writer.add_scalar(f"moe/{name}_layer_{i}", value, iteration)
        if wandb_writer is not None:
            logs = {name: float(mean)}
            if per_layer_logging:
                logs.update({f"moe/{name}_layer_{i}": v for i, v in enumerate(values.tolist())})
            wandb_writer.log(logs, iteration)
    clear_aux_losses_tracker()
