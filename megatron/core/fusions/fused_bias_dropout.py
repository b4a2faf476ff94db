"""Bias, dropout and residual add after attention and MLP: out = residual + dropout(x + b)."""

from typing import Callable, Optional, Tuple

import torch


def get_bias_dropout_add(training: bool, fused: bool) -> Callable:
    """``bias_dropout_add((x, bias), residual, prob) = residual + dropout(x + bias, prob)``.

    Dropout is applied only when ``training``; ``fused`` is accepted (no fused kernel here:
    the unfused form is what torch compiles well).
    """

    def bias_dropout_add(
        x_with_bias: Tuple[torch.Tensor, Optional[torch.Tensor]],
        residual: torch.Tensor,
        prob: float,
    ) -> torch.Tensor:
        x, bias = x_with_bias
        if bias is not None:
            x = x + bias
        if training and prob > 0:
            x = torch.nn.functional.dropout(x, p=prob, training=True)
        return residual + x

    return bias_dropout_add
