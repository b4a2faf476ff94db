"""Self-attention: fused QKV projection (column-parallel), core attention, output projection
(row-parallel), with grouped-query attention and rotary embeddings.

linear_qkv's output per query group g is [q_(g,1) .. q_(g,np/ng), k_g, v_g] (each d wide), the
groups one after another: megatron-core's layout, so a TP rank's slice of the fused weight is
whole query groups.
"""

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core import rope, tensor_parallel
from megatron.core.config_rules import is_window_layer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.rope import LayerAngles, apply_rotary_pos_emb
from megatron.core.transformer.cp_attention.kernels import Kernel, acc_dtype, attention_forward
from megatron.core.transformer.cp_attention.sinks import sink_forward
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule, leave_as_allocated, output_projection
from megatron.core.transformer.parallel_groups import tp_group_of
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WholeProjectionRMSNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import refuse_unsupported_arguments
from megatron.core.utils import get_pg_size


@dataclass
class SelfAttentionSubmodules:
    """Specs of self-attention's parts."""

    linear_qkv: Union[ModuleSpec, type]
    core_attention: Union[ModuleSpec, type]
    linear_proj: Union[ModuleSpec, type] = None
    q_layernorm: Union[ModuleSpec, type] = None
    k_layernorm: Union[ModuleSpec, type] = None


