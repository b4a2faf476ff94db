"""Broadcast a batch from the first rank of the tensor-parallel group to the others.

Only the source rank (TP rank 0) needs ``data``; it sends the shapes first (one int64
broadcast), then every tensor flattened into one buffer of ``datatype`` (one broadcast).
Groups: ``tp_group`` when given, else the MPU fallback of ``resolve_group("tp", ...)``
(``parallel_state``'s TP group when initialized, else one rank: the tensors are returned as
they are, moved to the device).
"""

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core.communication import broadcast_
from megatron.core.device import comm_device
from megatron.core.process_groups_config import get_pg_rank, get_pg_size, resolve_group

_MAX_DATA_DIM = 5


def broadcast_data(
    keys: List[str],
    data: Optional[Dict[str, torch.Tensor]],
    datatype: torch.dtype,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> Dict[str, torch.Tensor]:
    """``{key: tensor}`` for ``keys``, equal on every rank of the TP group to the source
    rank's ``data[key]`` (each of dtype ``datatype``, at most 5 dimensions), on the group's
    device. Non-source ranks may pass ``data=None``."""
    group = resolve_group("tp", tp_group)
    size, rank = get_pg_size(group), get_pg_rank(group)
    device = comm_device(group)
    if rank == 0:
        _check_data(keys, data, datatype)
    if size == 1:
        return {key: data[key].to(device) for key in keys}

    shapes = torch.zeros(len(keys), _MAX_DATA_DIM, dtype=torch.long)
    if rank == 0:
        for i, key in enumerate(keys):
            shapes[i, : data[key].dim()] = torch.tensor(data[key].shape, dtype=torch.long)
    shapes = broadcast_(shapes.to(device), group, src=0)
    sizes = [[int(d) for d in row if d > 0] for row in shapes.cpu().tolist()]
    numels = [int(torch.tensor(s).prod().item()) if s else 0 for s in sizes]

    if rank == 0:
        flat = torch.cat([data[key].to(device).contiguous().reshape(-1) for key in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    broadcast_(flat, group, src=0)
    out, offset = {}, 0
    for key, shape, numel in zip(keys, sizes, numels):
        out[key] = flat.narrow(0, offset, numel).view(shape)
        offset += numel
    return out


def _check_data(keys: List[str], data, datatype: torch.dtype) -> None:
    """Every key present, of ``datatype``, with 1..5 non-empty dimensions."""
    if data is None:
        raise ValueError("broadcast_data: data is None on the source rank (TP rank 0)")
    for key in keys:
        if key not in data:
            raise KeyError(f"broadcast_data: key {key!r} is missing from data on the source rank")
        value = data[key]
        if value.dtype != datatype:
            raise TypeError(
                f"broadcast_data: data[{key!r}] has dtype {value.dtype}, expected {datatype}"
            )
        if not 1 <= value.dim() <= _MAX_DATA_DIM or 0 in value.shape:
            raise ValueError(
                f"broadcast_data: data[{key!r}] has shape {tuple(value.shape)}; expected 1 to "
                f"{_MAX_DATA_DIM} non-empty dimensions"
            )
