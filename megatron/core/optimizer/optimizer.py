"""Megatron optimizers around a ``torch.optim`` optimizer.

``step()`` = prepare the gradients (``param.main_grad`` from DDP -> the fp32 ``.grad`` the
torch optimizer reads; unscale and check for inf/nan under fp16), clip by the global norm
(``clip_grads``), optionally count zeros, step the torch optimizer, and copy fp32 main
parameters back into bf16/fp16 model parameters. It returns megatron's
``(update_successful, grad_norm, num_zeros_in_grad)``.
"""

import math
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.communication import all_reduce_
from megatron.core.device import comm_device
from megatron.core.dist_checkpointing.optimizer import (
    extract_common_step,
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
    restore_common_step,
)
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros,
    grad_norm,
    param_is_not_shared,
)
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.main_params import (
    HALF_DTYPES,
    copy_main_params_to_model_params,
    copy_model_grads_to_main_grads,
    copy_model_params_to_main_params,
    make_main_param,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.process_groups_config import resolve_group


class MegatronOptimizer(ABC):
    """Base: a torch optimizer, the config and the groups gradient statistics reduce over.

    ``grad_stats_parallel_group`` (the model-parallel group, tp x pp) and ``tp_group`` are
    set by ``get_megatron_optimizer`` from its ``pg_collection``; when unset, the MPU
    fallback of ``resolve_group("mp")`` / ``resolve_group("tp")`` is used.

    Gradient statistics (norm, zero count, the inf/nan flag) are local sums over
    ``get_main_grads_for_grad_norm`` reduced by one hook, ``_reduce_grad_stats``, over
    ``_grad_stats_groups()``: the model-parallel group here; the distributed optimizer puts
    its data-parallel group first (each rank holds a shard of every gradient). Expert grads
    (``allreduce = False``, ``has_expert_params``) are a part of their own, reduced by
    ``_reduce_expert_grad_stats`` over ``_expert_grad_stats_groups()``: expert tp x ep x pp
    (``expert_grad_stats_parallel_group``) here, expert DP first in the distributed optimizer
    (its expert shards), as megatron-core's separate expert optimizer does; the norm is
    sqrt(dense^2 + expert^2), the zero count the sum, the inf/nan flag the max of both.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        init_state_fn: Callable = lambda x: None,
    ) -> None:
        self.optimizer = optimizer
        self.config = config
        self.init_state_fn = init_state_fn

    def get_parameters(self) -> List[torch.nn.Parameter]:
        """The parameters the torch optimizer updates (fp32 main copies where they exist)."""
        if self.optimizer is None:
            return []
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        """Grads counted in the norm: not None, not the tied copy, not a TP duplicate."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        tp_group = self._tp_group()
        return [
            p.grad
            for p in self.get_parameters()
            if p.grad is not None
            and getattr(p, "allreduce", True)
            and param_is_not_shared(p)
            and param_is_not_tensor_parallel_duplicate(p, tp_group)
        ]

    def get_expert_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        """Expert grads (``allreduce = False``): every expert shard is distinct within the
        expert model-parallel group (expert tp x ep x pp), so each counts once there; an fc2
        bias, whole on every expert-TP rank, counts on the rank that adds it
        (``expert_tp_duplicate`` on the others)."""
        return [
            p.grad
            for p in self.get_parameters()
            if p.grad is not None
            and not getattr(p, "allreduce", True)
            and not getattr(p, "expert_tp_duplicate", False)
        ]

    def get_grad_stats_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """The group norms and zero counts are summed over (model-parallel; MPU fallback)."""
        group = resolve_group("mp", getattr(self, "grad_stats_parallel_group", None))
        if group is None and dist.is_available() and dist.is_initialized():
            if dist.get_world_size() > 1:
                raise RuntimeError(
                    "the optimizer has no group to reduce gradient statistics over: pass "
                    "pg_collection (with mp and tp) to get_megatron_optimizer or call "
                    "parallel_state.initialize_model_parallel first"
                )
        return group

    def _tp_group(self) -> Optional[dist.ProcessGroup]:
        return resolve_group("tp", getattr(self, "tp_group", None))

    @abstractmethod
    def prepare_grads(self) -> bool:
        """Make the fp32 ``.grad`` of every optimizer parameter; True if inf/nan was found."""

    @abstractmethod
    def step_with_ready_grads(self) -> bool:
        """Step the torch optimizer and refresh the model parameters; True on success."""

    def _grad_stats_groups(self) -> List[Optional[dist.ProcessGroup]]:
        """The groups a local gradient statistic is reduced over, in order."""
        return [self.get_grad_stats_parallel_group()]

    def _reduce_grad_stats(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """``tensor`` (a local statistic) reduced in place by ``op`` over every group of
        ``_grad_stats_groups()``; returns it."""
        for group in self._grad_stats_groups():
            all_reduce_(tensor, group, op)
        return tensor

    def _grad_stats_device(self) -> torch.device:
        return comm_device(self._grad_stats_groups()[0])

    def _expert_grad_stats_groups(self) -> List[Optional[dist.ProcessGroup]]:
        """The groups the experts' part of a statistic is reduced over, in order: expert
        tp x ep x pp (``expert_grad_stats_parallel_group``; MPU fallback), where every expert
        shard is distinct (its expert-data-parallel replicas hold the same reduced gradient
        and are not summed). The distributed optimizer puts expert DP first."""
        return [resolve_group("tp_ep_pp", getattr(self, "expert_grad_stats_parallel_group", None))]

    def _reduce_expert_grad_stats(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """``tensor`` (the experts' local statistic) reduced in place by ``op`` over every
        group of ``_expert_grad_stats_groups()``; returns it."""
        for group in self._expert_grad_stats_groups():
            all_reduce_(tensor, group, op)
        return tensor

    def _expert_grad_stats_device(self) -> torch.device:
        return comm_device(self._expert_grad_stats_groups()[0])

    def _has_experts(self) -> bool:
        return bool(getattr(self, "has_expert_params", False))

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """The global gradient norm (rule 4 of SPEC section 12): the dense part reduced over
        ``_grad_stats_groups()``, the experts' over ``_expert_grad_stats_groups()``, each
        element counted once."""
        dense = grad_norm(
            self.get_main_grads_for_grad_norm(),
            2.0,
            self._reduce_grad_stats,
            self._grad_stats_device(),
        )
        if not self._has_experts():
            return dense
        expert = grad_norm(
            self.get_expert_main_grads_for_grad_norm(),
            2.0,
            self._reduce_expert_grad_stats,
            self._expert_grad_stats_device(),
        )
        return math.sqrt(dense**2 + expert**2)

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Compute the global norm, scale all grads by min(1, clip/(norm+1e-6)); the norm."""
        grad_norm = self.get_grad_norm()
        params = self.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, clip_grad, grad_norm)
        return grad_norm

    def count_zeros(self) -> float:
        """Zero gradient elements over the model, each counted once: the dense grads over
        ``_grad_stats_groups()``, the experts' over ``_expert_grad_stats_groups()``."""
        dense = count_zeros(
            self.get_main_grads_for_grad_norm(), self._reduce_grad_stats, self._grad_stats_device()
        )
        if not self._has_experts():
            return dense
        expert = count_zeros(
            self.get_expert_main_grads_for_grad_norm(),
            self._reduce_expert_grad_stats,
            self._expert_grad_stats_device(),
        )
        return dense + expert

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the ``.grad`` tensors (DDP's ``zero_grad_buffer`` clears ``main_grad``)."""

    @abstractmethod
    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale as a one-element tensor."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (use as ``config.grad_scale_func``)."""
        return self.get_loss_scale() * loss

    def reload_model_params(self, state_dict=None) -> None:
        """Refresh main parameters from the model parameters (after loading weights); fp32
        optimizers step the model parameters themselves, so there is nothing to do."""
        return None

    @abstractmethod
    def state_dict(self) -> Dict: ...

    @abstractmethod
    def load_state_dict(self, state_dict: Dict) -> None: ...

    def sharded_state_dict(
        self,
        model_sharded_state_dict: Dict[str, Any],
        is_loading: bool = False,
        metadata: Optional[dict] = None,
    ) -> Dict[str, Any]:
        """``state_dict()`` for ``dist_checkpointing``: Adam's moments (and fp32 main
        parameters, ``_shard_state``) stored like their model parameters
        (``optimizer.state.exp_avg.<key>``, ``optimizer.state.fp32_param.<key>``, same boxes),
        the shared step as ``state["common_step"]``. ``is_loading``: create empty state first
        (a fresh optimizer then has tensors to load into)."""
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        state_dict = self.state_dict()
        model_params = self._model_params_in_optimizer_order()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, model_params)
        self._shard_state(state_dict, id_map)
        return state_dict

    def _model_params_in_optimizer_order(self) -> List[torch.Tensor]:
        """The model parameter behind each optimizer parameter (here: the same)."""
        return self.get_parameters()

    def _shard_state(self, state_dict: Dict, id_map: Dict) -> None:
        """Replace the tensors of ``state_dict()`` by sharded ones (``id_map``: optimizer
        position -> the model parameter's sharded tensor)."""
        _shard_torch_optimizer_state(state_dict, id_map)

    @property
    def param_groups(self) -> List[dict]:
        return self.optimizer.param_groups if self.optimizer is not None else []

    @param_groups.setter
    def param_groups(self, value: List[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @abstractmethod
    def step(self) -> Tuple[bool, Optional[float], Optional[float]]: ...


class MixedPrecisionOptimizer(MegatronOptimizer):
    """Shared fp16/bf16 logic: optional loss scaling with an inf/nan check. The constructor
    (megatron-core's signature, which ``Float16OptimizerWithFloat16Params`` shares) ends with
    ``_init_main_params``, where a subclass builds its main parameters."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: Optional[MegatronGradScaler],
        init_state_fn: Callable,
    ) -> None:
        super().__init__(optimizer, config, init_state_fn)
        self.grad_scaler = grad_scaler
        if grad_scaler is None and config.fp16:
            raise ValueError("fp16=True needs a grad_scaler (loss scaling)")
        self._device = _params_device(optimizer)
        self.found_inf = torch.zeros(1, dtype=torch.float, device=self._device)
        self._scale_one = torch.ones(1, dtype=torch.float, device=self._device)
        self._init_main_params()

    def _init_main_params(self) -> None:
        """Set up the main parameters once the base is built (none here)."""

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        """g <- g / scale for every main grad; True if any is inf/nan on any rank of the
        model-parallel group (then every rank skips the step)."""
        grads = self._main_grads()
        self.found_inf = torch.zeros(1, dtype=torch.float, device=self._device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, self.found_inf, self.grad_scaler.inv_scale.to(self._device)
            )
        found = self._reduce_grad_stats(
            self.found_inf.to(self._grad_stats_device()), dist.ReduceOp.MAX
        )
        if self._has_experts():  # an expert's inf reaches the ranks of the other experts
            found = self._reduce_expert_grad_stats(
                found.to(self._expert_grad_stats_device()), dist.ReduceOp.MAX
            )
        return bool(found.item() > 0)

    @abstractmethod
    def _main_grads(self) -> List[torch.Tensor]: ...

    @abstractmethod
    def _copy_model_grads_to_main_grads(self) -> None: ...

    @abstractmethod
    def _copy_main_params_to_model_params(self) -> None: ...

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        self._copy_model_grads_to_main_grads()
        if self.grad_scaler is not None:
            found_inf = self._unscale_main_grads_and_check_for_nan()
            self.grad_scaler.update(found_inf)
            return found_inf
        return False

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        return True

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[float]]:
        if self.prepare_grads():
            return False, None, None
        grad_norm = 0.0
        if self.config.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else 0
        return self.step_with_ready_grads(), grad_norm, num_zeros


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """bf16/fp16 model parameters, fp32 main copies stepped by the torch optimizer.

    Each half-precision parameter ``p`` gets ``p.main_param`` (fp32, carrying ``p``'s tensor-
    parallel attributes and ``shared``), which replaces it in the optimizer's param groups;
    ``main_param.grad = p.main_grad.float()`` before the step, ``p <- main_param`` after
    (``main_params``: the bookkeeping, shared with other optimizers). fp32 model parameters
    are stepped directly.
    """

    def _init_main_params(self) -> None:
        """Replace each half-precision parameter by its fp32 main copy in the optimizer."""
        self.float16_groups: List[List[torch.nn.Parameter]] = []
        self.fp32_from_float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp32_groups: List[List[torch.nn.Parameter]] = []
        for group in self.optimizer.param_groups:
            half, main, full = [], [], []
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in HALF_DTYPES:
                    main_param = make_main_param(param)
                    group["params"][i] = main_param
                    if param in self.optimizer.state:
                        self.optimizer.state[main_param] = self.optimizer.state.pop(param)
                    half.append(param)
                    main.append(main_param)
                elif param.dtype == torch.float32:
                    full.append(param)
                else:
                    raise TypeError(
                        f"a parameter has dtype {param.dtype}; expected float32, float16 or "
                        "bfloat16"
                    )
            self.float16_groups.append(half)
            self.fp32_from_float16_groups.append(main)
            self.fp32_from_fp32_groups.append(full)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for groups in (
            self.float16_groups,
            self.fp32_from_float16_groups,
            self.fp32_from_fp32_groups,
        ):
            for group in groups:
                _zero_grad(group, set_to_none)

    def _main_grads(self) -> List[torch.Tensor]:
        return [
            p.grad
            for groups in (self.fp32_from_float16_groups, self.fp32_from_fp32_groups)
            for group in groups
            for p in group
            if p.grad is not None
        ]

    def _copy_model_grads_to_main_grads(self) -> None:
        for half_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            copy_model_grads_to_main_grads(half_group, main_group)
        for group in self.fp32_from_fp32_groups:
            for param in group:
                if hasattr(param, "main_grad"):
                    param.grad = param.main_grad

    def _copy_main_params_to_model_params(self) -> None:
        for half_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            copy_main_params_to_model_params(half_group, main_group)

    def reload_model_params(self, state_dict=None) -> None:
        if state_dict is not None:
            raise NotImplementedError("reload_model_params(state_dict=...) is not supported")
        for half_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            copy_model_params_to_main_params(half_group, main_group)

    def state_dict(self, is_loading: bool = False) -> Dict:
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        state = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        state["fp32_from_fp16_params"] = self.fp32_from_float16_groups
        return state

    def _shard_state(self, state_dict: Dict, id_map: Dict) -> None:
        """The fp32 main parameters stored in their model parameters' boxes too."""
        position = {id(p): i for i, p in enumerate(self.get_parameters())}
        state_dict["fp32_from_fp16_params"] = [
            [
                make_sharded_optimizer_tensor(
                    id_map[position[id(main)]], main, prefix="optimizer.state.fp32_param"
                )
                for main in group
            ]
            for group in self.fp32_from_float16_groups
        ]
        _shard_torch_optimizer_state(state_dict["optimizer"], id_map)

    def _model_params_in_optimizer_order(self) -> List[torch.Tensor]:
        """The model parameter behind each optimizer parameter (a main copy's half one)."""
        model_of = {
            id(main): half
            for halves, mains in zip(self.float16_groups, self.fp32_from_float16_groups)
            for half, main in zip(halves, mains)
        }
        return [model_of.get(id(p), p) for p in self.get_parameters()]

    def load_state_dict(self, state_dict: Dict) -> None:
        key = "optimizer" if "optimizer" in state_dict else "optimizer_state_dict"
        restore_common_step(state_dict[key])
        self.optimizer.load_state_dict(state_dict[key])
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        saved = state_dict.get("fp32_from_fp16_params")
        if saved is not None:
            for current_group, saved_group in zip(self.fp32_from_float16_groups, saved):
                for current, value in zip(current_group, saved_group):
                    current.data.copy_(value.data if hasattr(value, "data") else value)
        self._copy_main_params_to_model_params()


class FP32Optimizer(MegatronOptimizer):
    """fp32 parameters stepped directly; ``param.grad = param.main_grad`` before the step."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, init_state_fn: Callable
    ) -> None:
        super().__init__(optimizer, config, init_state_fn)
        self._scale = torch.ones(1, dtype=torch.float, device=_params_device(optimizer))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.optimizer.param_groups:
            _zero_grad(group["params"], set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if hasattr(param, "main_grad"):
                    param.grad = param.main_grad
        return False

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        return True

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[float]]:
        self.prepare_grads()
        grad_norm = None
        if self.config.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        return self.step_with_ready_grads(), grad_norm, num_zeros

    def state_dict(self) -> Dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict) -> None:
        restore_common_step(state_dict)
        self.optimizer.load_state_dict(state_dict)


class ChainedOptimizer(MegatronOptimizer):
    """Several optimizers stepped as one (``get_megatron_optimizer`` returns one of these,
    as megatron-core does); with a single optimizer it forwards everything to it."""

    def __init__(self, chained_optimizers: List[MegatronOptimizer]) -> None:
        self.chained_optimizers = chained_optimizers
        self.config = chained_optimizers[0].config if chained_optimizers else None
        self.model_chunks: List[Any] = []

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if len(self.chained_optimizers) != 1:
            raise AttributeError(
                f"ChainedOptimizer.optimizer: {len(self.chained_optimizers)} optimizers, "
                "expected exactly one"
            )
        return self.chained_optimizers[0].optimizer

    @property
    def param_groups(self) -> List[dict]:
        return [g for opt in self.chained_optimizers for g in opt.param_groups]

    @property
    def state(self):
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].state
        return [opt.state for opt in self.chained_optimizers]

    def get_parameters(self) -> List[torch.nn.Parameter]:
        return [p for opt in self.chained_optimizers for p in opt.get_parameters()]

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        return [g for opt in self.chained_optimizers for g in opt.get_main_grads_for_grad_norm()]

    def get_grad_stats_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.chained_optimizers[0].get_grad_stats_parallel_group()

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """The global norm: the one optimizer's (the distributed optimizer reduces over its
        shards), else over all optimizers' grads together."""
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].get_grad_norm()
        return super().get_grad_norm()

    def count_zeros(self) -> float:
        """Zero gradient elements over the model (each counted once)."""
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].count_zeros()
        return super().count_zeros()

    def _tp_group(self) -> Optional[dist.ProcessGroup]:
        return self.chained_optimizers[0]._tp_group()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.chained_optimizers:
            opt.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        if self.chained_optimizers:
            return self.chained_optimizers[0].get_loss_scale()
        return torch.ones(1, dtype=torch.float, device=comm_device(None))

    def reload_model_params(self, state_dict=None) -> None:
        for opt in self.chained_optimizers:
            opt.reload_model_params(state_dict)

    def state_dict(self) -> Any:
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].state_dict()
        return [opt.state_dict() for opt in self.chained_optimizers]

    def sharded_state_dict(
        self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False, **kwargs
    ) -> Any:
        """The chained optimizers' sharded state dicts (the one's, or {index: ...})."""
        parts = [
            opt.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
            for opt in self.chained_optimizers
        ]
        return parts[0] if len(parts) == 1 else dict(enumerate(parts))

    def load_state_dict(self, state_dict: Any) -> None:
        if len(self.chained_optimizers) == 1:
            self.chained_optimizers[0].load_state_dict(state_dict)
            return
        if len(state_dict) != len(self.chained_optimizers):
            raise ValueError(
                f"load_state_dict: {len(state_dict)} entries, expected "
                f"{len(self.chained_optimizers)}"
            )
        if isinstance(state_dict, dict):
            state_dict = [v for _, v in sorted(state_dict.items())]
        for opt, state in zip(self.chained_optimizers, state_dict):
            opt.load_state_dict(state)

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        found = False
        for opt in self.chained_optimizers:
            found |= opt.prepare_grads()
        return found

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        ok = True
        for opt in self.chained_optimizers:
            ok &= opt.step_with_ready_grads()
        return ok

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[float]]:
        """Prepare, always compute the global norm, clip when ``clip_grad > 0``, step."""
        if self.prepare_grads():
            return False, None, None
        grad_norm = self.get_grad_norm()
        if self.config.clip_grad > 0.0:
            params = self.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, self.config.clip_grad, grad_norm)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        return self.step_with_ready_grads(), grad_norm, num_zeros


def _shard_torch_optimizer_state(optim_state_dict: Dict, id_map: Dict) -> None:
    """A torch optimizer's state_dict made sharded in place (the shared step kept aside)."""
    step = extract_common_step(optim_state_dict)
    optim_state_to_sharding_state(optim_state_dict, id_map, exclude_keys=("step",))
    if step is not None:
        optim_state_dict["state"]["common_step"] = step


def _zero_grad(params: List[torch.Tensor], set_to_none: bool) -> None:
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()


def init_optimizer_state(
    opt: torch.optim.Optimizer, config: Optional[OptimizerConfig] = None
) -> None:
    """Create empty Adam state (step 0, zero moments) so a checkpoint's state can load into
    it (megatron's ``init_state_fn``; other optimizers are left as they are)."""
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p.data)
                state["exp_avg_sq"] = torch.zeros_like(p.data)


def _params_device(optimizer: Optional[torch.optim.Optimizer]) -> torch.device:
    """Where the loss-scale tensors live: with the parameters (the loss is there too)."""
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                return p.device
    return comm_device(None)
