"""Position-wise feed-forward block: fc1 (column-parallel), activation, fc2 (row-parallel).

Plain: act(x W1^T + b1) W2^T. Gated (``gated_linear_unit``; SwiGLU with ``F.silu``):
fc1 produces [gate | up] and the activation is act(gate) * up. ``bias_activation_fusion``:
the bias add and the activation in one compiled pass (SwiGLU or exact GELU). A TP rank
holds the matching slices of both halves (fc1 is split with stride 2), megatron-core's
layout.
"""

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_geglu import gated_unit
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.transformer.module import MegatronModule, output_projection, parallel_linear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import refuse_unsupported_arguments


@dataclass
class MLPSubmodules:
    """Specs of the MLP's parts."""

    linear_fc1: Union[ModuleSpec, type] = None
    activation_func: Union[ModuleSpec, type] = None
    linear_fc2: Union[ModuleSpec, type] = None


class MLP(MegatronModule):
    """h -> ffn_hidden_size -> h; returns (output, fc2 bias) with the bias not yet added."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__(config)
        if is_expert:
            raise NotImplementedError("MLP: is_expert=True (mixture of experts) is not supported")
        if submodules.activation_func is not None:
            raise NotImplementedError("MLP: an activation_func submodule is not supported")
        self.input_size = input_size if input_size is not None else config.hidden_size
        ffn = ffn_hidden_size if ffn_hidden_size is not None else config.ffn_hidden_size
        self.activation_func = config.activation_func
        if config.bias_activation_fusion:
            gated, act = config.gated_linear_unit, config.activation_func
            if not ((gated and act is F.silu) or (not gated and act is F.gelu)):
                raise ValueError(
                    "MLP: bias_activation_fusion=True fuses SwiGLU (gated_linear_unit with "
                    "activation_func F.silu) or GELU (F.gelu, not gated); got "
                    f"gated_linear_unit={gated}, activation_func={act!r}"
                )
            offset, clamp = config.glu_linear_offset, config.activation_func_clamp_value
            if gated and (offset or clamp is not None):
                raise ValueError(
                    "MLP: bias_activation_fusion=True fuses the plain SwiGLU; got "
                    f"glu_linear_offset={offset}, activation_func_clamp_value={clamp}"
                )
        self.linear_fc1 = parallel_linear(
            submodules.linear_fc1,
            self.input_size,
            2 * ffn if config.gated_linear_unit else ffn,
            config,
            tp_group,
            gather_output=False,
            bias=config.add_bias_linear,
            skip_bias_add=True,
            tp_comm_buffer_name="fc1",
            stride=2 if config.gated_linear_unit else 1,
        )
        self.linear_fc2 = output_projection(submodules.linear_fc2, ffn, config, "fc2", tp_group)

    def forward(
        self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """[s, b, h] -> (fc2 output [s, b, h], fc2 bias)."""
        refuse_unsupported_arguments("MLP", per_token_scale=per_token_scale)
        intermediate, bias = self.linear_fc1(hidden_states)
        if self.config.bias_activation_fusion:  # one compiled pass (fusions/)
            fused = bias_swiglu_impl if self.config.gated_linear_unit else bias_gelu_impl
            return self.linear_fc2(fused(intermediate, bias))
        if bias is not None:
            intermediate = intermediate + bias
        if self.config.gated_linear_unit:
            intermediate = gated_unit(self.config, intermediate)
        else:
            intermediate = self.activation_func(intermediate)
        return self.linear_fc2(intermediate)
