"""Multi-latent attention (DeepSeek-V2/V3; megatron-core 0.16.1's ``MLASelfAttention``).

q = linear_q_up_proj(q_layernorm(linear_q_down_proj(x))) (or ``linear_q_proj(x)`` when
``q_lora_rank`` is None), per head [qk_head_dim | qk_pos_emb_head_dim];
linear_kv_down_proj(x) = [c_kv | k_pe], k_nope and v per head from
linear_kv_up_proj(kv_layernorm(c_kv)); k_pe (one rope key shared by every head) and q's rope
part are rotated by de-interleaving rope (yarn: cos/sin scaled by mscale, the softmax scale
by mscale(factor, mscale_all_dim)^2).

Tensor parallelism: the down projections and their norms are replicated and run on the whole
sequence (gathered under SP), the up projections are split by heads and sum their input
gradient over TP; the rope key k_pe reaches every head without an up projection, so its
gradient is summed over TP explicitly (megatron-core 0.16.1 does not: Megatron-LM #1699).
Every replicated parameter then has the whole gradient on each rank (``grad_complete_over_tp``:
not summed again under SP).
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core.device import comm_device
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.rope import RotaryEmbedding, YarnRotaryEmbedding, rotate, yarn_get_mscale
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.attention import (
    attend,
    cached_attention,
    check_sequence_len_offset,
    layer_cp_comm_type,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule, output_projection, parallel_linear
from megatron.core.transformer.parallel_groups import ResolvedGroup, cp_group_of, tp_group_of
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.transformer.utils import offset_rows, refuse_unsupported_arguments
from megatron.core.utils import get_pg_size


@dataclass
class MLASelfAttentionSubmodules:
    """Specs of multi-latent attention's parts (megatron-core's names)."""

    linear_q_proj: Union[ModuleSpec, type] = None
    linear_q_down_proj: Union[ModuleSpec, type] = None
    linear_q_up_proj: Union[ModuleSpec, type] = None
    linear_kv_down_proj: Union[ModuleSpec, type] = None
    linear_kv_up_proj: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None
    q_layernorm: Union[ModuleSpec, type] = None
    kv_layernorm: Union[ModuleSpec, type] = None


class ReplicatedLinear(MegatronModule):
    """y = x W^T with W [output_size, input_size] whole on every TP rank; returns (y, None)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: MLATransformerConfig,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        **_unused,
    ) -> None:
        super().__init__(config)
        self.input_size, self.output_size = input_size, output_size
        device = "cpu" if config.use_cpu_initialization else comm_device(tp_group)
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype, device=device)
        )

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, None]:
        """(x W^T, no bias)."""
        return F.linear(input_, self.weight), None


# MLASelfAttention.forward's refused arguments whose reason differs from
# ``UNSUPPORTED_FORWARD_ARGUMENTS``'.
_MLA_REASONS = {
    "rotary_pos_emb": "multi-latent attention applies its own rope (config.rope_type)",
    "rotary_pos_cos": "multi-latent attention applies its own rope (config.rope_type)",
    "rotary_pos_sin": "multi-latent attention applies its own rope (config.rope_type)",
    "rotary_pos_cos_sin": "multi-latent attention applies its own rope (config.rope_type)",
    "attention_bias": "multi-latent attention takes no attention bias",
    "packed_seq_params": "packed sequences are not implemented for multi-latent attention",
    "position_ids": "multi-latent attention's rope positions are the sequence positions",
}


