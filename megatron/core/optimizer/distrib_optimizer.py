"""The distributed optimizer (ZeRO-1): the mixed-precision optimizer over this rank's shards.

Layout (``DistributedDataParallel(use_distributed_optimizer=True)``): every bucket of a
gradient buffer is padded to a multiple of D, the size of the buffer's data-parallel group
(``buffer.data_parallel_group``: dp x cp for dense parameters), and cut into D equal pieces;
rank r of that group owns piece r of each bucket. A parameter whose elements ``[a, b)`` fall
in this rank's piece has one ``Shard`` record: the range, its buffer, and its main tensor
(``main_params.make_main_shard``: a view ``param.view(-1)[a:b]`` for fp32 parameters, stepped
in place; an fp32 copy for bf16/fp16 ones, written back after the step).

``step()`` is ``MixedPrecisionOptimizer``'s: ``main.grad = main_grad.view(-1)[a:b]`` (the
reduce-scattered shard), unscale and check for inf/nan, clip by the global norm, step
``torch.optim`` on the shards, copy back; then all-gather the parameter buffers
(``DDP.start_param_sync``: asynchronously with ``overlap_param_gather``).

Gradient statistics go through the shared hook (``MegatronOptimizer._reduce_grad_stats``)
with the data-parallel group first: each element of a gradient lies in exactly one rank's
shard of its buffer's group, so

    ||g||_p^p = sum_{mp} sum_{dp x cp} sum_{shards on this rank} ||g_shard||_p^p

(TP duplicates and the tied embedding copy filtered as in ``clip_grads``). Expert parameters
(megatron-core marks them ``param.allreduce = False``) live in buffers of their own whose
group is the expert-data-parallel group; the optimizer shards every buffer over its own group,
so expert state is sharded over expert DP, and the experts' part of a statistic is reduced
over expert DP, then expert tp x ep x pp (``_expert_grad_stats_groups``):

    ||g_expert||_p^p = sum_{expert tp x ep x pp} sum_{expert dp} sum_{shards} ||g_shard||_p^p

Leaving out expert DP (the plain optimizer's groups: its expert grads are whole, this
optimizer's are shards) drops the other expert-DP ranks' shards: a wrong, rank-dependent norm
whenever expert DP > 1 (EP 2 x DP 4: each EP group saw half of the expert elements); summing
over the dense dp x cp group instead counts each expert element EP times.

Checkpoints (``sharded_state_dict``): each rank writes and reads only its shards, as
``ShardedTensor`` s with ``flattened_range`` inside the boxes the non-distributed optimizer
uses (``optimizer.state.<name>.<parameter key>``), so a checkpoint reshards to any D and to and
from the non-distributed optimizer, and no rank ever holds more than its own state. The
non-sharded ``state_dict()`` is the non-distributed format (whole tensors, all-gathered over
the group: for tools and tests, not for training checkpoints).
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.communication import all_gather_along_first_dim, all_gather_object, all_reduce_
from megatron.core.device import comm_device
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    restore_common_step,
)
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.main_params import HALF_DTYPES, make_main_shard
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer, init_optimizer_state
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.process_groups_config import get_pg_rank, get_pg_size, resolve_group

# In a sharded state dict built by ``sharded_state_dict``: the state tensors are this rank's
# flat shards (returned by ``load`` as they are, never saved).
SHARD_LAYOUT_KEY = "shard_layout"
FLAT_SHARDS = "flat_shards"


@dataclass
class Shard:
    """Elements ``[start, end)`` of ``param`` (flattened) owned by this rank: their place in
    ``buffer`` and the fp32 ``main`` tensor the torch optimizer steps for them."""

    param: torch.nn.Parameter
    start: int
    end: int
    buffer: Any
    main: torch.Tensor

    @property
    def size(self) -> int:
        return self.end - self.start

    def model_flat(self) -> torch.Tensor:
        """The parameter's elements of this shard (a view)."""
        return self.param.data.view(-1)[self.start : self.end]

    def grad_flat(self) -> torch.Tensor:
        """The reduced gradient of this shard (a view of DDP's ``main_grad``)."""
        return self.param.main_grad.view(-1)[self.start : self.end]


