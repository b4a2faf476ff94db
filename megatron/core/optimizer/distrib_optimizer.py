"""The distributed optimizer (ZeRO-1): each data-parallel rank keeps fp32 main parameters and
optimizer state only for its shard of the contiguous gradient buffers.

Layout (``DistributedDataParallel(use_distributed_optimizer=True)``): every bucket of every
buffer is padded to a multiple of D (the dp x cp size) and cut into D equal pieces; rank r
owns piece r of each bucket. A parameter whose elements ``[a, b)`` fall in this rank's piece
gets a 1-D main tensor for exactly those elements:

* fp32 parameters: a view ``param.view(-1)[a:b]`` (stepped in place, nothing to copy back);
* bf16/fp16 parameters: an fp32 copy, written back into ``param.view(-1)[a:b]`` after the step.

``step()``: ``main.grad = main_grad.view(-1)[a:b]`` (the reduce-scattered shard, in fp32),
unscale and check for inf/nan (fp16), clip by the global norm, step ``torch.optim`` on the
shards, copy back, and all-gather the parameter buffers (``DDP.start_param_sync``:
asynchronously with ``overlap_param_gather``, the next forward's pre-hooks wait per bucket).

Gradient statistics count every element once: each element of the gradient lies in exactly
one rank's shard of its dp x cp group, so the sum over this rank's shards, over the dp x cp
group, then over the model-parallel group (tp x pp, TP duplicates and the tied embedding copy
filtered as in ``clip_grads``) is the whole model's sum:

    ||g||_p^p = sum_{mp} sum_{dp x cp} sum_{shards on this rank} ||g_shard||_p^p

Adam's update is elementwise, so the shards step exactly as the whole parameters would.
Checkpoints store the state per parameter, in the non-distributed optimizer's format (the
full-shape tensors ``optimizer.state.<name>.<parameter key>``, boxed like the parameters), so
a checkpoint reshards to any D and to and from the non-distributed optimizer. The cost: a
save or load assembles the whole state of this rank's model-parallel part, bucket by bucket
over dp x cp, for the duration of the save or load (megatron-core's flat-range format avoids
that transient; not implemented here).
"""

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.device import comm_device
from megatron.core.dist_checkpointing.optimizer import (
    extract_common_step,
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
    restore_common_step,
)
from megatron.core.optimizer.clip_grads import param_is_not_shared
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig

_COPIED_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared")


class ShardRange:
    """Parameter ``param``'s elements ``[start, end)`` (flattened) owned by this rank."""

    def __init__(self, param: torch.nn.Parameter, start: int, end: int) -> None:
        self.param, self.start, self.end = param, start, end

    @property
    def size(self) -> int:
        return self.end - self.start


