"""Transformer shape and loss settings on top of the parallel configuration."""

from dataclasses import dataclass
from typing import Callable, Optional

from megatron.core.model_parallel_config import ModelParallelConfig


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Model sizes and the loss-normalization mode.

    ``calculate_per_token_loss=True`` trains ``sum(loss) / sum(tokens)`` over the global
    batch; the default trains the mean over microbatches of each microbatch's token mean.
    """

    num_layers: int = 0
    mtp_num_layers: Optional[int] = None
    hidden_size: int = 0
    num_attention_heads: int = 0
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    num_moe_experts: Optional[int] = None
    calculate_per_token_loss: bool = False
    init_method: Optional[Callable] = None
    init_method_std: float = 0.02

    def __post_init__(self) -> None:
        """Derive ffn and kv sizes; check head counts divide."""
        super().__post_init__()
        if self.num_attention_heads and self.num_attention_heads % self.tensor_model_parallel_size:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size})"
            )
        if self.num_moe_experts is not None:
            raise NotImplementedError("num_moe_experts is not supported by this core")
        if self.mtp_num_layers is not None:
            raise NotImplementedError("mtp_num_layers is not supported by this core")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None and self.num_attention_heads:
            self.kv_channels = self.hidden_size // self.num_attention_heads