class Attention(MegatronModule):
    """Shared part of attention: sizes per TP rank, core attention and output projection.

    out = linear_proj(core_attention(Q, K, V)); returns (out, linear_proj bias) with the bias
    not yet added (added with the residual).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.pg_collection = pg_collection
        self.tp_group = tp_group_of(pg_collection, config)
        tp = get_pg_size(self.tp_group)
        self.hidden_size_per_attention_head = config.kv_channels
        self.query_projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_query_groups
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        self.num_query_groups_per_partition = config.num_query_groups // tp
        self.window_layer = is_window_layer(
            config.window_size, config.window_attn_skip_freq, layer_number
        )
        self.mscale = config_yarn_cos_sin_scale(config)  # YaRN's cos/sin scale (1 without)
        self.core_attention = build_module(
            submodules.core_attention,
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=attention_type,
            cp_comm_type=layer_cp_comm_type(cp_comm_type, config, layer_number),
            pg_collection=pg_collection,
        )
        self.linear_proj = output_projection(
            submodules.linear_proj, self.query_projection_size, config, "proj", self.tp_group
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        key_value_states: Optional[torch.Tensor] = None,
        inference_context=None,
        rotary_pos_emb: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        rotary_pos_cos: Optional[torch.Tensor] = None,
        rotary_pos_sin: Optional[torch.Tensor] = None,
        rotary_pos_cos_sin: Optional[torch.Tensor] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
        sequence_len_offset: Optional[int] = None,
        *,
        inference_params=None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """[s, b, h] (sequence-sharded over TP under SP) -> (output [s, b, h], bias).

        ``rotary_pos_emb`` [s_local, 1, 1, r] rotates queries and keys (RoPE); a
        ``LayerAngles`` gives this layer's (its ``local`` ones for a sliding-window layer).
        ``sequence_len_offset`` (with ``inference_context`` only) must equal the context's
        ``sequence_len_offset``, the KV cache's offset this forward uses. Cross-attention
        and the fused-rope cos/sin tables are refused by name.
        """
        inference_context = inference_context if inference_context is not None else inference_params
        owner = type(self).__name__
        refuse_unsupported_arguments(
            owner,
            key_value_states=key_value_states,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
        )
        check_sequence_len_offset(owner, sequence_len_offset, inference_context)
        if inference_context is not None:
            refuse_unsupported_arguments(
                owner,
                _CACHED_REASONS,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if isinstance(rotary_pos_emb, LayerAngles):
            rotary_pos_emb = rotary_pos_emb.of_layer(self.window_layer)
        if rotary_pos_emb is not None:
            if isinstance(rotary_pos_emb, tuple):
                q_emb, k_emb = rotary_pos_emb
            else:
                q_emb = k_emb = rotary_pos_emb
            query = apply_rotary_pos_emb(query, q_emb, config=self.config, mscale=self.mscale)
            key = apply_rotary_pos_emb(key, k_emb, config=self.config, mscale=self.mscale)
        if inference_context is not None:
            return self.linear_proj(cached_attention(self, query, key, value, inference_context))

        def core_attention(q, k, v, mask):
            return self.core_attention(
                q,
                k,
                v,
                mask,
                attn_mask_type=self.attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )

        context = attend(self, core_attention, query, key, value, attention_mask)
        return self.linear_proj(context)


# Not implemented with a KV cache (``inference_context``).
_CACHED_REASONS = {
    "attention_bias": "the KV-cache path takes no attention bias",
    "packed_seq_params": "packed sequences with a KV cache are not implemented; generate one "
    "sequence per batch row",
}


def cached_attention(module: torch.nn.Module, query, key, value, inference_context) -> torch.Tensor:
    """Attention of the new queries [s, b, np, d] over every key cached so far in
    ``module``'s layer (the new keys and values stored first): query i at position o + i
    (o = the context's ``sequence_len_offset``) sees positions <= o + i, within the window
    of ``module.core_attention`` when set, with its attention sinks when it has them.
    Context parallelism does not apply (one rank holds the whole sequence). Used by
    ``Attention`` and ``MLASelfAttention``; -> [s, b, np * d]."""
    if module.config.context_parallel_size > 1:
        raise NotImplementedError(
            "inference_context with context_parallel_size > 1; generate at CP = 1"
        )
    keys, values = inference_context.store(module.layer_number, key, value)
    core = module.core_attention
    offset = getattr(inference_context, "static_offset", None)
    if offset is not None:
        return _attention_up_to(query, keys, values, offset, core)
    return _explicit_attention(query, keys, values, core.attention_kernel, core.softmax_offset)


def _attention_up_to(query, keys, values, offset, core: torch.nn.Module) -> torch.Tensor:
    """A decoding step of static shapes (``StaticInferenceContext.enable_static_decode``): the
    one query [1, b, np, d] attends over the whole buffers [max_len, b, ng, d], keys past
    ``offset`` (a device tensor) masked out, and those before the window of ``core`` (the
    core attention, whose kernel options and sinks apply),
    so that the step can be captured as a CUDA graph. Each key head's query heads run as its
    queries (no expanded keys). PyTorch's attention with a boolean mask (the kernels of
    ``cp_attention`` take no mask); with logit soft-capping or attention sinks the scores
    explicitly, at least in float32 (one query row per head: cheap), the sinks joined by
    their LSE."""
    kernel, sinks = core.attention_kernel, core.softmax_offset
    b, n_q, d = query.shape[1:]
    n_kv, length = keys.shape[2], keys.shape[0]
    q = query.permute(1, 2, 0, 3).reshape(b, n_kv, n_q // n_kv, d)
    k, v = (x.permute(1, 2, 0, 3) for x in (keys, values))
    position = torch.arange(length, device=k.device)
    visible = position <= offset
    if kernel.window is not None:  # keys offset - window .. offset, as attention_forward's
        visible = visible & (position >= offset - kernel.window)
    if kernel.softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible[None, :], scale=kernel.scale
        )
        return out.reshape(b, n_q * v.shape[-1]).unsqueeze(0)
    dtype = acc_dtype(query.dtype)
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * kernel.scale
    if kernel.softcap is not None:
        scores = torch.tanh(scores / kernel.softcap) * kernel.softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [b, n_kv, g, 1]
    out = (torch.exp(scores - lse) @ v.to(dtype)).to(query.dtype)
    out = out.reshape(1, b, n_q, v.shape[-1])
    if sinks is not None:
        out = sink_forward(out, lse.reshape(b, n_q, 1), sinks)[0].to(query.dtype)
    return out.reshape(1, b, n_q * v.shape[-1])


def check_sequence_len_offset(owner: str, offset, inference_context) -> None:
    """Accept ``sequence_len_offset`` (an int, or a tensor of one offset per sequence) only
    where it is the KV cache's offset: with ``inference_context`` and equal to its
    ``sequence_len_offset``; refuse it otherwise, naming ``owner``."""
    if offset is None:
        return
    if inference_context is None:
        refuse_unsupported_arguments(owner, sequence_len_offset=offset)
    cached = inference_context.sequence_len_offset
    values = offset.flatten().tolist() if torch.is_tensor(offset) else [offset]
    if any(value != cached for value in values):
        raise ValueError(
            f"{owner}: sequence_len_offset={values if torch.is_tensor(offset) else offset!r} "
            f"disagrees with inference_context.sequence_len_offset={cached}; expected None or "
            f"{cached} (the KV cache's offset, which this forward uses)"
        )


def layer_cp_comm_type(cp_comm_type, config: TransformerConfig, layer_number: int):
    """The ``cp_comm_type`` of global layer ``layer_number``: the argument, else the
    config's; a list holds one per layer, entry n - 1 for layer n (megatron-core 0.16.1
    reads entry n, one past the end at the last layer; docs/compatibility.md)."""
    if cp_comm_type is None:
        cp_comm_type = config.cp_comm_type
    if isinstance(cp_comm_type, (list, tuple)):
        return cp_comm_type[layer_number - 1]
    return cp_comm_type


def config_yarn_cos_sin_scale(config: TransformerConfig) -> float:
    """YaRN's cos/sin scale mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim)
    when the config has YaRN fields (``GPTModel(position_embedding_type="yarn")``), else 1."""
    factor = config.yarn_rotary_scaling_factor
    if factor is None:
        return 1.0
    return rope.yarn_cos_sin_scale(factor, *rope.yarn_config_mscales(config))


def _explicit_attention(query, keys, values, kernel: Kernel, sinks) -> torch.Tensor:
    """The cached forward on the core attention's own kernel and options (``kernel``: scale,
    window, soft-cap): a bottom-right causal block (query i of s at position total - s + i),
    grouped-query attention by the kernel, then the sinks joined to its output and LSE
    (``cp_attention.sinks``). Q [s, b, np, d], K/V [total, b, ng, d] -> [s, b, np * d]."""
    out, lse = attention_forward(query, keys, values, True, kernel, layout="sbnd")
    if sinks is not None:
        out = sink_forward(out, lse, sinks)[0].to(query.dtype)
    return out.reshape(*out.shape[:2], -1)


class SelfAttention(Attention):
    """Self-attention with the fused QKV projection ``linear_qkv`` [h -> (np + 2 ng) d]."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(
            config,
            submodules,
            layer_number,
            attn_mask_type,
            attention_type="self",
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        self.linear_qkv = build_module(
            submodules.linear_qkv,
            config.hidden_size,
            self.query_projection_size + 2 * self.kv_projection_size,
            config=config,
            init_method=leave_as_allocated,
            gather_output=False,
            bias=config.add_bias_linear or config.add_qkv_bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="qkv",
            tp_group=self.tp_group,
        )
        self.q_layernorm, self.k_layernorm = self._qk_norms(submodules, config)

    def _qk_norms(self, submodules: SelfAttentionSubmodules, config: TransformerConfig):
        """(q norm, k norm): the spec's, per head (identity when it has none), or with
        ``config.qk_layernorm_whole_projection`` one RMSNorm over each projection's heads
        together (OLMoE): the config chooses the scope, as ``config.normalization`` the kind."""
        head_dim = self.hidden_size_per_attention_head
        if config.qk_layernorm_whole_projection:
            whole = dict(config=config, eps=config.layernorm_epsilon, tp_group=self.tp_group)
            heads, groups = (
                self.num_attention_heads_per_partition,
                self.num_query_groups_per_partition,
            )
            return (
                WholeProjectionRMSNorm(hidden_size=heads * head_dim, **whole),
                WholeProjectionRMSNorm(hidden_size=groups * head_dim, **whole),
            )
        norm = dict(config=config, hidden_size=head_dim, eps=config.layernorm_epsilon)
        q_norm = build_module(submodules.q_layernorm or IdentityOp, **norm)
        k_norm = build_module(submodules.k_layernorm or IdentityOp, **norm)
        if config.qk_layernorm and isinstance(q_norm, IdentityOp):
            raise ValueError(
                "config.qk_layernorm=True but the layer spec has no q_layernorm/k_layernorm; "
                "build the spec with get_gpt_layer_local_spec(qk_layernorm=True)"
            )
        if get_pg_size(self.tp_group) > 1:
            # Replicated over TP but fed this rank's heads only: the gradient is the sum over
            # the TP group, with or without sequence parallelism.
            for param in (*q_norm.parameters(), *k_norm.parameters()):
                param.sequence_parallel = True
        return q_norm, k_norm

    def get_query_key_value_tensors(
        self, hidden_states: torch.Tensor, key_value_states: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q [s, b, np/TP, d], K and V [s, b, ng/TP, d] from the per-group layout."""
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        groups = self.num_query_groups_per_partition
        heads_per_group = self.num_attention_heads_per_partition // groups
        d = self.hidden_size_per_attention_head
        mixed_qkv = mixed_qkv.view(*mixed_qkv.shape[:2], groups, (heads_per_group + 2) * d)
        query, key, value = mixed_qkv.split([heads_per_group * d, d, d], dim=-1)
        query = query.reshape(*query.shape[:2], groups * heads_per_group, d)
        return self.q_layernorm(query), self.k_layernorm(key), value


def attend(module: torch.nn.Module, core_attention, query, key, value, attention_mask):
    """``core_attention(query, key, value, attention_mask)`` of an attention ``module``; under
    selective recomputation of ``core_attn`` (training, with grad) only Q, K and V are kept
    and the attention reruns in the backward."""
    config = module.config
    recompute = (
        config.recompute_granularity == "selective"
        and "core_attn" in config.recompute_modules
        and module.training
        and torch.is_grad_enabled()
    )
    if recompute:
        return tensor_parallel.checkpoint(core_attention, False, query, key, value, attention_mask)
    return core_attention(query, key, value, attention_mask)