class MLASelfAttention(MegatronModule):
    """Multi-latent self-attention (module docstring); returns (output [s, b, h], bias)."""

    def __init__(
        self,
        config: MLATransformerConfig,
        submodules: MLASelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config)
        if not isinstance(config, MLATransformerConfig):
            raise TypeError(
                f"MLASelfAttention needs an MLATransformerConfig, got {type(config).__name__}"
            )
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.tp_group = tp_group_of(pg_collection, config)
        tp = get_pg_size(self.tp_group)
        if config.num_attention_heads % tp:
            raise ValueError(
                f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                f"tensor_model_parallel_size ({tp})"
            )
        self.heads = config.num_attention_heads // tp
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        self._cp_group = ResolvedGroup(cp_group_of, pg_collection, config)
        self._build_projections(config, submodules)
        self.core_attention = build_module(
            submodules.core_attention,
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type="self",
            softmax_scale=self._softmax_scale(config),
            cp_comm_type=layer_cp_comm_type(cp_comm_type, config, layer_number),
            pg_collection=pg_collection,
        )
        self.linear_proj = output_projection(
            submodules.linear_proj,
            config.num_attention_heads * config.v_head_dim,
            config,
            "proj",
            self.tp_group,
        )
        self._set_rope(config)

    def _build_projections(self, config, submodules) -> None:
        """The q path, the kv path and their norms (norm eps: ``layernorm_epsilon``)."""
        heads = config.num_attention_heads
        replicated = []
        if config.q_lora_rank is None:
            self.linear_q_proj = self._up(submodules.linear_q_proj, config.hidden_size, heads)
        else:
            self.linear_q_down_proj = build_module(
                submodules.linear_q_down_proj,
                config.hidden_size,
                config.q_lora_rank,
                config=config,
                tp_group=self.tp_group,
            )
            self.q_layernorm = self._norm(submodules.q_layernorm, config, config.q_lora_rank)
            self.linear_q_up_proj = self._up(submodules.linear_q_up_proj, config.q_lora_rank, heads)
            replicated += [self.linear_q_down_proj, self.q_layernorm]
        self.linear_kv_down_proj = build_module(
            submodules.linear_kv_down_proj,
            config.hidden_size,
            config.kv_lora_rank + config.qk_pos_emb_head_dim,
            config=config,
            tp_group=self.tp_group,
        )
        self.kv_layernorm = self._norm(submodules.kv_layernorm, config, config.kv_lora_rank)
        self.linear_kv_up_proj = self._up(
            submodules.linear_kv_up_proj,
            config.kv_lora_rank,
            heads,
            per_head=config.qk_head_dim + config.v_head_dim,
        )
        for module in replicated + [self.linear_kv_down_proj, self.kv_layernorm]:
            for param in module.parameters():
                param.grad_complete_over_tp = True

    @staticmethod
    def _norm(spec, config, size: int) -> torch.nn.Module:
        return build_module(
            spec or IdentityOp, config=config, hidden_size=size, eps=config.layernorm_epsilon
        )

    def _up(self, spec, input_size: int, heads: int, per_head: Optional[int] = None):
        """A column-parallel projection to ``heads`` x ``per_head`` (default: the q head dim)
        whose input is already whole on every rank: no sequence gather, its input gradient
        summed over TP."""
        module = parallel_linear(
            spec,
            input_size,
            heads * (per_head or self.q_head_dim),
            self.config,
            self.tp_group,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
        )
        module.sequence_parallel = False
        module.allreduce_dgrad = get_pg_size(self.tp_group) > 1
        return module

    @staticmethod
    def _softmax_scale(config: MLATransformerConfig) -> float:
        scale = 1.0 / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)
        if config.rope_type == "yarn":
            scale *= yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim) ** 2
        return scale

    def _set_rope(self, config: MLATransformerConfig) -> None:
        """``rotary_pos_emb`` (megatron-core's attribute): the ``RotaryEmbedding`` or
        ``YarnRotaryEmbedding`` of ``config.rope_type`` over the rope head dim (each forward
        passes its CP group)."""
        dim = config.qk_pos_emb_head_dim
        if config.rope_type == "yarn":
            self.rotary_pos_emb = YarnRotaryEmbedding(
                dim,
                rotary_base=config.rotary_base,
                scaling_factor=config.rotary_scaling_factor,
                original_max_position_embeddings=config.original_max_position_embeddings,
                beta_fast=config.beta_fast,
                beta_slow=config.beta_slow,
                mscale=config.mscale,
                mscale_all_dim=config.mscale_all_dim,
            )
        else:
            self.rotary_pos_emb = RotaryEmbedding(
                dim, config.rotary_percent, rotary_base=config.rotary_base
            )

    def _angles(
        self, seq_local: int, device: torch.device, inference_context=None
    ) -> Tuple[torch.Tensor, float]:
        """(angles [s_local, 1, 1, dim] of this CP rank's positions on ``device``, cos/sin
        scale): the embedding's ``cached_angles`` (copied to the device once per length).
        A cached forward's positions are [offset, offset + s) of the context (the table of
        its whole length, built once per generation)."""
        if inference_context is not None:
            table, mscale = self.rotary_pos_emb.cached_angles(
                inference_context.max_sequence_length, device
            )
            return offset_rows(inference_context, table, seq_local), mscale
        cp_group = self._cp_group.get()
        length = seq_local * get_pg_size(cp_group)
        return self.rotary_pos_emb.cached_angles(length, device, cp_group)

    @staticmethod
    def _rope(t: torch.Tensor, angles: torch.Tensor, mscale: float) -> torch.Tensor:
        """De-interleave the pairs (x0, x1), (x2, x3), .. into halves, then rotate."""
        t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
        return rotate(t, angles, False, mscale)

    def _shared_rope_key(self, k_pe: torch.Tensor) -> torch.Tensor:
        """k_pe feeds this rank's heads only: its gradient is summed over TP."""
        if get_pg_size(self.tp_group) == 1:
            return k_pe
        return copy_to_tensor_model_parallel_region(k_pe, group=self.tp_group)

    def get_query_key_value_tensors(
        self,
        hidden_states: torch.Tensor,
        key_value_states: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        packed_seq_params=None,
        inference_context=None,
        *,
        inference_params=None,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q and K [s, b, np/TP, qk_head_dim + qk_pos_emb_head_dim], V [s, b, np/TP,
        v_head_dim]; s is this CP rank's whole part (gathered over TP under SP), rotated at
        the positions of ``inference_context``'s offset when given (megatron-core's
        signature; the other arguments are refused unless None)."""
        refuse_unsupported_arguments(
            "MLASelfAttention",
            _MLA_REASONS,
            key_value_states=key_value_states,
            position_ids=position_ids,
            packed_seq_params=packed_seq_params,
        )
        if inference_context is None:
            inference_context = inference_params
        config = self.config
        x = hidden_states
        if config.sequence_parallel and get_pg_size(self.tp_group) > 1:
            x = gather_from_sequence_parallel_region(x, False, group=self.tp_group)
        if config.q_lora_rank is None:
            q, _ = self.linear_q_proj(x)
        else:
            q, _ = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)[0]))
        s, b = q.shape[:2]
        q = q.view(s, b, self.heads, self.q_head_dim)
        q_nope, q_pe = q.split([config.qk_head_dim, config.qk_pos_emb_head_dim], dim=-1)
        kv_c, k_pe = self.linear_kv_down_proj(x)[0].split(
            [config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1
        )
        kv, _ = self.linear_kv_up_proj(self.kv_layernorm(kv_c))
        kv = kv.view(s, b, self.heads, config.qk_head_dim + config.v_head_dim)
        k_nope, value = kv.split([config.qk_head_dim, config.v_head_dim], dim=-1)
        angles, mscale = self._angles(s, q.device, inference_context)
        q_pe = self._rope(q_pe, angles, mscale)
        k_pe = self._rope(self._shared_rope_key(k_pe).unsqueeze(2), angles, mscale)
        query = torch.cat((q_nope, q_pe), dim=-1)
        key = torch.cat((k_nope, k_pe.expand(-1, -1, self.heads, -1)), dim=-1)
        return query, key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        key_value_states: Optional[torch.Tensor] = None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
        position_ids: Optional[torch.Tensor] = None,
        sequence_len_offset: Optional[int] = None,
        *,
        inference_params=None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """[s, b, h] -> (output [s, b, h], linear_proj bias); rope is applied here, by
        sequence position. With ``inference_context`` (a ``StaticInferenceContext``) the
        keys and values join its cache and the queries attend over everything cached (as
        ``Attention``'s cache: K and V per head after the up projection, V zero-padded to
        K's head dim). Every other argument of megatron-core's must be None (refused by
        name otherwise)."""
        inference_context = inference_context if inference_context is not None else inference_params
        refuse_unsupported_arguments(
            "MLASelfAttention",
            _MLA_REASONS,
            key_value_states=key_value_states,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
        )
        check_sequence_len_offset("MLASelfAttention", sequence_len_offset, inference_context)
        query, key, value = self.get_query_key_value_tensors(
            hidden_states, None, position_ids, packed_seq_params, inference_context
        )
        dv = value.shape[-1]
        query, key, value = self._one_head_dim(query, key, value)
        if inference_context is not None:
            context = cached_attention(self, query, key, value, inference_context)
        else:

            def core_attention(q, k, v, mask):
                return self.core_attention(q, k, v, mask, attn_mask_type=self.attn_mask_type)

            # selective recompute of ``core_attn`` as ``Attention``
            context = attend(self, core_attention, query, key, value, attention_mask)
        return self.linear_proj(self._value_part(context, dv))

    @staticmethod
    def _one_head_dim(query, key, value) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """V zero-padded to Q/K's head dim (or Q and K to V's): the attention kernels (and
        the CP paths) take one head dim; the padding adds nothing to scores or outputs."""
        dq, dv = query.shape[-1], value.shape[-1]
        if dv < dq:
            value = F.pad(value, (0, dq - dv))
        elif dq < dv:
            query, key = F.pad(query, (0, dv - dq)), F.pad(key, (0, dv - dq))
        return query, key, value

    def _value_part(self, context: torch.Tensor, dv: int) -> torch.Tensor:
        """[s, b, np * d] of the padded heads -> [s, b, np * dv] (each head's first dv)."""
        s, b = context.shape[:2]
        return context.view(s, b, self.heads, -1)[..., :dv].reshape(s, b, self.heads * dv)
