"""The stack of transformer layers one pipeline chunk owns, plus the final norm on the last
stage."""

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
    layers_per_virtual_stage,
)


class TransformerBlock(nn.Module):
    """Layers [offset, offset + L / (PP * V)) of the model; ``final_layernorm`` if
    ``post_process``."""

    def __init__(
        self,
        config: TransformerConfig,
        post_process: bool = True,
        vp_stage: Optional[int] = None,
        pp_rank: Optional[int] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        self.layers = nn.ModuleList(
            TransformerLayer(config, offset + i + 1, device=device, dtype=dtype)
            for i in range(count)
        )
        self.final_layernorm = (
            nn.LayerNorm(config.hidden_size, config.layernorm_epsilon, device=device, dtype=dtype)
            if post_process
            else None
        )

    def forward(
        self, hidden_states: torch.Tensor, cp_group: Optional[dist.ProcessGroup] = None
    ) -> torch.Tensor:
        """Run the layers (then the final norm) on [s_local, b, h]."""
        for layer in self.layers:
            hidden_states = layer(hidden_states, cp_group)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states


def get_num_layers_to_build(
    config: TransformerConfig, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> int:
    """Layers per model chunk: L / (PP * V), the same for every chunk.

    ``vp_stage`` and ``pp_rank`` are accepted for megatron-core compatibility.
    """
    return layers_per_virtual_stage(config)
