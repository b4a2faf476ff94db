"""TEMPORARY one-rank stand-in for ``megatron.core.tensor_parallel`` (being written on the
tp-layers branch). Only tensor_model_parallel_size == 1; removed once that package lands."""

from typing import Callable

import torch
import torch.nn.functional as F

from megatron.core.transformer.grad_accumulation_fusion import (
    linear_with_grad_accumulation_fusion,
)


def _only_tp1(config) -> None:
    if config.tensor_model_parallel_size != 1 or config.sequence_parallel:
        raise NotImplementedError("tensor parallelism needs megatron.core.tensor_parallel")


def _linear(module, input_, weight, bias):
    if module.gradient_accumulation_fusion and torch.is_grad_enabled():
        return linear_with_grad_accumulation_fusion(input_, weight, bias)
    return F.linear(input_, weight, bias)


class ColumnParallelLinear(torch.nn.Module):
    def __init__(
        self,
        input_size,
        output_size,
        *,
        config,
        init_method: Callable,
        bias=True,
        gather_output=False,
        stride=1,
        keep_master_weight_for_test=False,
        skip_bias_add=False,
        skip_weight_param_allocation=False,
        embedding_activation_buffer=None,
        grad_output_buffer=None,
        is_expert=False,
        tp_comm_buffer_name=None,
        disable_grad_reduce=False,
        tp_group=None,
    ):
        super().__init__()
        _only_tp1(config)
        self.config, self.skip_bias_add = config, skip_bias_add
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        dtype = config.params_dtype
        self.weight = (
            None
            if skip_weight_param_allocation
            else torch.nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))
        )
        if self.weight is not None:
            self.weight.tensor_model_parallel, self.weight.partition_dim = True, 0
            self.weight.partition_stride = stride
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=dtype)) if bias else None
        if self.bias is not None:
            self.bias.tensor_model_parallel, self.bias.partition_dim = True, 0
            self.bias.partition_stride = stride

    def forward(self, input_, weight=None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        bias = None if self.skip_bias_add else self.bias
        return _linear(self, input_, weight, bias), (self.bias if self.skip_bias_add else None)


class RowParallelLinear(torch.nn.Module):
    def __init__(
        self,
        input_size,
        output_size,
        *,
        config,
        init_method,
        bias,
        input_is_parallel,
        skip_bias_add,
        stride=1,
        keep_master_weight_for_test=False,
        is_expert=False,
        tp_comm_buffer_name=None,
        tp_group=None,
    ):
        super().__init__()
        _only_tp1(config)
        self.config, self.skip_bias_add = config, skip_bias_add
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))
        self.weight.tensor_model_parallel, self.weight.partition_dim = True, 1
        self.weight.partition_stride = stride
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=dtype)) if bias else None

    def forward(self, input_):
        out = _linear(self, input_, self.weight, None)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


class VocabParallelEmbedding(torch.nn.Module):
    def __init__(
        self,
        num_embeddings,
        embedding_dim,
        *,
        init_method,
        reduce_scatter_embeddings=False,
        config,
        tp_group=None,
    ):
        super().__init__()
        _only_tp1(config)
        self.weight = torch.nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, dtype=config.params_dtype)
        )
        self.weight.tensor_model_parallel, self.weight.partition_dim = True, 0
        self.weight.partition_stride = 1

    def forward(self, input_):
        return F.embedding(input_, self.weight)


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
    shape = target.shape
    return F.cross_entropy(
        vocab_parallel_logits.reshape(-1, vocab_parallel_logits.shape[-1]),
        target.reshape(-1),
        reduction="none",
        label_smoothing=label_smoothing,
    ).view(shape)


def scatter_to_sequence_parallel_region(input_, group=None):
    return input_


def gather_from_sequence_parallel_region(
    input_,
    tensor_parallel_output_grad=True,
    group=None,
    output_split_sizes=None,
    use_global_buffer=False,
):
    return input_


def get_cuda_rng_tracker(*args, **kwargs):
    import contextlib

    class _Tracker:
        def fork(self, name="model-parallel-rng"):
            return contextlib.nullcontext()

    return _Tracker()
