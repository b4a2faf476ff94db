"""Core attention: softmax(scale * Q K^T + causal mask) V, exact under context parallelism."""

import math
import warnings
from typing import Optional

import torch

from megatron.core.config_rules import layer_window_size
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.cp_attention import (
    Kernel,
    attention_with_kernel,
    check_backend_window,
    check_window_size,
    kernel_for_backend,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.parallel_groups import (
    ResolvedGroup,
    cp_group_of,
    hierarchical_cp_groups_of,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import refuse_unsupported_arguments


class DotProductAttention(MegatronModule):
    """Causal attention of this CP rank's queries over the whole sequence (megatron-core
    0.16.1's constructor), through ``cp_attention.context_parallel_attention`` with the kernel
    options (``attention_kernel``: the kernel, ``softmax_scale``, the window, the soft-cap)
    built and checked once, here (``attention_with_kernel``).

    The CP group of a step is ``pg_collection.cp``, else ``parallel_state``'s (MPU fallback),
    else none; resolved and checked once at build time (again only after ``parallel_state``
    is re-initialized: ``parallel_groups.ResolvedGroup``). ``attention_dropout`` is not
    applied (the CP kernels have no dropout; a warning says so when it is > 0). The kernel is
    ``config.attention_backend``'s (``cp_attention.kernel_choice``); ``config.window_size``
    gives sliding-window attention (on the layers ``config.window_attn_skip_freq`` gives it
    to: ``self.window_size``), refused here, at build time, where the CP setting or the
    kernel cannot compute it; ``config.attn_logit_softcapping`` caps the scores (the explicit
    "math" kernel; another ``attention_backend`` is refused here). ``config.softmax_type``
    "learnable": attention sinks, a parameter ``softmax_offset`` [np / TP] (this TP rank's
    heads; zero at first) added to every softmax denominator as exp(sink_h); "off-by-one": a
    fixed sink 0 (+1); with soft-capped scores too.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config)
        if attention_type != "self":
            raise NotImplementedError(
                f"DotProductAttention: attention_type={attention_type!r}; only 'self'"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = check_attn_mask_type(attn_mask_type)
        self.cp_comm_type = cp_comm_type
        self.pg_collection = pg_collection
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout > 0:
            _warn_once(
                f"attention_dropout={dropout} is not applied: context-parallel attention has no "
                "dropout (set it to 0.0 to silence this warning)"
            )
        if softmax_scale is None:
            softmax_scale = config.softmax_scale
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(config.kv_channels)
        self.softmax_scale = softmax_scale
        self.window_size = layer_window_size(
            config.window_size, config.window_attn_skip_freq, self.layer_number
        )
        check_backend_window(config.attention_backend, self.window_size)
        self._comm = self._comm_type()
        sinks = _sinks(config)
        if isinstance(sinks, torch.nn.Parameter) or sinks is None:
            self.softmax_offset = sinks
        else:
            self.register_buffer("softmax_offset", sinks, persistent=False)
        window = check_window_size(
            self.window_size,
            self._comm,
            0 if self._comm == "a2a+p2p" else config.context_parallel_size,
        )
        kernel = kernel_for_backend(config.attention_backend)
        # the kernel options of every call, the soft-cap checked here, once
        self.attention_kernel = Kernel(kernel, softmax_scale, window, config.attn_logit_softcapping)
        resolve = hierarchical_cp_groups_of if self._comm == "a2a+p2p" else cp_group_of
        self._cp_groups = ResolvedGroup(resolve, pg_collection, config)  # fails here if mismatched

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query [s_local, b, np, d], key/value [s_local, b, ng, d] -> [s_local, b, np * d].

        ``attention_mask`` is ignored: the mask is causal by global position (an
        ``attn_mask_type`` other than causal or padding is refused).
        """
        if attn_mask_type is not None:
            check_attn_mask_type(attn_mask_type)
        refuse_unsupported_arguments("DotProductAttention", attention_bias=attention_bias)
        context = attention_with_kernel(
            query,
            key,
            value,
            self.attention_kernel,
            cp_group=self._cp_groups.get(),
            cp_comm_type=self._comm,
            packed_seq_params=packed_seq_params,
            softmax_offset=self.softmax_offset,
        )
        return context.reshape(context.shape[0], context.shape[1], -1)

    def _comm_type(self) -> str:
        """``cp_comm_type`` (None: all_gather); a2a+p2p at CP = 1 is plain attention."""
        if self.cp_comm_type == "a2a+p2p" and self.config.context_parallel_size == 1:
            return "all_gather"
        return self.cp_comm_type or "all_gather"


def check_attn_mask_type(attn_mask_type: AttnMaskType) -> AttnMaskType:
    """``attn_mask_type`` when this core computes it: causal, or padding (megatron-core's
    ``SelfAttention`` default, whose mask is the causal one GPT passes); the others
    (bidirectional, arbitrary masks) are refused by name."""
    if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding):
        got = attn_mask_type if isinstance(attn_mask_type, AttnMaskType) else repr(attn_mask_type)
        raise NotImplementedError(
            f"DotProductAttention: attn_mask_type={got} is not supported (the "
            "attention is causal by global position); expected AttnMaskType.causal or "
            "AttnMaskType.padding"
        )
    return attn_mask_type


def _sinks(config: TransformerConfig) -> Optional[torch.Tensor]:
    """The sinks of this TP rank's heads: a zero parameter ("learnable"), a zero tensor
    ("off-by-one"), or None ("vanilla")."""
    if config.softmax_type == "vanilla":
        return None
    heads = config.num_attention_heads // config.tensor_model_parallel_size
    zeros = torch.zeros(heads, dtype=config.params_dtype)
    if config.softmax_type == "off-by-one":
        return zeros
    sinks = torch.nn.Parameter(zeros)
    set_tensor_model_parallel_attributes(sinks, True, 0, 1)
    return sinks


_WARNED = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)
