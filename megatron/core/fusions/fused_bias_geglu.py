"""GeGLU activations at megatron-core's module path: ``quick_gelu`` (GPT-OSS's expert
activation, x sigmoid(1.702 x)) and ``gated_unit``, the gated linear unit of the MLP and the
experts with megatron-core's ``glu_linear_offset`` and ``activation_func_clamp_value``."""

import torch


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


def gated_unit(config, hidden: torch.Tensor) -> torch.Tensor:
    """act(gate) * (up + glu_linear_offset) of ``hidden`` = [gate | up] (last dim), with gate
    clamped above and up on both sides at ``activation_func_clamp_value`` when set."""
    gate, up = hidden.chunk(2, dim=-1)
    clamp = config.activation_func_clamp_value
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        up = up.clamp(min=-clamp, max=clamp)
    if config.glu_linear_offset:
        up = up + config.glu_linear_offset
    return config.activation_func(gate) * up
