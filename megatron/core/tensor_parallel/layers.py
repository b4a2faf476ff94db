"""Tensor-parallel linear and embedding layers.

* ``ColumnParallelLinear``: Y = X A^T + b with A [out, in] split along ``out`` (rows of A):
  rank r holds A_r [out/T, in] and computes Y_r = X A_r^T + b_r.
* ``RowParallelLinear``: Y = X A^T + b with A split along ``in``: rank r holds A_r
  [out, in/T], computes X_r A_r^T and the partial products are summed over the group.
* ``VocabParallelEmbedding``: the table [V, h] split along V; each rank looks up the ids it
  owns (zeros elsewhere) and the results are summed over the group.

Sequence parallelism (``config.sequence_parallel``): activations between TP regions are split
along the sequence (dim 0, [s/T, b, h]). A column-parallel layer all-gathers its input along
dim 0 in the forward and reduce-scatters the input gradient; a row-parallel layer
reduce-scatters its output along dim 0. Its bias is then replicated but fed sequence-sharded
gradients, so it carries ``param.sequence_parallel = True`` and ``finalize_model_grads`` sums
its gradient over the TP group.

Initialization is layout-independent: every rank builds the FULL weight with ``init_method``
(in float32, on CPU, from the default CPU generator, which callers seed identically on all
TP ranks) and keeps its own slice, whatever ``config.use_cpu_initialization`` says (megatron's
``use_cpu_initialization`` path, always). A TP shard is therefore the slice of the same full
tensor for every TP size. ``partition_stride`` k > 1 slices the full tensor into T*k blocks
and gives rank r the blocks r, r+T, ... (e.g. k = 2 for a fused [gate; up] SwiGLU weight).

Groups: ``tp_group=`` wins; ``None`` is the MPU fallback of
``process_groups_config.resolve_group("tp", ...)`` (``parallel_state``'s TP group when
initialized, else one rank). The group is resolved once at construction and is the only
group the layer's collectives (``megatron.core.communication``) use.
"""

import warnings
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron.core.communication import (
    all_gather_along_first_dim,
    start_all_gather_along_first_dim,
    start_all_reduce,
    start_reduce_scatter_along_first_dim,
)
from megatron.core.device import comm_device
from megatron.core.fp8.cache import init_weight_cache
from megatron.core.fp8.linear import Fp8Gemm, fp8_linear, fp8_weight_operands
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.process_groups_config import get_pg_rank, get_pg_size, resolve_group
from megatron.core.tensor_parallel.grad_accumulation_fusion import (
    accumulate_weight_grad,
    require_main_grad,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.utils import VocabUtility, strided_shard

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}