class DistributedOptimizer(MixedPrecisionOptimizer):
    """A torch optimizer over this rank's shards (see the module docstring).

    ``optimizer``'s param groups hold model parameters on entry (their hyper-parameters
    are kept); they are replaced by the main shards. ``model_chunks`` are the DDP chunks
    (built with ``use_distributed_optimizer=True``), ``data_parallel_group`` the dp x cp group
    they reduce over. ``per_model_buffers``, ``data_parallel_group_gloo``,
    ``data_parallel_group_idx`` and ``distributed_optimizer_instance_id`` are megatron-core's
    parameters; only one optimizer instance (id 0) is supported.
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
        self.data_parallel_group = (
            data_parallel_group
            if data_parallel_group is not None
            else self.model_chunks[0].dp_cp_group
        )
        size = 1 if self.data_parallel_group is None else self.data_parallel_group.size()
        rank = 0 if self.data_parallel_group is None else self.data_parallel_group.rank()
        self._dp_size, self._dp_rank = size, rank
        ranges = _shard_ranges(self.model_chunks, rank, size)
        # the model parameters in the groups are replaced by their shards below
        self.model_param_groups: List[List[torch.nn.Parameter]] = []
        self.shard_groups: List[List[ShardRange]] = []
        self.main_groups: List[List[torch.Tensor]] = []
        for group in optimizer.param_groups:
            shards = [ranges[p] for p in group["params"] if p in ranges]
            self.model_param_groups.append(list(group["params"]))
            self.shard_groups.append(shards)
            self.main_groups.append([_main_shard(s) for s in shards])
            group["params"] = self.main_groups[-1]
        optimizer.state.clear()
        super().__init__(optimizer, config, grad_scaler, init_state_fn or (lambda *a: None))
        self._device = _first_param_device(self.model_chunks)
        self.found_inf = torch.zeros(1, dtype=torch.float, device=self._device)
        self._scale_one = torch.ones(1, dtype=torch.float, device=self._device)

    # ------------------------------------------------------------------ step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the shards' ``.grad`` (DDP's ``zero_grad_buffer`` clears ``main_grad``)."""
        for group in self.main_groups:
            for main in group:
                main.grad = None

    def _main_grads(self) -> List[torch.Tensor]:
        return [m.grad for group in self.main_groups for m in group if m.grad is not None]

    def _copy_model_grads_to_main_grads(self) -> None:
        for shards, mains in zip(self.shard_groups, self.main_groups):
            for shard, main in zip(shards, mains):
                grad = shard.param.main_grad.view(-1)[shard.start : shard.end]
                main.grad = grad if grad.dtype == main.dtype else grad.to(main.dtype)

    def _copy_main_params_to_model_params(self) -> None:
        for shards, mains in zip(self.shard_groups, self.main_groups):
            for shard, main in zip(shards, mains):
                target = shard.param.data.view(-1)[shard.start : shard.end]
                if target.data_ptr() != main.data_ptr():
                    target.copy_(main)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Step the shards, write them into the parameter buffers, all-gather."""
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        for chunk in self.model_chunks:
            chunk.start_param_sync()
        return True

    def reload_model_params(self, state_dict=None) -> None:
        """Main shards from the model parameters (after loading weights into the model)."""
        if state_dict is not None:
            raise NotImplementedError("reload_model_params(state_dict=...) is not supported")
        for chunk in self.model_chunks:
            chunk.finish_param_sync()
        for shards, mains in zip(self.shard_groups, self.main_groups):
            for shard, main in zip(shards, mains):
                source = shard.param.data.view(-1)[shard.start : shard.end]
                if source.data_ptr() != main.data_ptr():
                    main.copy_(source)

    # ------------------------------------------------------------------ statistics

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        """This rank's shard grads that count (not the tied copy, not a TP duplicate)."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        tp_group = self._tp_group()
        return [
            main.grad
            for group in self.main_groups
            for main in group
            if main.grad is not None
            and param_is_not_shared(main)
            and param_is_not_tensor_parallel_duplicate(main, tp_group)
        ]

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """The global 2-norm: shards summed over dp x cp, then over the model-parallel group."""
        grads = self.get_main_grads_for_grad_norm()
        device = comm_device(self.data_parallel_group)
        total = torch.zeros(1, dtype=torch.float64, device=device)
        if grads:
            norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float64) for g in grads]
            total += torch.stack(norms).pow(2).sum().to(device)
        self._reduce_stat(total)
        return math.sqrt(float(total.item()))

    @torch.no_grad()
    def count_zeros(self) -> float:
        """Zero gradient elements over the model, each element counted once."""
        total = torch.zeros(1, dtype=torch.float64, device=comm_device(self.data_parallel_group))
        for grad in self.get_main_grads_for_grad_norm():
            total += float(grad.numel() - torch.count_nonzero(grad).item())
        self._reduce_stat(total)
        return float(total.item())

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        """As the mixed-precision optimizer, but an inf/nan on any shard of the dp x cp group
        counts too (every rank then skips the step)."""
        grads = self._main_grads()
        self.found_inf = torch.zeros(1, dtype=torch.float, device=self._device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, self.found_inf, self.grad_scaler.inv_scale.to(self._device)
            )
        found = self.found_inf.to(comm_device(self.data_parallel_group))
        self._reduce_stat(found, dist.ReduceOp.MAX)
        return bool(found.item() > 0)

    def _reduce_stat(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """Reduce over the dp x cp group, then over the model-parallel group."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        for group in (self.data_parallel_group, self.get_grad_stats_parallel_group()):
            if group is not None and group.size() > 1:
                dist.all_reduce(tensor, op=op, group=group)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict:
        """The state in the non-distributed optimizer's format, per whole parameter (each
        state tensor all-gathered over the dp x cp group from the shards): torch's
        ``state_dict`` over the model parameters (indices in parameter-group order), and for
        bf16/fp16 ``{"optimizer": ..., "grad_scaler": ..., "fp32_from_fp16_params": ...}``,
        as ``Float16OptimizerWithFloat16Params`` writes it. Collective over dp x cp."""
        for chunk in self.model_chunks:
            chunk.finish_param_sync()
        model_params = [p for group in self.model_param_groups for p in group]
        index = {p: i for i, p in enumerate(model_params)}
        names = sorted({n for st in self.optimizer.state.values() for n in st if n != "step"})
        names = self._agree_on_names(names)
        full = {name: self._gather_full(name) for name in names}
        state: Dict[int, Dict[str, Any]] = {}
        step = self._common_step()
        for p in model_params:
            if names:
                state[index[p]] = {name: full[name][p] for name in names}
                if step is not None:
                    state[index[p]]["step"] = step.clone()
        groups = []
        for group, params in zip(self.optimizer.param_groups, self.model_param_groups):
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "params": [index[p] for p in params]})
        optim = {"state": state, "param_groups": groups}
        if not self._mixed:
            return optim
        fp32 = self._gather_full("fp32_param")
        out: Dict[str, Any] = {"optimizer": optim}
        if self.grad_scaler is not None:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        out["fp32_from_fp16_params"] = [
            [fp32[p] for p in params if _is_half(p)] for params in self.model_param_groups
        ]
        return out

    def sharded_state_dict(
        self,
        model_sharded_state_dict: Dict[str, Any],
        is_loading: bool = False,
        sharding_type: Optional[str] = None,
        metadata: Optional[dict] = None,
    ) -> Dict[str, Any]:
        """``state_dict()`` for ``dist_checkpointing``, exactly as the non-distributed
        optimizer writes it: Adam's moments stored like their parameters
        (``optimizer.state.<name>.<parameter key>``, same boxes and replica ids), fp32 main
        parameters as ``optimizer.state.fp32_param.<key>``, the shared step as
        ``state["common_step"]``. So a checkpoint reshards to any DP size and to and from the
        non-distributed optimizer. ``sharding_type`` is megatron-core's choice of format;
        None and "fully_sharded_model_space" (per-parameter tensors) are accepted."""
        if sharding_type not in (None, "fully_sharded_model_space"):
            raise NotImplementedError(
                f"DistributedOptimizer.sharded_state_dict: sharding_type={sharding_type!r}; "
                "expected None or 'fully_sharded_model_space' (state stored per parameter)"
            )
        if is_loading:
            _init_adam_state(self.optimizer)
        state_dict = self.state_dict()
        model_params = [p for group in self.model_param_groups for p in group]
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, model_params)
        optim = state_dict["optimizer"] if self._mixed else state_dict
        step = extract_common_step(optim)
        optim_state_to_sharding_state(optim, id_map, exclude_keys=("step",))
        if step is not None:
            optim["state"]["common_step"] = step
        if self._mixed:
            position = {id(p): i for i, p in enumerate(model_params)}
            state_dict["fp32_from_fp16_params"] = [
                [
                    make_sharded_optimizer_tensor(
                        id_map[position[id(p)]], value, prefix="optimizer.state.fp32_param"
                    )
                    for p, value in zip([q for q in params if _is_half(q)], saved)
                ]
                for params, saved in zip(
                    self.model_param_groups, state_dict["fp32_from_fp16_params"]
                )
            ]
        return state_dict

    def load_state_dict(self, state_dict: Dict) -> None:
        """Load the non-distributed format (``state_dict()``, or ``sharded_state_dict``
        after ``dist_checkpointing.load``, written by either optimizer at any DP size): each
        rank keeps its flat range of every per-parameter tensor."""
        optim = state_dict["optimizer"] if "optimizer" in state_dict else state_dict
        restore_common_step(optim)
        model_params = [p for group in self.model_param_groups for p in group]
        shard_of = {s.param: s for group in self.shard_groups for s in group}
        mains = [m for group in self.main_groups for m in group]
        shards = [s for group in self.shard_groups for s in group]
        position = {s.param: j for j, s in enumerate(shards)}
        state: Dict[int, Dict[str, Any]] = {}
        for i, param in enumerate(model_params):
            saved = optim["state"].get(i)
            if saved is None or param not in shard_of:
                continue
            s = shard_of[param]
            state[position[param]] = {
                name: value if name == "step" else _range_of(value, s).clone()
                for name, value in saved.items()
            }
        groups, offset = [], 0
        for saved, current in zip(optim["param_groups"], self.optimizer.param_groups):
            hyper = {k: v for k, v in saved.items() if k != "params"}
            groups.append({**hyper, "params": list(range(offset, offset + len(current["params"])))})
            offset += len(current["params"])
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        saved_fp32 = state_dict.get("fp32_from_fp16_params")
        if saved_fp32 is not None and "optimizer" in state_dict:
            for params, values in zip(self.model_param_groups, saved_fp32):
                for param, value in zip([q for q in params if _is_half(q)], values):
                    if param in shard_of:
                        mains[position[param]].copy_(_range_of(value, shard_of[param]))
        elif self._mixed:
            self.reload_model_params()
        self._copy_main_params_to_model_params()
        for chunk in self.model_chunks:
            chunk.start_param_sync(force_sync=True)

    @property
    def _mixed(self) -> bool:
        return bool(self.config.bf16 or self.config.fp16)

    def _gather_full(self, name: str) -> Dict[torch.nn.Parameter, torch.Tensor]:
        """{parameter: its whole fp32 state tensor ``name``} ("fp32_param": the main
        parameter), assembled bucket by bucket from every rank's shard (an all-gather over
        dp x cp per bucket)."""
        group, size = self.data_parallel_group, self._dp_size
        main_of = {
            s.param: (s, m)
            for shards, mains in zip(self.shard_groups, self.main_groups)
            for s, m in zip(shards, mains)
        }
        out: Dict[torch.nn.Parameter, torch.Tensor] = {}
        for chunk in self.model_chunks:
            for buffer in chunk.buffers:
                for bucket in buffer.buckets:
                    lo, hi = bucket.shard_range(self._dp_rank, size)
                    local = torch.zeros(hi - lo, dtype=torch.float32, device=self._device)
                    for param in bucket.params:
                        if param not in main_of:
                            continue
                        shard, main = main_of[param]
                        value = main if name == "fp32_param" else self.optimizer.state[main][name]
                        begin = buffer.param_ranges[param][0] + shard.start - lo
                        local[begin : begin + shard.size].copy_(value)
                    full = _all_gather_flat(local, group, size)
                    for param in bucket.params:
                        start, end = buffer.param_ranges[param]
                        flat = full[start - bucket.start : end - bucket.start]
                        out[param] = flat.view(param.shape).clone()
        return out

    def _agree_on_names(self, names: List[str]) -> List[str]:
        """The state names every rank gathers (a rank without shards has none)."""
        if not (dist.is_available() and dist.is_initialized()) or self._dp_size == 1:
            return names
        everyone: List[Any] = [None] * self._dp_size
        dist.all_gather_object(everyone, names, group=self.data_parallel_group)
        return sorted({n for ns in everyone for n in ns})

    def _common_step(self) -> Optional[torch.Tensor]:
        """Adam's step (shared by all shards; the largest over dp x cp, None before any)."""
        steps = [st["step"] for st in self.optimizer.state.values() if "step" in st]
        local = max((float(s) for s in steps), default=-1.0)
        value = torch.tensor(
            [local], dtype=torch.float64, device=comm_device(self.data_parallel_group)
        )
        if dist.is_available() and dist.is_initialized() and self._dp_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.data_parallel_group)
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