class DistributedOptimizer(MixedPrecisionOptimizer):
    """A torch optimizer over this rank's shards (see the module docstring).

    ``optimizer``'s param groups hold model parameters on entry (their hyper-parameters are
    kept); they are replaced by the main shards. ``model_chunks`` are the DDP chunks (built with
    ``use_distributed_optimizer=True``); each buffer is sharded over its own
    ``data_parallel_group``. ``data_parallel_group`` is the group gradient statistics are
    summed over before the model-parallel one (default: the chunks' dp x cp group).
    ``init_state_fn(optimizer, config)`` creates empty state before a checkpoint is loaded
    into it (default: ``init_optimizer_state``). ``per_model_buffers``,
    ``data_parallel_group_gloo``, ``data_parallel_group_idx`` and
    ``distributed_optimizer_instance_id`` are megatron-core's parameters; only one optimizer
    instance (id 0) is supported.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: Optional[MegatronGradScaler],
        init_state_fn: Optional[Callable],
        model_chunks: List[torch.nn.Module],
        per_model_buffers: Optional[Dict[int, list]] = None,
        data_parallel_group: Optional[dist.ProcessGroup] = None,
        data_parallel_group_gloo: Optional[dist.ProcessGroup] = None,
        data_parallel_group_idx: Optional[int] = None,
        distributed_optimizer_instance_id: int = 0,
    ) -> None:
        if distributed_optimizer_instance_id != 0:
            raise NotImplementedError(
                f"distributed_optimizer_instance_id={distributed_optimizer_instance_id}: one "
                "distributed-optimizer instance is supported; expected 0"
            )
        _check_chunks(model_chunks)
        self.model_chunks = list(model_chunks)
        if data_parallel_group is None:
            data_parallel_group = self.model_chunks[0].dp_cp_group
        self.data_parallel_group = data_parallel_group
        shard_of = _shards(self.model_chunks)
        # one record per shard, per param group; the model parameters are kept in group order
        self.model_param_groups: List[List[torch.nn.Parameter]] = []
        self.shard_groups: List[List[Shard]] = []
        for group in optimizer.param_groups:
            shards = [shard_of[p] for p in group["params"] if p in shard_of]
            self.model_param_groups.append(list(group["params"]))
            self.shard_groups.append(shards)
            group["params"] = [s.main for s in shards]
        optimizer.state.clear()
        # index maps, built once: model parameters in group order, shards in optimizer order
        self.model_params = [p for params in self.model_param_groups for p in params]
        self.shards = [s for shards in self.shard_groups for s in shards]
        self._model_index = {p: i for i, p in enumerate(self.model_params)}
        self._shard_of = {s.param: s for s in self.shards}
        self._shard_position = {s.param: j for j, s in enumerate(self.shards)}
        super().__init__(optimizer, config, grad_scaler, init_state_fn or init_optimizer_state)
        if not self.shards:  # the loss-scale tensors live with the model
            self._device = _first_param_device(self.model_chunks)
            self.found_inf = torch.zeros(1, dtype=torch.float, device=self._device)
            self._scale_one = torch.ones(1, dtype=torch.float, device=self._device)

    # ------------------------------------------------------------------ step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the shards' ``.grad`` (DDP's ``zero_grad_buffer`` clears ``main_grad``)."""
        for shard in self.shards:
            shard.main.grad = None

    def _main_grads(self) -> List[torch.Tensor]:
        return [s.main.grad for s in self.shards if s.main.grad is not None]

    def _copy_model_grads_to_main_grads(self) -> None:
        for shard in self.shards:
            grad = shard.grad_flat()
            shard.main.grad = grad if grad.dtype == torch.float32 else grad.float()

    def _copy_main_params_to_model_params(self) -> None:
        for shard in self.shards:
            target = shard.model_flat()
            if target.data_ptr() != shard.main.data_ptr():
                target.copy_(shard.main)

    def _grad_stats_groups(self) -> List[Optional[dist.ProcessGroup]]:
        """The data-parallel group (the shards), then the model-parallel group."""
        return [self.data_parallel_group, self.get_grad_stats_parallel_group()]

    def _expert_grad_stats_groups(self) -> List[Optional[dist.ProcessGroup]]:
        """The expert-data-parallel group (the expert buffers' shards), then expert
        tp x ep x pp: each expert element lies in one rank's shard of one expert shard."""
        return [self._expert_data_parallel_group(), *super()._expert_grad_stats_groups()]

    def _expert_data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """The group the expert buffers are sharded over (``expert_data_parallel_group`` set
        by ``get_megatron_optimizer``, else the chunks' ``expt_dp_group``, else the MPU
        fallback); every chunk holding experts must use that same group."""
        group = getattr(self, "expert_data_parallel_group", None)
        chunk_groups = {
            id(chunk.expt_dp_group): chunk.expt_dp_group
            for chunk in self.model_chunks
            if getattr(chunk, "expt_dp_group", None) is not None
        }
        if group is None and chunk_groups:
            group = next(iter(chunk_groups.values()))
        group = resolve_group("expt_dp", group)
        if any(other is not group for other in chunk_groups.values()):
            raise ValueError(
                "DistributedOptimizer: the model chunks shard their expert buffers over a group "
                "other than the optimizer's expert-data-parallel group (pg_collection.expt_dp); "
                "expected the same group in DistributedDataParallel and get_megatron_optimizer"
            )
        return group

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Step the shards, write them into the parameter buffers, all-gather."""
        super().step_with_ready_grads()
        for chunk in self.model_chunks:
            chunk.start_param_sync()
        return True

    def reload_model_params(self, state_dict=None) -> None:
        """Main shards from the model parameters (after loading weights into the model)."""
        if state_dict is not None:
            raise NotImplementedError("reload_model_params(state_dict=...) is not supported")
        for chunk in self.model_chunks:
            chunk.finish_param_sync()
        for shard in self.shards:
            source = shard.model_flat()
            if source.data_ptr() != shard.main.data_ptr():
                shard.main.copy_(source)

    # ------------------------------------------------------------------ checkpoints

    def sharded_state_dict(
        self,
        model_sharded_state_dict: Dict[str, Any],
        is_loading: bool = False,
        sharding_type: Optional[str] = None,
        metadata: Optional[dict] = None,
    ) -> Dict[str, Any]:
        """This rank's shards for ``dist_checkpointing``, in the boxes the non-distributed
        optimizer stores (``optimizer.state.<name>.<key>``, fp32 main parameters as
        ``optimizer.state.fp32_param.<key>``, the shared step as ``state["common_step"]``),
        each a ``ShardedTensor`` with ``flattened_range``: nothing is gathered. Reshards to any
        DP size and to and from the non-distributed optimizer. ``is_loading``: create empty
        state first (``init_state_fn``). ``sharding_type``: None or
        "fully_sharded_model_space" (both mean this format)."""
        if sharding_type not in (None, "fully_sharded_model_space"):
            raise NotImplementedError(
                f"DistributedOptimizer.sharded_state_dict: sharding_type={sharding_type!r}; "
                "expected None or 'fully_sharded_model_space' (state stored per parameter)"
            )
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        pieces = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.model_params)
        state: Dict[Any, Dict[str, Any]] = {}
        for i, param in enumerate(self.model_params):
            shard = self._shard_of.get(param)
            if shard is None:
                continue
            values = {
                name: value
                for name, value in self.optimizer.state[shard.main].items()
                if name != "step"
            }
            if values:
                state[i] = {
                    name: _flat_pieces(pieces[i], shard, value, f"optimizer.state.{name}")
                    for name, value in values.items()
                }
        step = self._common_step()
        if step is not None:
            state["common_step"] = step
        groups = [
            {
                **_hyper(group),
                "params": LocalNonpersistentObject([self._model_index[p] for p in params]),
            }
            for group, params in zip(self.optimizer.param_groups, self.model_param_groups)
        ]
        optim = {"state": state, "param_groups": groups}
        if not self._mixed:
            optim[SHARD_LAYOUT_KEY] = LocalNonpersistentObject(FLAT_SHARDS)
            return optim
        out: Dict[str, Any] = {"optimizer": optim}
        if self.grad_scaler is not None:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        out["fp32_from_fp16_params"] = [
            [
                _flat_pieces(
                    pieces[self._model_index[p]],
                    self._shard_of[p],
                    self._shard_of[p].main,
                    "optimizer.state.fp32_param",
                )
                for p in params
                if _is_half(p) and p in self._shard_of
            ]
            for params in self.model_param_groups
        ]
        out[SHARD_LAYOUT_KEY] = LocalNonpersistentObject(FLAT_SHARDS)
        return out

    def state_dict(self) -> Dict:
        """The non-distributed optimizer's format, whole tensors per parameter (each state
        tensor all-gathered over the buffer's group): torch's ``state_dict`` over the model
        parameters (indices in parameter-group order), and for bf16/fp16 ``{"optimizer":
        ..., "grad_scaler": ..., "fp32_from_fp16_params": ...}``. Collective."""
        for chunk in self.model_chunks:
            chunk.finish_param_sync()
        names = sorted({n for st in self.optimizer.state.values() for n in st if n != "step"})
        names = sorted({n for ns in all_gather_object(names, self.data_parallel_group) for n in ns})
        full = {name: self._gather_whole(name) for name in names}
        step = self._common_step()
        state: Dict[int, Dict[str, Any]] = {}
        if names:
            for i, param in enumerate(self.model_params):
                state[i] = {name: full[name][param] for name in names}
                if step is not None:
                    state[i]["step"] = step.clone()
        groups = [
            {**_hyper(group), "params": [self._model_index[p] for p in params]}
            for group, params in zip(self.optimizer.param_groups, self.model_param_groups)
        ]
        optim = {"state": state, "param_groups": groups}
        if not self._mixed:
            return optim
        fp32 = self._gather_whole("fp32_param")
        out: Dict[str, Any] = {"optimizer": optim}
        if self.grad_scaler is not None:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        out["fp32_from_fp16_params"] = [
            [fp32[p] for p in params if _is_half(p)] for params in self.model_param_groups
        ]
        return out

    def load_state_dict(self, state_dict: Dict) -> None:
        """Load ``sharded_state_dict``'s request after ``dist_checkpointing.load`` (this
        rank's flat shards, saved by either optimizer at any DP size) or the non-distributed
        format (``state_dict()``: whole tensors, of which each rank keeps its ranges)."""
        flat = state_dict.get(SHARD_LAYOUT_KEY) == FLAT_SHARDS
        optim = state_dict["optimizer"] if "optimizer" in state_dict else state_dict
        restore_common_step(optim)
        state: Dict[int, Dict[str, Any]] = {}
        for i, param in enumerate(self.model_params):
            saved = optim["state"].get(i)
            shard = self._shard_of.get(param)
            if saved is None or shard is None:
                continue
            current = self.optimizer.state.get(shard.main, {})
            state[self._shard_position[param]] = {
                name: (
                    value
                    if name == "step"
                    else _own_range(value, shard, flat, name, current.get(name))
                )
                for name, value in saved.items()
            }
        groups, offset = [], 0
        for saved, current in zip(optim["param_groups"], self.optimizer.param_groups):
            count = len(current["params"])
            groups.append({**_hyper(saved), "params": list(range(offset, offset + count))})
            offset += count
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        saved_fp32 = state_dict.get("fp32_from_fp16_params")
        if saved_fp32 is not None and "optimizer" in state_dict:
            for params, values in zip(self.model_param_groups, saved_fp32):
                halves = [p for p in params if _is_half(p) and (p in self._shard_of or not flat)]
                for param, value in zip(halves, values):
                    shard = self._shard_of.get(param)
                    if shard is not None:
                        loaded = _own_range(value, shard, flat, "fp32_param", shard.main)
                        if loaded.data_ptr() != shard.main.data_ptr():
                            shard.main.copy_(loaded)
        elif self._mixed:
            self.reload_model_params()
        self._copy_main_params_to_model_params()
        for chunk in self.model_chunks:
            chunk.start_param_sync(force_sync=True)

    @property
    def _mixed(self) -> bool:
        return bool(self.config.bf16 or self.config.fp16)

    def _gather_whole(self, name: str) -> Dict[torch.nn.Parameter, torch.Tensor]:
        """{parameter: its whole fp32 state tensor ``name``} ("fp32_param": the main
        parameter), assembled bucket by bucket from every rank's shard (an all-gather over the
        buffer's group per bucket)."""
        out: Dict[torch.nn.Parameter, torch.Tensor] = {}
        for chunk in self.model_chunks:
            for buffer in chunk.buffers:
                group = buffer.data_parallel_group
                size, rank = get_pg_size(group), get_pg_rank(group)
                for bucket in buffer.buckets:
                    lo, hi = bucket.shard_range(rank, size)
                    local = torch.zeros(hi - lo, dtype=torch.float32, device=self._device)
                    for param in bucket.params:
                        shard = self._shard_of.get(param)
                        if shard is None:
                            continue
                        value = shard.main if name == "fp32_param" else self.state[shard.main][name]
                        begin = buffer.param_ranges[param][0] + shard.start - lo
                        local[begin : begin + shard.size].copy_(value)
                    whole = all_gather_along_first_dim(local, group)
                    for param in bucket.params:
                        start, end = buffer.param_ranges[param]
                        flat = whole[start - bucket.start : end - bucket.start]
                        out[param] = flat.view(param.shape).clone()
        return out

    def _common_step(self) -> Optional[torch.Tensor]:
        """Adam's step (shared by all shards; the largest over the group, None before any)."""
        steps = [st["step"] for st in self.optimizer.state.values() if "step" in st]
        local = max((float(s) for s in steps), default=-1.0)
        value = torch.tensor(
            [local], dtype=torch.float64, device=comm_device(self.data_parallel_group)
        )
        all_reduce_(value, self.data_parallel_group, dist.ReduceOp.MAX)
        if value.item() < 0:
            return None
        return torch.tensor(value.item(), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------


def _check_chunks(model_chunks: List[torch.nn.Module]) -> None:
    """Every chunk is a DDP built for the distributed optimizer, all over one group."""
    if not model_chunks:
        raise ValueError("DistributedOptimizer: model_chunks is empty")
    for index, chunk in enumerate(model_chunks):
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or not hasattr(chunk, "buffers"):
            raise TypeError(
                f"DistributedOptimizer: model chunk {index} ({type(chunk).__name__}) is not "
                "wrapped in DistributedDataParallel; expected DDP chunks built with "
                "DistributedDataParallelConfig(use_distributed_optimizer=True)"
            )
        if not ddp_config.use_distributed_optimizer:
            raise ValueError(
                "OptimizerConfig.use_distributed_optimizer=True but model chunk "
                f"{index} was wrapped with DistributedDataParallelConfig("
                "use_distributed_optimizer=False); expected both True"
            )
    groups = {id(chunk.dp_cp_group) for chunk in model_chunks}
    if len(groups) != 1:
        raise ValueError("DistributedOptimizer: the model chunks reduce over different groups")


def _shards(model_chunks: List[torch.nn.Module]) -> Dict[torch.nn.Parameter, Shard]:
    """This rank's shard of every parameter that has elements in its pieces of the buckets
    (each buffer cut over its own data-parallel group)."""
    shards: Dict[torch.nn.Parameter, Shard] = {}
    for chunk in model_chunks:
        for buffer in chunk.buffers:
            group = buffer.data_parallel_group
            size, rank = get_pg_size(group), get_pg_rank(group)
            for bucket in buffer.buckets:
                lo, hi = bucket.shard_range(rank, size)
                for param in bucket.params:
                    start, end = buffer.param_ranges[param]
                    a, b = max(start, lo), min(end, hi)
                    if a < b:
                        main = make_main_shard(param, a - start, b - start)
                        shards[param] = Shard(param, a - start, b - start, buffer, main)
    return shards


def _flat_pieces(model_piece, shard: Shard, value: torch.Tensor, prefix: str) -> Dict[str, Any]:
    """``value`` (this rank's flat shard of a per-parameter tensor) stored in the boxes of the
    parameter's model piece under ``prefix.<key>``: one ``ShardedTensor`` with
    ``flattened_range`` per box the shard meets (a factory's boxes found by building it over
    a meta tensor). Every data-parallel rank writes its own range, so the data-parallel
    component of the replica id (the last, by this package's convention) is 0."""
    if isinstance(model_piece, ShardedTensorFactory):
        meta = torch.empty(shard.param.shape, dtype=value.dtype, device="meta")
        built = model_piece.build_fn(model_piece.key, meta, model_piece.replica_id, None)
        boxes = list(built.values()) if isinstance(built, dict) else list(built)
    else:
        boxes = [model_piece]
    out: Dict[str, Any] = {}
    for index, box in enumerate(boxes):
        data = box.data
        if not isinstance(box, ShardedTensor) or not _is_contiguous_view(data):
            raise NotImplementedError(
                f"{prefix}.{model_piece.key}: the model piece is not made of contiguous boxes of "
                "the parameter; the distributed optimizer cannot store flat ranges of it"
            )
        lo = data.storage_offset() if data.device.type == "meta" else 0
        a, b = max(lo, shard.start), min(lo + data.numel(), shard.end)
        if a >= b:
            continue
        out[str(index)] = ShardedTensor(
            f"{prefix}.{box.key}",
            value[a - shard.start : b - shard.start],
            value.dtype,
            box.local_shape,
            box.global_shape,
            box.global_offset,
            box.axis_fragmentations,
            _without_dp(box.replica_id),
            box.prepend_axis_num,
            box.allow_shape_mismatch,
            flattened_range=slice(a - lo, b - lo),
        )
    return out


def _own_range(
    value: Any, shard: Shard, flat: bool, name: str, current: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """This rank's elements of a loaded state entry: already them (``flat``: the pieces of
    ``_flat_pieces`` in order; ``current`` itself when they were read into it in place, as
    ``dist_checkpointing.load`` does) or a copy of a whole per-parameter tensor's range."""
    if flat:
        parts = [value[k] for k in sorted(value, key=int)] if isinstance(value, dict) else [value]
        parts = [torch.as_tensor(p).reshape(-1) for p in parts]
        if current is not None and _tile(parts, current):
            return current
        data = torch.cat(parts)
    else:
        data = value.data if isinstance(value, torch.nn.Parameter) else value
        data = data.reshape(-1)[shard.start : shard.end].clone()
    if data.numel() != shard.size:
        raise ValueError(
            f"DistributedOptimizer.load_state_dict: state {name!r} of a parameter of shape "
            f"{tuple(shard.param.shape)} has {data.numel()} elements for this rank's shard "
            f"[{shard.start}, {shard.end}); expected {shard.size}"
        )
    return data


def _tile(parts: List[torch.Tensor], whole: torch.Tensor) -> bool:
    """Whether ``parts`` are consecutive views covering ``whole`` exactly (1-D, same dtype)."""
    if whole.dim() != 1 or not whole.is_contiguous():
        return False
    pointer, step = whole.data_ptr(), whole.element_size()
    for part in parts:
        if part.dtype != whole.dtype or part.data_ptr() != pointer:
            return False
        pointer += part.numel() * step
    return pointer == whole.data_ptr() + whole.numel() * step


def _is_contiguous_view(data: torch.Tensor) -> bool:
    return data is not None and data.is_contiguous()


def _without_dp(replica_id):
    """The replica id with its data-parallel component (the last) 0."""
    if isinstance(replica_id, int):
        return 0
    return tuple(replica_id[:-1]) + (0,)


def _hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _is_half(param: torch.Tensor) -> bool:
    return param.dtype in HALF_DTYPES


def _first_param_device(model_chunks: List[torch.nn.Module]) -> torch.device:
    for chunk in model_chunks:
        for param in chunk.parameters():
            return param.device
    return comm_device(None)


def shard_ranges_of(optimizer: DistributedOptimizer) -> List[Tuple[torch.nn.Parameter, int, int]]:
    """``(parameter, start, end)`` of every shard this rank owns (for tests and tools)."""
    return [(s.param, s.start, s.end) for s in optimizer.shards]