def param_is_not_tensor_parallel_duplicate(param, tp_group=None) -> bool:
    """True for a TP-sharded parameter, and for a replicated one on TP rank 0 only (so that a
    sum over all ranks counts every replicated parameter once). ``tp_group=None``: MPU
    fallback."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    return get_pg_rank(resolve_group("tp", tp_group)) == 0


def set_tensor_model_parallel_attributes(tensor, is_parallel, dim, stride) -> None:
    """Mark ``tensor`` with ``tensor_model_parallel``, ``partition_dim``, ``partition_stride``
    (an error if it already has them)."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise RuntimeError(
                f"set_tensor_model_parallel_attributes: the tensor already has {attribute!r} "
                f"= {getattr(tensor, attribute)!r}"
            )
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor) -> None:
    """Give ``tensor`` the replicated defaults (False, -1, 1) for attributes it lacks."""
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(destination_tensor, source_tensor) -> None:
    """Copy the tensor-parallel attributes ``source_tensor`` has onto ``destination_tensor``."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: Optional[List[torch.Tensor]] = None,
    wgrad_deferral_limit: Optional[int] = 0,
    async_grad_allreduce: Optional[bool] = None,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> torch.Tensor:
    """Y = X W^T + b with the tensor-parallel communication of the input gradient.

    * ``sequence_parallel``: X is this rank's [s/T, ...] block; it is all-gathered along
      dim 0 (forward, and again in the backward for dL/dW) and dL/dX is reduce-scattered.
    * ``allreduce_dgrad``: dL/dX is summed over the group (overlapped with the dL/dW GEMM on
      GPUs). Both may not be set at once.
    * ``gradient_accumulation_fusion``: dL/dW = g^T X is added into ``weight.main_grad``.

    ``grad_output_buffer`` (deferred embedding wgrad) is not supported; ``wgrad_deferral_limit``
    and the deprecated ``async_grad_allreduce`` are ignored. ``tp_group=None``: MPU fallback.
    """
    if grad_output_buffer is not None:
        raise NotImplementedError(
            "linear_with_grad_accumulation_and_async_allreduce: grad_output_buffer (deferred "
            "weight-gradient computation) is not supported; expected None"
        )
    if allreduce_dgrad and sequence_parallel:
        raise ValueError(
            "linear_with_grad_accumulation_and_async_allreduce: allreduce_dgrad and "
            "sequence_parallel cannot both be True"
        )
    group = resolve_group("tp", tp_group)
    flags = _linear_flags(
        weight, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, group
    )
    return LinearWithGradAccumulationAndAsyncCommunication.apply(input, weight, bias, *flags, group)


def _linear_flags(
    weight: torch.Tensor,
    fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    group: Optional[torch.distributed.ProcessGroup],
) -> Tuple[bool, bool, bool]:
    """(fusion, allreduce_dgrad, sequence_parallel) as a linear runs them, in high precision
    or FP8: no communication on a group of one rank, and the weight gradient added into
    ``weight.main_grad`` (checked to exist) only where a weight gradient is computed."""
    if get_pg_size(group) == 1:
        allreduce_dgrad = sequence_parallel = False
    fusion = bool(fusion and torch.is_grad_enabled() and weight.requires_grad)
    if fusion:
        require_main_grad(weight)
    return fusion, allreduce_dgrad, sequence_parallel


# megatron-core's public signature, the parameters of the function above (reordered): it
# delegates to it.
def linear_with_frozen_weight(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    tp_group: Optional[torch.distributed.ProcessGroup],
    grad_output_buffer: Optional[List[torch.Tensor]] = None,
    wgrad_deferral_limit: None = None,
    async_grad_allreduce: Optional[bool] = None,
) -> torch.Tensor:
    """``linear_with_grad_accumulation_and_async_allreduce`` for a weight that takes no
    gradient (the same function skips dL/dW when ``weight.requires_grad`` is False)."""
    return linear_with_grad_accumulation_and_async_allreduce(
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer=grad_output_buffer,
        tp_group=tp_group,
    )


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """Autograd of ``linear_with_grad_accumulation_and_async_allreduce``.

    Backward: dL/dX = g W (all-reduced, or reduce-scattered along dim 0 under sequence
    parallelism), dL/dW = g^T X_full (into ``main_grad`` with fusion), dL/db = sum of g.
    A frozen weight (``requires_grad=False``) gets no weight gradient.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, fusion, allreduce_dgrad, sequence_parallel, group):
        """Y = X_full W^T + b, X_full = all-gather of X along dim 0 under SP, else X."""
        ctx.save_for_backward(input, weight)
        ctx.has_bias = bias is not None
        ctx.fusion, ctx.group = fusion, group
        ctx.allreduce_dgrad, ctx.sequence_parallel = allreduce_dgrad, sequence_parallel
        total_input = all_gather_along_first_dim(input, group) if sequence_parallel else input
        return F.linear(total_input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        """dL/dX, dL/dW, dL/db (see the class docstring). On GPUs the communication overlaps
        the GEMMs: the SP re-gather of X with the dL/dX GEMM, and the dL/dX all-reduce or
        reduce-scatter with the dL/dW GEMM."""
        input, weight = ctx.saved_tensors
        group = ctx.group
        wgrad = ctx.needs_input_grad[1]
        gather = None
        if ctx.sequence_parallel and wgrad:
            gather = start_all_gather_along_first_dim(input, group)
        # as one 2-D GEMM: a gradient with other strides (a compiled region's output can have
        # a size-1 batch dimension of any stride) made matmul a batched GEMV, 150 ms for a
        # LoRA adapter's [8192, 2048] x [2048, 8] on an H200
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_2d.matmul(weight).view(*grad_output.shape[:-1], weight.shape[-1])
        total_input = gather.wait() if gather is not None else input

        pending = None  # grad_input is ours: it may be reduced in place
        if ctx.allreduce_dgrad:
            pending = start_all_reduce(grad_input, group, overwrite_input=True)
        elif ctx.sequence_parallel:
            pending = start_reduce_scatter_along_first_dim(grad_input, group, overwrite_input=True)

        grad_weight = grad_bias = None
        if wgrad:
            input_2d = total_input.reshape(-1, total_input.shape[-1])
            if ctx.fusion:
                accumulate_weight_grad(weight.main_grad, grad_2d, input_2d)
                weight.grad_added_to_main_grad = True
                grad_weight = torch.empty_like(weight)  # fires DDP's hook; never read
            else:
                grad_weight = grad_2d.t().matmul(input_2d)
        if ctx.has_bias:
            grad_bias = grad_2d.sum(dim=0)
        if pending is not None:
            grad_input = pending.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None


class _ParallelLinear(torch.nn.Module):
    """What the column- and row-parallel layers share: sizes, config, TP group, the
    expert flags (always False here), the product through
    ``linear_with_grad_accumulation_and_async_allreduce``, no extra state and the repr."""

    def __init__(
        self,
        layer: str,
        input_size: int,
        output_size: int,
        config: ModelParallelConfig,
        is_expert: bool,
        tp_group: Optional[torch.distributed.ProcessGroup],
    ) -> None:
        super().__init__()
        _reject_expert(layer, is_expert)
        self.input_size, self.output_size = input_size, output_size
        self.config = config
        self.is_expert = False
        self.expert_parallel = False
        self.explicit_expert_comm = False
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.tp_group = resolve_group("tp", tp_group)
        # FP8 GEMMs with ``config.fp8`` (``megatron.core.fp8``); None keeps this layer in
        # high precision (the output layer, LoRA adapters)
        self.fp8_gemm: Optional[Fp8Gemm] = Fp8Gemm.from_config(config)
        if self.fp8_gemm is not None:
            init_weight_cache(self)  # the FP8 weight kept across microbatches (fp8.cache)
        _register_extra_state_default(self)

    def _new_weight(
        self, partition_dim: int, init_method: Callable, stride: int, keep_master: bool
    ) -> Parameter:
        """The weight shard: [output_size, input_size] split along ``partition_dim`` over the
        group (``allreduce`` True), this rank's slice of the full weight ``init_method``
        builds (``_initialize_from_full_weight``) when the config initializes; the full
        weight kept as ``master_weight`` with ``keep_master``."""
        size, rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        full_shape = (self.output_size, self.input_size)
        local_shape = list(full_shape)
        local_shape[partition_dim] //= size
        device = _param_device(self.config, self.tp_group)
        weight = Parameter(torch.empty(local_shape, device=device, dtype=self.config.params_dtype))
        set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
        if self.config.perform_initialization:
            master = _initialize_from_full_weight(
                weight, full_shape, partition_dim, init_method, stride, rank, size
            )
            if keep_master:
                self.master_weight = master
        weight.allreduce = True
        return weight

    def _linear(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        allreduce_dgrad: bool,
        sequence_parallel: bool,
    ) -> torch.Tensor:
        """X W^T [+ b] with this layer's group and weight-gradient fusion (in FP8 with
        ``fp8_gemm``)."""
        if self.fp8_gemm is not None:
            flags = _linear_flags(
                weight,
                self.gradient_accumulation_fusion,
                allreduce_dgrad,
                sequence_parallel,
                self.tp_group,
            )
            gemm, group = self.fp8_gemm, self.tp_group
            kept = fp8_weight_operands(self, weight, group, gemm)
            return fp8_linear(input_, weight, bias, flags, group, gemm, kept)
        return linear_with_grad_accumulation_and_async_allreduce(
            input_,
            weight,
            bias,
            self.gradient_accumulation_fusion,
            allreduce_dgrad,
            sequence_parallel,
            tp_group=self.tp_group,
        )

    def set_extra_state(self, state: Any) -> None:
        """Nothing to restore (megatron-core keeps an empty ``_extra_state`` entry)."""

    def get_extra_state(self) -> None:
        """No extra state (megatron-core keeps an empty ``_extra_state`` entry)."""
        return None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(in_features={self.input_size}, "
            f"out_features={self.output_size}, bias={self.bias is not None}, "
            f"TP={get_pg_size(self.tp_group)})"
        )


class ColumnParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A [output_size, input_size] split along its output rows.

    ``forward(input_)`` takes [s, b, input_size] ([s/T, b, input_size] under sequence
    parallelism) and returns ``(output, output_bias)``: output [s, b, output_size/T] (all
    of it with ``gather_output``); with ``skip_bias_add`` the bias is returned instead of
    added. ``skip_weight_param_allocation``: the weight is passed to ``forward`` (a tied
    output layer). Parameters: ``weight`` [out/T, in] and ``bias`` [out/T], both
    ``tensor_model_parallel`` with ``partition_dim`` 0.
    """

    def __init__(
        self,
        input_size,
        output_size,
        *,
        config: ModelParallelConfig,
        init_method: Callable,
        bias=True,
        gather_output=False,
        stride=1,
        keep_master_weight_for_test=False,
        skip_bias_add=False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: Optional[List[torch.Tensor]] = None,
        grad_output_buffer: Optional[List[torch.Tensor]] = None,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        disable_grad_reduce: bool = False,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
    ):
        super().__init__(
            "ColumnParallelLinear", input_size, output_size, config, is_expert, tp_group
        )
        if getattr(config, "defer_embedding_wgrad_compute", False):
            raise NotImplementedError(
                "ColumnParallelLinear: config.defer_embedding_wgrad_compute=True is not "
                "supported; expected False"
            )
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.disable_grad_reduce = disable_grad_reduce
        self.embedding_activation_buffer = embedding_activation_buffer
        self.grad_output_buffer = grad_output_buffer
        world_size = get_pg_size(self.tp_group)
        self.output_size_per_partition = _divide_arg(
            "ColumnParallelLinear", "output_size", output_size, world_size
        )
        device = _param_device(config, self.tp_group)

        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = self._new_weight(0, init_method, stride, keep_master_weight_for_test)

        if bias:
            self.bias = Parameter(
                torch.empty(
                    self.output_size_per_partition, device=device, dtype=config.params_dtype
                )
            )
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            if config.perform_initialization:
                with torch.no_grad():
                    self.bias.zero_()
            self.bias.allreduce = True
        else:
            self.register_parameter("bias", None)

        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and world_size <= 1:
            warnings.warn(
                "`sequence_parallel` is set to `True`, but tensor model parallel size is "
                f"{world_size}. Disabling sequence parallel.",
                stacklevel=2,
            )
            self.sequence_parallel = False
        self.allreduce_dgrad = (
            world_size > 1 and not self.sequence_parallel and not self.disable_grad_reduce
        )

    def forward(
        self,
        input_: torch.Tensor,
        weight: Optional[torch.Tensor] = None,
        runtime_gather_output: Optional[bool] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(Y_r = X A_r^T [+ b_r], bias or None); see the class docstring."""
        if weight is None:
            if self.weight is None:
                raise RuntimeError(
                    "ColumnParallelLinear.forward: weight was not supplied and the layer was "
                    "built with skip_weight_param_allocation=True"
                )
            weight = self.weight
        else:
            expected = (self.output_size_per_partition, self.input_size)
            if tuple(weight.shape) != expected:
                raise RuntimeError(
                    f"ColumnParallelLinear.forward: supplied weight's shape is "
                    f"{tuple(weight.shape)}, not {expected} as expected"
                )
        bias = self.bias if not self.skip_bias_add else None
        if self.allreduce_dgrad or self.sequence_parallel or self.disable_grad_reduce:
            input_parallel = input_
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        output_parallel = self._linear(
            input_parallel, weight, bias, self.allreduce_dgrad, self.sequence_parallel
        )
        gather_output = (
            self.gather_output if runtime_gather_output is None else runtime_gather_output
        )
        if gather_output:
            output = gather_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)

    def backward_dw(self) -> None:
        """No deferred weight gradient to compute (weight gradients are computed in the
        backward)."""


class RowParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A [output_size, input_size] split along its input columns.

    ``forward(input_)`` takes [s, b, input_size/T] (``input_is_parallel``; else the full
    input, which is scattered along its last dimension) and returns ``(output,
    output_bias)``: output [s, b, output_size] summed over the group, or its [s/T, b, ...]
    block of dim 0 under sequence parallelism (reduce-scatter). The bias is replicated, added
    after the reduction, and marked ``sequence_parallel`` under sequence parallelism.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str = None,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
    ):
        super().__init__("RowParallelLinear", input_size, output_size, config, is_expert, tp_group)
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and not self.input_is_parallel:
            raise RuntimeError(
                "RowParallelLinear: to enable sequence_parallel, input_is_parallel must be True "
                "(got input_is_parallel=False)"
            )
        world_size = get_pg_size(self.tp_group)
        self.input_size_per_partition = _divide_arg(
            "RowParallelLinear", "input_size", input_size, world_size
        )
        device = _param_device(config, self.tp_group)

        self.weight = self._new_weight(1, init_method, stride, keep_master_weight_for_test)

        if bias:
            self.bias = Parameter(
                torch.empty(output_size, device=device, dtype=config.params_dtype)
            )
            if config.perform_initialization:
                with torch.no_grad():
                    self.bias.zero_()
            self.bias.allreduce = True
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(sum over ranks of X_r A_r^T [+ b], bias or None); see the class docstring."""
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        output_parallel = self._linear(input_parallel, self.weight, None, False, False)
        if self.sequence_parallel:
            output_ = reduce_scatter_to_sequence_parallel_region(
                output_parallel, group=self.tp_group
            )
        else:
            output_ = reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        if self.skip_bias_add:
            return output_, self.bias
        output = output_ + self.bias if self.bias is not None else output_
        return output, None


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table [num_embeddings, embedding_dim] split along the vocabulary.

    ``forward(input_)`` maps ids [b, s] to [b, s, h]: rank r looks up the ids in its range
    [r V/T, (r+1) V/T) (zero rows for the others) and the results are summed over the group.
    With ``reduce_scatter_embeddings`` the output is transposed to [s, b, h] and
    reduce-scattered along s (sequence parallelism): [s/T, b, h].
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: Callable,
        reduce_scatter_embeddings: bool = False,
        config: ModelParallelConfig,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
    ):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.tp_group = resolve_group("tp", tp_group)
        world_size, rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        _divide_arg("VocabParallelEmbedding", "num_embeddings", num_embeddings, world_size)
        self.vocab_start_index, self.vocab_end_index = (
            VocabUtility.vocab_range_from_global_vocab_size(num_embeddings, rank, world_size)
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.deterministic_mode = getattr(config, "deterministic_mode", False)
        self.weight = Parameter(
            torch.empty(
                self.num_embeddings_per_partition,
                embedding_dim,
                device=_param_device(config, self.tp_group),
                dtype=config.params_dtype,
            )
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        if config.perform_initialization:
            _initialize_from_full_weight(
                self.weight, (num_embeddings, embedding_dim), 0, init_method, 1, rank, world_size
            )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Sum over ranks of the masked local lookup (see the class docstring)."""
        world_size = get_pg_size(self.tp_group)
        if world_size > 1:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        else:
            local_ids = input_
        if self.deterministic_mode:
            output_parallel = self.weight[local_ids]
        else:
            output_parallel = F.embedding(local_ids, self.weight)
        if world_size > 1:
            output_parallel = output_parallel.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)


