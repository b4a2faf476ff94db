"""The local-spec normalization: torch's LayerNorm or RMSNorm, chosen by the config; the
whole-projection q/k RMSNorm (OLMoE)."""

from typing import Optional

import torch

from megatron.core.fusions.fused_layer_norm import FusedLayerNorm, FusedRMSNorm
from megatron.core.process_groups_config import get_pg_size
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import all_reduce_with_summed_grad
from megatron.core.transformer.transformer_config import TransformerConfig


class WrappedTorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` per ``config.normalization``.

    LayerNorm: y = (x - mean) / sqrt(var + eps) * weight + bias; RMSNorm:
    y = x / sqrt(mean(x^2) + eps) * weight; with ``config.persist_layer_norm`` the same
    module through one compiled function (``fusions.fused_layer_norm``). Under sequence
    parallelism the norm runs on the sequence-sharded activations; GPTModel marks its
    parameters ``sequence_parallel`` so their gradients are summed over the TP group
    (megatron-core's local spec rejects SP here). With ``config.layernorm_zero_centered_gamma``
    the weight is zero-centred: y = norm(x) * (1 + weight) (``ZeroCenteredRMSNorm`` /
    ``ZeroCenteredLayerNorm``; Gemma's RMSNorm).
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
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if getattr(config, "layernorm_zero_centered_gamma", False):
            norms = {"LayerNorm": ZeroCenteredLayerNorm, "RMSNorm": ZeroCenteredRMSNorm}
        elif config.persist_layer_norm:
            norms = {"LayerNorm": FusedLayerNorm, "RMSNorm": FusedRMSNorm}
        if config.normalization not in norms:
            raise ValueError(
                f"config.normalization must be 'LayerNorm' or 'RMSNorm', got "
                f"{config.normalization!r}"
            )
        return norms[config.normalization](
            normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype
        )


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm with a zero-centred weight: y = x / sqrt(mean(x^2) + eps) * (1 + weight),
    computed in at least float32 and rounded once to the input's dtype (Gemma's order).
    The weight starts at zero (``GPTModel``'s initialization reads ``zero_centered_gamma``)."""

    zero_centered_gamma = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = x.to(torch.promote_types(x.dtype, torch.float32))
        eps = torch.finfo(acc.dtype).eps if self.eps is None else self.eps
        normed = acc * torch.rsqrt(acc.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (1 + self.weight.to(acc.dtype))).to(x.dtype)


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm with a zero-centred weight: (x - mean) / sqrt(var + eps) * (1 + weight) +
    bias (megatron-core's ``layernorm_zero_centered_gamma``)."""

    zero_centered_gamma = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(
            x, self.normalized_shape, 1 + self.weight, self.bias, self.eps
        )


class WholeProjectionRMSNorm(torch.nn.RMSNorm):
    """RMSNorm over all heads of a query or key projection together (OLMoE's and OLMo 2's
    q/k norm; ``config.qk_layernorm_whole_projection``), where ``qk_layernorm`` alone
    normalizes each head on its own:

        y = x / sqrt(sum(x^2) / (n d) + eps) * w,   sum over the n heads' n d values

    with ``w`` [n d], ``n`` the heads of the whole projection. Under tensor parallelism each
    rank holds n/TP heads, so its ``weight`` is that block of ``w`` (``tensor_model_parallel``
    along dim 0, not summed over TP) and the per-token sum of squares is all-reduced over
    ``tp_group`` with a summed gradient (``all_reduce_with_summed_grad``): every rank
    normalizes by the whole projection, as one process does. The sum accumulates in at
    least float32 (float64 stays float64); the output has the input's dtype times the
    weight. Input [..., n/TP, d] (the heads of ``get_query_key_value_tensors``). The config
    check (``qk_layernorm_whole_projection`` needs RMSNorm) is ``TransformerConfig``'s."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
    ) -> None:
        super().__init__(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        self.tp_group, self.tp_size = tp_group, get_pg_size(tp_group)
        self.full_size = hidden_size * self.tp_size
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(*x.shape[:-2], -1)
        acc = flat.to(torch.promote_types(flat.dtype, torch.float32))
        squares = acc.pow(2).sum(dim=-1, keepdim=True)
        if self.tp_size > 1:
            squares = all_reduce_with_summed_grad(squares, self.tp_group)
        normed = acc * torch.rsqrt(squares / self.full_size + self.eps)
        return (normed.to(x.dtype) * self.weight).view(x.shape)
