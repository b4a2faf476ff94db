"""A pre-norm transformer layer (attention and MLP, each with a residual), and where a
pipeline chunk's layers start in the global layer numbering."""

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.core import parallel_state
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.no_init import NoInitLinear
from megatron.core.transformer.transformer_config import TransformerConfig


class TransformerLayer(nn.Module):
    """x + attn(LN(x)), then x + MLP(LN(x)); hidden states are [s, b, h].

    ``layer_number`` is the 1-based global index of the layer (as in megatron-core).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.layer_number = layer_number
        eps = config.layernorm_epsilon
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps, device=device, dtype=dtype)
        self.self_attention = SelfAttention(config, device=device, dtype=dtype)
        self.pre_mlp_layernorm = nn.LayerNorm(config.hidden_size, eps, device=device, dtype=dtype)
        self.mlp = MLP(config, device=device, dtype=dtype)

    def forward(
        self, hidden_states: torch.Tensor, cp_group: Optional[dist.ProcessGroup] = None
    ) -> torch.Tensor:
        """One layer on [s_local, b, h]; ``cp_group`` is this step's CP group (None: C = 1)."""
        hidden_states = hidden_states + self.self_attention(
            self.input_layernorm(hidden_states), cp_group
        )
        return hidden_states + self.mlp(self.pre_mlp_layernorm(hidden_states))


class MLP(nn.Module):
    """Position-wise feed-forward block: linear_fc2(gelu(linear_fc1(x))).

    Sizes h -> ffn_hidden_size -> h.
    """

    def __init__(
        self,
        config: TransformerConfig,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        hidden, ffn = config.hidden_size, config.ffn_hidden_size
        fusion = config.gradient_accumulation_fusion
        linear = dict(device=device, dtype=dtype, gradient_accumulation_fusion=fusion)
        self.linear_fc1 = NoInitLinear(hidden, ffn, **linear)
        self.linear_fc2 = NoInitLinear(ffn, hidden, **linear)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """gelu MLP on the last dimension."""
        return self.linear_fc2(nn.functional.gelu(self.linear_fc1(hidden_states)))


def get_transformer_layer_offset(
    config: TransformerConfig, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> int:
    """Global index of the first layer of chunk ``vp_stage`` on pipeline rank ``pp_rank``.

    offset = (vp_stage * PP + pp_rank) * L / (PP * V). ``vp_stage=None`` means 0;
    ``pp_rank=None`` is the MPU fallback (``parallel_state``'s rank, or 0 uninitialized).
    """
    pipeline_size = config.pipeline_model_parallel_size
    virtual_size = config.virtual_pipeline_model_parallel_size or 1
    vp_stage = 0 if vp_stage is None else vp_stage
    if pp_rank is None:
        pp_rank = _mpu_pipeline_rank()
    if not 0 <= vp_stage < virtual_size:
        raise ValueError(
            f"vp_stage must be in [0, {virtual_size}) for virtual_pipeline_model_parallel_size="
            f"{config.virtual_pipeline_model_parallel_size}, got {vp_stage!r}"
        )
    if not 0 <= pp_rank < pipeline_size:
        raise ValueError(
            f"pp_rank must be in [0, {pipeline_size}) for pipeline_model_parallel_size="
            f"{pipeline_size}, got {pp_rank!r}"
        )
    return (vp_stage * pipeline_size + pp_rank) * layers_per_virtual_stage(config)


def layers_per_virtual_stage(config: TransformerConfig) -> int:
    """L / (PP * V), with a clear error when the layers do not split evenly."""
    stages = config.pipeline_model_parallel_size * (
        config.virtual_pipeline_model_parallel_size or 1
    )
    if config.num_layers < 1 or config.num_layers % stages != 0:
        raise ValueError(
            f"num_layers ({config.num_layers}) must be a positive multiple of "
            f"pipeline_model_parallel_size ({config.pipeline_model_parallel_size}) x "
            f"virtual_pipeline_model_parallel_size "
            f"({config.virtual_pipeline_model_parallel_size or 1}) = {stages}"
        )
    return config.num_layers // stages


def _mpu_pipeline_rank() -> int:
    """``parallel_state``'s pipeline rank when initialized, else 0."""
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_pipeline_model_parallel_rank()
    return 0