def _shard_ranges(
    model_chunks: List[torch.nn.Module], rank: int, size: int
) -> Dict[torch.nn.Parameter, ShardRange]:
    """This rank's flat element range of every parameter that has elements in its shards."""
    ranges: Dict[torch.nn.Parameter, ShardRange] = {}
    for chunk in model_chunks:
        for buffer in chunk.buffers:
            for bucket in buffer.buckets:
                lo, hi = bucket.shard_range(rank, size)
                for param in bucket.params:
                    start, end = buffer.param_ranges[param]
                    a, b = max(start, lo), min(end, hi)
                    if a < b:
                        ranges[param] = ShardRange(param, a - start, b - start)
    return ranges


def _main_shard(shard: ShardRange) -> torch.Tensor:
    """The fp32 tensor the torch optimizer steps for ``shard`` (a view for fp32 params)."""
    flat = shard.param.detach().view(-1)[shard.start : shard.end]
    main = flat if flat.dtype == torch.float32 else flat.clone().float()
    for attr in _COPIED_ATTRIBUTES:
        if hasattr(shard.param, attr):
            setattr(main, attr, getattr(shard.param, attr))
    return main


def _is_half(param: torch.Tensor) -> bool:
    return param.dtype in (torch.float16, torch.bfloat16)


def _range_of(value: torch.Tensor, shard: ShardRange) -> torch.Tensor:
    """Elements ``[start, end)`` of a whole per-parameter tensor, flattened."""
    data = value.data if isinstance(value, torch.nn.Parameter) else value
    return data.reshape(-1)[shard.start : shard.end]


def _all_gather_flat(local: torch.Tensor, group: Optional[dist.ProcessGroup], size: int):
    """Every rank's ``local`` (equal sizes) concatenated in rank order."""
    if group is None or size == 1:
        return local
    out = torch.empty(local.numel() * size, dtype=local.dtype, device=local.device)
    device = comm_device(group)
    if device.type == "cpu":
        dist.all_gather(list(out.chunk(size)), local, group=group)
        return out
    gathered = torch.empty(out.numel(), dtype=local.dtype, device=device)
    dist.all_gather_into_tensor(gathered, local.to(device), group=group)
    return gathered.to(local.device)


def _init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Empty Adam state (step 0, zero moments) so a checkpoint's state can load into it."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)


def _first_param_device(model_chunks: List[torch.nn.Module]) -> torch.device:
    for chunk in model_chunks:
        for param in chunk.parameters():
            return param.device
    return comm_device(None)


def shard_ranges_of(optimizer: DistributedOptimizer) -> List[Tuple[torch.nn.Parameter, int, int]]:
    """``(parameter, start, end)`` of every shard this rank owns (for tests and tools)."""
    return [(s.param, s.start, s.end) for group in optimizer.shard_groups for s in group]
