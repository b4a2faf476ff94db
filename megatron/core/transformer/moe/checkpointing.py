"""Checkpoint entries of the routed experts with megatron-core's global expert axis.

Every expert weight is stored under ``{prefix}experts.linear_fc1.weight`` /
``{prefix}experts.linear_fc2.weight`` as a global tensor [layers, E, out, in]: the layer
axis (from the block), then the GLOBAL expert index, then the expert-tensor-parallel split
(fc1 of a gated MLP in two halves, like the dense MLP). Replicas over expert data
parallelism carry replica id (0, 0, expert-DP rank), so one rank writes each shard.
``SequentialMLP`` and ``GroupedMLP`` produce the same entries, so a checkpoint loads across
expert-parallel / expert-tensor-parallel sizes and between the two expert modules.
"""

from typing import Dict, List, Tuple

import torch

from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.process_groups_config import get_pg_rank, get_pg_size


def expert_sharded_state_dict(experts, prefix: str, sharded_offsets: tuple, metadata) -> Dict:
    """The sharded entries of a ``SequentialMLP`` or ``GroupedMLP`` (see the module
    docstring); keys of the returned dict are the module's state-dict keys."""
    config = experts.config
    first = experts.first_expert
    info = _Info(
        first=first,
        total=config.num_moe_experts,
        etp=get_pg_size(experts.tp_group),
        etp_rank=get_pg_rank(experts.tp_group),
        replica=(0, 0, get_pg_rank(experts.groups.expt_dp)),
        offsets=tuple(sharded_offsets),
    )
    fc1_stride = 2 if config.gated_linear_unit else 1
    out = _adapter_entries(experts, prefix, info)
    if hasattr(experts, "local_experts"):
        for i, expert in enumerate(experts.local_experts):
            for proj, dim, stride in (("linear_fc1", 0, fc1_stride), ("linear_fc2", 1, 1)):
                param = getattr(expert, proj).weight
                key = f"{prefix}experts.{proj}.weight"
                out[f"{prefix}local_experts.{i}.{proj}.weight"] = _factory(
                    key, param, [(i, lambda t: t)], dim, stride, info, lambda m: m[0]
                )
                bias = getattr(expert, proj).bias  # add_bias_linear: [out]
                if bias is not None:
                    out[f"{prefix}local_experts.{i}.{proj}.bias"] = _factory(
                        f"{prefix}experts.{proj}.bias",
                        bias,
                        [(i, lambda t: t)],
                        0,
                        stride,
                        info if dim == 0 else _whole(info),
                        lambda m: m[0],
                    )
        return out
    count = experts.num_local_experts
    for name, proj, dim, stride, view in (
        ("weight1", "linear_fc1", 0, fc1_stride, experts.expert_w1),
        ("weight2", "linear_fc2", 1, 1, experts.expert_w2),
    ):
        param = getattr(experts, name)
        shape = param.shape

        def per_expert(i, _view=view):
            return lambda tensor: _view_of(tensor, experts, _view)[i].t()

        def merge(matrices: List[torch.Tensor], _shape=shape) -> torch.Tensor:
            return torch.stack([m.t() for m in matrices]).reshape(_shape)

        out[f"{prefix}{name}"] = _factory(
            f"{prefix}experts.{proj}.weight",
            param,
            [(i, per_expert(i)) for i in range(count)],
            dim,
            stride,
            info,
            merge,
        )
    for name, proj, stride, where in (
        ("bias1", "linear_fc1", fc1_stride, info),
        ("bias2", "linear_fc2", 1, _whole(info)),
    ):
        param = getattr(experts, name, None)
        if param is not None:  # add_bias_linear: [E_local, out]
            rows = [(i, lambda t, _i=i: t[_i]) for i in range(count)]
            out[f"{prefix}{name}"] = _factory(
                f"{prefix}experts.{proj}.bias", param, rows, 0, stride, where, torch.stack
            )
    return out


def _whole(info: "_Info") -> "_Info":
    """``info`` for a tensor whole on every expert-TP rank (the fc2 bias): not split over
    expert TP, expert-TP ranks > 0 replicas of rank 0."""
    replica = (0, info.etp_rank, info.replica[2])
    return _Info(**dict(info.__dict__, etp=1, etp_rank=0, replica=replica))


def _adapter_entries(experts, prefix: str, info) -> Dict:
    """The LoRA adapters of the experts (``moe.expert_lora``), if any: expert g's A and B
    under ``{prefix}experts.<proj>.adapter.linear_in.weight`` / ``linear_out.weight``
    [layers, E, out, in], split over ETP as they are held (A of fc1 on its rank dimension,
    A of fc2 on its input, both B on their output, fc1's with the gated stride: the split
    each marks on its weight)."""
    from megatron.core.transformer.moe.expert_lora import expert_adapters_of

    adapters = expert_adapters_of(experts)
    out: Dict = {}
    for proj, adapter in (adapters or {}).items():
        for part in ("linear_in", "linear_out"):
            param = getattr(adapter, part).weight
            # the split the adapter marks on its stacked [E, out, in] weight, per expert
            dim, stride = param.partition_dim - 1, param.partition_stride
            takes = [(i, lambda t, i=i: t[i]) for i in range(param.shape[0])]
            out[f"{prefix}adapter.{proj}.{part}.weight"] = _factory(
                f"{prefix}experts.{proj}.adapter.{part}.weight",
                param,
                takes,
                dim,
                stride,
                info,
                torch.stack,
            )
    return out


class _Info:
    def __init__(self, **kwargs) -> None:
        self.__dict__.update(kwargs)


def _view_of(tensor: torch.Tensor, experts, view) -> torch.Tensor:
    """``view``'s [E_local, a, b] reading of ``tensor`` (the parameter or loaded data)."""
    shape = view().shape
    return tensor.reshape(shape)


def _factory(key, param, experts: List[Tuple[int, object]], dim, stride, info, merge):
    """Pieces: for each local expert i (its matrix [out, in] taken from the data by the
    given function) and each of the ``stride`` blocks along ``dim``, the box at global
    expert ``first + i`` and ETP position ``block * etp + etp_rank``."""
    prepend = len(info.offsets) + 1
    axis = dim + prepend

    def build(key, data, replica_id, flattened_range):
        pieces = {}
        for i, take in experts:
            matrix = take(data)
            for s, block in enumerate(torch.chunk(matrix.contiguous(), stride, dim=dim)):
                pieces[f"{i}.{s}"] = ShardedTensor.from_rank_offsets(
                    key,
                    block.contiguous(),
                    *info.offsets,
                    (len(info.offsets), info.first + i, info.total),
                    (axis, s * info.etp + info.etp_rank, info.etp * stride),
                    replica_id=replica_id,
                    prepend_axis_num=prepend,
                )
        return pieces

    def merge_fn(loaded: Dict[str, torch.Tensor]) -> torch.Tensor:
        matrices = [
            torch.cat([loaded[f"{i}.{s}"] for s in range(stride)], dim=dim) for i, _ in experts
        ]
        return merge(matrices)

    return ShardedTensorFactory(key, param, build, merge_fn, info.replica)
