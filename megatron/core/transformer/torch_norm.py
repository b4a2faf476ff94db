"""The local-spec normalization: torch's LayerNorm or RMSNorm, chosen by the config."""

import torch

from megatron.core.fusions.fused_layer_norm import FusedLayerNorm, FusedRMSNorm
from megatron.core.transformer.transformer_config import TransformerConfig


class WrappedTorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` per ``config.normalization``.

    LayerNorm: y = (x - mean) / sqrt(var + eps) * weight + bias; RMSNorm:
    y = x / sqrt(mean(x^2) + eps) * weight; with ``config.persist_layer_norm`` the same
    module through one compiled function (``fusions.fused_layer_norm``). Under sequence
    parallelism the norm runs on the sequence-sharded activations; GPTModel marks its
    parameters ``sequence_parallel`` so their gradients are summed over the TP group
    (megatron-core's local spec rejects SP here).
    """

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise NotImplementedError(
                "WrappedTorchNorm: config.layernorm_zero_centered_gamma=True is not supported "
                "by torch norms"
            )
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.persist_layer_norm:
            norms = {"LayerNorm": FusedLayerNorm, "RMSNorm": FusedRMSNorm}
        if config.normalization not in norms:
            raise ValueError(
                f"config.normalization must be 'LayerNorm' or 'RMSNorm', got "
                f"{config.normalization!r}"
            )
        return norms[config.normalization](
            normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype
        )
