"""The local-spec normalization: torch's LayerNorm or RMSNorm, chosen by the config."""

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


class WrappedTorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` per ``config.normalization``.

    LayerNorm: y = (x - mean) / sqrt(var + eps) * weight + bias; RMSNorm:
    y = x / sqrt(mean(x^2) + eps) * weight. Under sequence parallelism the norm runs on the
    sequence-sharded activations; GPTModel marks its parameters ``sequence_parallel`` so their
    gradients are summed over the TP group (megatron-core's local spec rejects SP here).
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
        for name in ("layernorm_zero_centered_gamma", "persist_layer_norm"):
            if getattr(config, name, False):
                raise NotImplementedError(
                    f"WrappedTorchNorm: config.{name}=True is not supported by torch norms"
                )
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(
                f"config.normalization must be 'LayerNorm' or 'RMSNorm', got "
                f"{config.normalization!r}"
            )
        return norms[config.normalization](
            normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype
        )
