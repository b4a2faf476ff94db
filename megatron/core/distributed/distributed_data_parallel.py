"""DistributedDataParallel: gradients accumulate in contiguous buffers and are reduced over
the data-parallel x context-parallel group in buckets (all-reduced, or reduce-scattered into
each rank's shard for the distributed optimizer, which then all-gathers the parameters)."""

import contextlib
import weakref
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron.core.communication import broadcast_
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)
from megatron.core.distributed.param_and_grad_buffer import (
    GradBucket,
    GradBuffer,
    gather_bucket_params,
    reduce_bucket,
    wait_bucket,
    wait_param_gather,
)
from megatron.core.process_groups_config import ProcessGroupCollection, get_pg_size, resolve_group
from megatron.core.transformer.transformer_config import TransformerConfig


class DistributedDataParallel(torch.nn.Module):
    """Wraps a model chunk; each parameter's gradient is added into ``param.main_grad`` (a
    view of one contiguous buffer per dtype) and freed.

    After ``finish_grad_sync`` every ``main_grad`` holds ``(1/(D*C)) * sum over dp_cp`` of
    the local gradients (SUM of pre-scaled grads, or AVG with ``average_in_collective``),
    or the plain sum in per-token mode (``config.calculate_per_token_loss``), where
    ``finalize_model_grads`` divides by the token count. Group: ``pg_collection.dp_cp``, else
    ``parallel_state``'s dp x cp group (MPU fallback), else none (one process).

    ``use_distributed_optimizer``: the same scaling, but each bucket is reduce-scattered, so
    only this rank's shard of it holds the reduced sum (``param_and_grad_buffer``); the
    parameters live in a contiguous buffer that ``start_param_sync`` all-gathers after the
    optimizer step. With ``overlap_param_gather`` that gather is asynchronous and a forward
    pre-hook on each module waits for the buckets of its parameters, so the next forward
    overlaps with the gathers of later buckets.
    """

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__()
        self.config, self.ddp_config, self.module = config, ddp_config, module
        _reject_unsupported(ddp_config)
        self.dp_cp_group = _dp_cp_group(pg_collection)
        dp_cp_size = get_pg_size(self.dp_cp_group)
        if config.calculate_per_token_loss and ddp_config.average_in_collective:
            raise ValueError(
                "average_in_collective=True cannot be combined with calculate_per_token_loss="
                "True: per-token mode sums gradients and divides by the global token count"
            )
        self.average = ddp_config.average_in_collective
        per_token_or_avg = config.calculate_per_token_loss or self.average
        self.pre_scale = 1.0 if per_token_or_avg else 1.0 / dp_cp_size
        bucket_size = ddp_config.bucket_size
        if bucket_size is None:
            bucket_size = max(40_000_000, 1_000_000 * dp_cp_size)
        if disable_bucketing or not ddp_config.overlap_grad_reduce:
            bucket_size = None
        self.shard_size = dp_cp_size if ddp_config.use_distributed_optimizer else None
        dense = [p for p in module.parameters() if p.requires_grad and _is_dense(p)]
        experts = [p for p in module.parameters() if p.requires_grad and not _is_dense(p)]
        self.buffers = _make_buffers(
            dense,
            ddp_config.grad_reduce_in_fp32,
            bucket_size,
            self.shard_size,
            self.dp_cp_group,
            self.pre_scale,
        )
        self.expt_dp_group = None
        if experts:
            # Expert parameters (allreduce=False): their own buffers, reduced (and, with the
            # distributed optimizer, sharded) over expert DP with the dense factor: summed
            # over expert DP and divided by D * C like every other gradient (AVG over expert
            # DP divides by its own size, hence expt_dp / (D * C) with average_in_collective).
            self.expt_dp_group = expert_data_parallel_group(pg_collection, config, dp_cp_size)
            expt_size = get_pg_size(self.expt_dp_group)
            expert_scale = expt_size / dp_cp_size if self.average else self.pre_scale
            self.buffers += _make_buffers(
                experts,
                ddp_config.grad_reduce_in_fp32,
                bucket_size,
                expt_size if ddp_config.use_distributed_optimizer else None,
                self.expt_dp_group,
                expert_scale,
            )
        self.param_to_bucket: Dict[torch.nn.Parameter, GradBucket] = {}
        for buffer in self.buffers:
            self.param_to_bucket.update(buffer.param_to_bucket)
        self.param_names = {p: n for n, p in module.named_parameters()}
        self.is_last_microbatch = True
        on_grad = _weak_method(self._on_grad)
        self._hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in self.param_to_bucket]
        self._param_gather_hooks: list = []
        if ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather:
            self.enable_forward_pre_hook()

    def forward(self, *args, **kwargs):
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (all but the last microbatch)."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def start_grad_sync(self, *unused) -> None:
        """Launch the reduction of every bucket not launched yet (asynchronous with
        ``overlap_grad_reduce``)."""
        for bucket in self.param_to_bucket.values():
            if not bucket.launched:
                self._launch(bucket)

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False) -> None:
        """Finish the reduction of all buckets; afterwards ``main_grad`` is reduced."""
        for bucket in self._buckets():
            if not bucket.launched:
                self._launch(bucket)
            wait_bucket(bucket)
            bucket.reset()

    def start_param_sync(
        self, *unused, force_sync: bool = False, force_dispatch: bool = False
    ) -> None:
        """All-gather the updated parameter shards (distributed optimizer; a no-op
        otherwise): asynchronously with ``overlap_param_gather`` (the forward pre-hooks wait),
        synchronously without it or with ``force_sync``. Buckets are dispatched in the order
        the forward uses them (the last bucket first)."""
        if not self.ddp_config.use_distributed_optimizer:
            return
        overlap = self.ddp_config.overlap_param_gather and not force_sync
        for bucket in reversed(self._buckets()):
            wait_param_gather(bucket)
            gather_bucket_params(bucket, bucket.buffer.data_parallel_group, async_op=overlap)
            if not overlap:
                wait_param_gather(bucket)

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight."""
        for bucket in self._buckets():
            wait_param_gather(bucket)

    def enable_forward_pre_hook(self) -> None:
        """Register the forward pre-hooks that wait for a module's parameter gathers."""
        if self._param_gather_hooks:
            return
        for module in self.module.modules():
            if any(p in self.param_to_bucket for p in module.parameters(recurse=False)):
                self._param_gather_hooks.append(
                    module.register_forward_pre_hook(self._wait_for_params)
                )

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Remove the forward pre-hooks; ``param_sync``: finish the gathers now."""
        for handle in self._param_gather_hooks:
            handle.remove()
        self._param_gather_hooks = []
        if param_sync:
            self.finish_param_sync()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every ``main_grad`` by ``scaling_factor``."""
        for buffer in self.buffers:
            buffer.data.mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` and forget bucket state (start of an iteration)."""
        for buffer in self.buffers:
            buffer.data.zero_()
        for bucket in self._buckets():
            bucket.reset()
        for param in self.param_to_bucket:
            param.grad = None

    def broadcast_params(self) -> None:
        """Copy parameters from the first rank of the dp x cp group to the others (expert
        parameters: of the expert data-parallel group)."""
        for group, dense in ((self.dp_cp_group, True), (self.expt_dp_group, False)):
            if get_pg_size(group) == 1:
                continue
            for param in self.module.parameters():
                if _is_dense(param) == dense:
                    broadcast_(param.data, group, src=0)

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict (parameter gathers in flight finished first)."""
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load into the wrapped module."""
        return self.module.load_state_dict(state_dict, strict=strict)

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        """Move a fresh ``param.grad`` into ``main_grad`` (unless a fused GEMM already added
        it); with overlap, launch a bucket's reduction once all its parameters have their
        last-microbatch gradient."""
        if getattr(param, "grad_added_to_main_grad", False):  # gradient_accumulation_fusion
            param.grad_added_to_main_grad = False
            param.grad = None  # a placeholder: the GEMM already added into main_grad
        elif param.grad is not None:
            param.main_grad.add_(param.grad)
            param.grad = None
        if self.ddp_config.overlap_grad_reduce and self.is_last_microbatch:
            bucket = self.param_to_bucket[param]
            bucket.ready.add(param)
            if len(bucket.ready) == len(bucket.params) and not bucket.launched:
                self._launch(bucket)

    def _wait_for_params(self, module: torch.nn.Module, args) -> None:
        """Forward pre-hook: the gathers of the buckets holding ``module``'s parameters."""
        for param in module.parameters(recurse=False):
            bucket = self.param_to_bucket.get(param)
            if bucket is not None and bucket.gather_handle is not None:
                wait_param_gather(bucket)

    def _launch(self, bucket: GradBucket) -> None:
        """Check (optionally) and start reducing one bucket."""
        if self.ddp_config.check_for_nan_in_grad:
            self._check_finite(bucket)
        reduce_bucket(
            bucket,
            bucket.buffer.data_parallel_group,
            bucket.buffer.gradient_scaling_factor,
            self.average,
            async_op=self.ddp_config.overlap_grad_reduce,
            scatter=self.ddp_config.use_distributed_optimizer,
        )

    def _check_finite(self, bucket: GradBucket) -> None:
        """Raise naming the first parameter whose local gradient has a NaN or inf."""
        if bool(torch.isfinite(bucket.grad_data).all()):
            return
        for param in bucket.params:
            if not bool(torch.isfinite(param.main_grad).all()):
                kind = "NaN" if bool(torch.isnan(param.main_grad).any()) else "inf"
                rank = dist.get_rank() if dist.is_initialized() else 0
                raise RuntimeError(
                    f"Rank {rank}: found {kind} in the local gradient of parameter "
                    f"{self.param_names.get(param, '<unnamed>')!r} (shape "
                    f"{tuple(param.shape)}) before the data-parallel reduction "
                    "(check_for_nan_in_grad=True)"
                )

    def _buckets(self) -> List[GradBucket]:
        """All buckets of all buffers."""
        return [bucket for buffer in self.buffers for bucket in buffer.buckets]


def expert_data_parallel_group(
    pg_collection: Optional[ProcessGroupCollection], config, dp_cp_size: int
) -> Optional[dist.ProcessGroup]:
    """The group expert gradients are summed over: ``pg_collection.expt_dp``, else
    ``parallel_state``'s expert data-parallel group (MPU fallback). It holds the ranks with
    the same expert shard, whose tokens together are all of a pipeline stage's tokens."""
    group = resolve_group("expt_dp", pg_collection=pg_collection)
    if group is None and (dp_cp_size > 1 or config.tensor_model_parallel_size > 1):
        raise ValueError(
            "DistributedDataParallel: the model has expert parameters but pg_collection has "
            "no expt_dp group (the expert data-parallel group); pass pg_collection.expt_dp"
        )
    return group


def _is_dense(param: torch.nn.Parameter) -> bool:
    """Reduced over dp x cp (``allreduce`` unset or True); expert parameters have
    ``allreduce = False`` and are reduced over expert DP."""
    return getattr(param, "allreduce", True)


def _make_buffers(
    params: List[torch.nn.Parameter],
    grad_reduce_in_fp32: bool,
    bucket_size,
    shard_size: Optional[int],
    group: Optional[dist.ProcessGroup],
    pre_scale: float,
) -> List[GradBuffer]:
    """One buffer per gradient dtype (fp32 when ``grad_reduce_in_fp32``), and with the
    distributed optimizer (``shard_size``) per parameter dtype as well (a parameter buffer
    holds one dtype); each reduces over ``group`` with ``pre_scale``.

    Expert parameters (``param.allreduce = False``) get buffers of their own (the caller
    passes them apart) with the expert-data-parallel group, its size as ``shard_size`` and
    the dense scaling factor; the reduction and the distributed optimizer follow each
    buffer's ``data_parallel_group``."""
    by_dtype: Dict[tuple, List[torch.nn.Parameter]] = {}
    for param in params:
        dtype = torch.float32 if grad_reduce_in_fp32 else param.dtype
        key = (dtype, param.dtype if shard_size is not None else None)
        by_dtype.setdefault(key, []).append(param)
    return [
        GradBuffer(params, dtype, bucket_size, shard_size, group, pre_scale)
        for (dtype, _), params in by_dtype.items()
    ]


def _dp_cp_group(pg_collection: Optional[ProcessGroupCollection]):
    """The gradient-reduction group: ``resolve_group("dp_cp", ...)``, refusing a collection
    without it and a multi-rank run without any."""
    if pg_collection is not None:
        if pg_collection.dp_cp is None:
            raise ValueError(
                "DistributedDataParallel: pg_collection has no dp_cp group; expected the "
                f"data-parallel x context-parallel group, got {pg_collection!r}"
            )
        return pg_collection.dp_cp
    group = resolve_group("dp_cp")
    if group is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "DistributedDataParallel: torch.distributed has several ranks but neither "
            "pg_collection nor parallel_state gives the data-parallel group"
        )
    return group


def _reject_unsupported(ddp_config: DistributedDataParallelConfig) -> None:
    """Fail loudly for features this core does not implement and settings that need each
    other (Megatron-LM's argument checks, named by their config fields)."""
    if ddp_config.overlap_param_gather and not ddp_config.use_distributed_optimizer:
        raise ValueError(
            "DistributedDataParallelConfig: overlap_param_gather=True needs "
            "use_distributed_optimizer=True (--overlap-param-gather only supported with "
            "distributed optimizer); got use_distributed_optimizer=False"
        )
    if ddp_config.num_distributed_optimizer_instances != 1:
        raise NotImplementedError(
            "num_distributed_optimizer_instances="
            f"{ddp_config.num_distributed_optimizer_instances} is not supported by this core; "
            "expected 1"
        )


def _weak_method(method):
    """``method`` called through a weak reference to its object. torch keeps a tensor's
    post-accumulate-grad hooks where the garbage collector cannot see them (torch 2.13), so
    a hook holding the DDP wrapper would keep the wrapper, its module and its process groups
    alive until the interpreter exits (where gloo's threads then meet a half-finalized
    interpreter); through a weak reference the wrapper is freed like any module."""
    ref = weakref.WeakMethod(method)

    def hook(param: torch.nn.Parameter) -> None:
        bound = ref()
        if bound is not None:
            bound(param)

    return hook