# ---------------------------------------------------------------------------------------------


def _initialize_from_full_weight(
    weight: torch.Tensor,
    full_shape: Tuple[int, int],
    partition_dim: int,
    init_method: Callable,
    stride: int,
    rank: int,
    world_size: int,
) -> torch.Tensor:
    """Fill ``weight`` with this rank's slice of the full weight ``init_method`` builds.

    The full weight is made in float32 on CPU (default CPU generator), cut along
    ``partition_dim`` into ``world_size * stride`` equal blocks, and rank r keeps blocks
    r, r + T, r + 2T, ... concatenated. Returns the full weight (in the parameter dtype).
    """
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    master = master.to(dtype=weight.dtype)
    with torch.no_grad():
        weight.copy_(strided_shard(master, partition_dim, stride, world_size, rank))
    return master


def _param_device(config: ModelParallelConfig, group) -> torch.device:
    """CPU with ``use_cpu_initialization``; else the device of the TP group's backend
    (the current CUDA device for nccl, CPU for gloo or no distributed run)."""
    if config.use_cpu_initialization:
        return torch.device("cpu")
    return comm_device(group)


def _divide_arg(layer: str, name: str, value: int, world_size: int) -> int:
    """``value / world_size``, or a ValueError naming the layer, argument and value."""
    if value % world_size != 0:
        raise ValueError(
            f"{layer}: {name}={value} must be divisible by the tensor-parallel size "
            f"({world_size})"
        )
    return value // world_size


def _reject_expert(layer: str, is_expert: bool) -> None:
    """Expert (MoE) layers need expert-parallel groups this core does not implement."""
    if is_expert:
        raise NotImplementedError(
            f"{layer}: is_expert=True (mixture-of-experts layers) is not supported; "
            "expected False"
        )


def _register_extra_state_default(module: torch.nn.Module) -> None:
    """Loading a state dict without ``_extra_state`` keys works (they default to None)."""
    module._register_load_state_dict_pre_hook(
        lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state")
    )
