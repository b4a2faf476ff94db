"""Bias, dropout and residual add after attention and MLP: out = residual + dropout(x + b)."""

from typing import Callable, Optional, Tuple

import torch

from megatron.core.jit import jit_fuser


def _bias_dropout_add(
    x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, prob: float, training
) -> torch.Tensor:
    if bias is not None:
        x = x + bias
    if training and prob > 0:
        x = torch.nn.functional.dropout(x, p=prob, training=True)
    return residual + x


_fused_bias_dropout_add = jit_fuser(_bias_dropout_add)


def get_bias_dropout_add(training: bool, fused: bool) -> Callable:
    """``bias_dropout_add((x, bias), residual, prob) = residual + dropout(x + bias, prob)``.

    Dropout is applied only when ``training``. ``fused`` (``config.bias_dropout_fusion``):
    one compiled function (its dropout masks come from the compiled RNG, so they differ from
    the unfused ones; without dropout the result is the same).
    """
    function = _fused_bias_dropout_add if fused else _bias_dropout_add

    def bias_dropout_add(
        x_with_bias: Tuple[torch.Tensor, Optional[torch.Tensor]],
        residual: torch.Tensor,
        prob: float,
    ) -> torch.Tensor:
        x, bias = x_with_bias
        return function(x, bias, residual, prob, training)

    return bias_dropout_add
