"""LayerNorm and RMSNorm whose forward is one fused function (``persist_layer_norm`` on the
local spec). Subclasses of torch's norms: the same parameters, names and state dicts."""

import torch
import torch.nn.functional as F

from megatron.core.jit import jit_fuser


@jit_fuser
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@jit_fuser
def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (y = x / sqrt(mean(x^2) + eps) * weight) through a compiled
    function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _rms_norm(x, self.weight, eps)


class FusedLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` through a compiled function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _layer_norm(x, self.weight, self.bias, self.eps)
