"""GPTModel's position and embedding helpers: the rotary angles of a forward (RoPE, YaRN,
and the local base of Gemma 3's sliding-window layers), the YaRN fields' checks, the
embedding scale and the final logit soft-cap."""

from typing import Any, Optional

import torch
from torch import Tensor

from megatron.core.context_parallel import thd_document_positions, thd_partitioned_indices
from megatron.core.rope import (
    LayerAngles,
    RotaryEmbedding,
    YarnRotaryEmbedding,
    yarn_config_mscales,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import offset_rows
from megatron.core.utils import get_pg_rank, get_pg_size

YARN_FIELDS = (
    "yarn_rotary_scaling_factor",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
)


def check_yarn_fields(config: TransformerConfig, position_embedding_type: str) -> None:
    """position_embedding_type "yarn" needs the four YaRN fields; other types none of them."""
    given = [n for n in YARN_FIELDS if getattr(config, n) is not None]
    if position_embedding_type == "yarn" and len(given) != len(YARN_FIELDS):
        missing = [n for n in YARN_FIELDS if n not in given]
        raise ValueError(
            f"GPTModel: position_embedding_type='yarn' needs config.{', config.'.join(missing)}"
        )
    extra = given + [n for n in ("yarn_mscale", "yarn_mscale_all_dim") if getattr(config, n)]
    if position_embedding_type != "yarn" and extra:
        raise ValueError(
            f"GPTModel: config.{extra[0]}={getattr(config, extra[0])!r} is set but "
            f"position_embedding_type={position_embedding_type!r}; expected 'yarn'"
        )
    if position_embedding_type == "yarn" and config.local_rotary_base is not None:
        raise NotImplementedError(
            f"GPTModel: config.local_rotary_base={config.local_rotary_base!r} with "
            "position_embedding_type='yarn' is not supported (the local base is plain RoPE's); "
            "expected local_rotary_base=None or position_embedding_type='rope'"
        )


def yarn_embedding(
    config: TransformerConfig, rotary_percent: float, rotary_base
) -> YarnRotaryEmbedding:
    """The YaRN rotary embedding of the config's yarn_* fields (megatron-core's names)."""
    if rotary_percent < 1.0:
        raise NotImplementedError(
            "GPTModel: position_embedding_type='yarn' with rotary_percent < 1"
        )
    mscale, mscale_all_dim = yarn_config_mscales(config)
    return YarnRotaryEmbedding(
        config.kv_channels,
        rotary_interleaved=config.rotary_interleaved,
        rotary_base=rotary_base,
        scaling_factor=config.yarn_rotary_scaling_factor,
        original_max_position_embeddings=config.yarn_original_max_position_embeddings,
        beta_fast=config.yarn_beta_fast,
        beta_slow=config.yarn_beta_slow,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
        correction_range_round_to_int=config.yarn_correction_range_round_to_int,
    )


def rope_embedding(
    config: TransformerConfig, rotary_percent: float, rotary_base: float, **scaling: Any
) -> RotaryEmbedding:
    """The RoPE of the config's heads at base ``rotary_base`` (GPTModel's, and the
    sliding-window layers' at ``config.local_rotary_base``); ``scaling``: RotaryEmbedding's
    ``seq_len_interpolation_factor``, ``rope_scaling``, ``rope_scaling_factor``."""
    return RotaryEmbedding(
        kv_channels=config.kv_channels,
        rotary_percent=rotary_percent,
        rotary_interleaved=config.rotary_interleaved,
        rotary_base=rotary_base,
        use_cpu_initialization=config.use_cpu_initialization,
        **scaling,
    )


def softcapped(logits: Tensor, cap: Optional[float]) -> Tensor:
    """cap * tanh(logits / cap) (``final_logit_softcapping``; None: the logits as they are)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def embedding_scale(hidden_size: int, like: Tensor) -> Tensor:
    """sqrt(hidden_size) as transformers' Gemma has it: a float32 scalar, then rounded to the
    embeddings' dtype (``embedding_scale_sqrt_hidden``)."""
    scale = torch.tensor(hidden_size**0.5, dtype=torch.float32, device=like.device)
    return scale.to(like.dtype)


class RotaryAngles:
    """GPTModel's rotary angles of a forward (a mixin: reads the model's ``config``,
    ``tp_group``, ``_cp_group``, ``decoder`` and its ``rotary_pos_emb`` /
    ``local_rotary_pos_emb``)."""

    def _layer_angles(self, input_ids, decoder_input, packed_seq_params, inference_context):
        """The RoPE angles of this forward: one tensor, or ``LayerAngles`` (full, local) with
        ``config.local_rotary_base``."""
        angles = []
        for name in ("rotary_pos_emb", "local_rotary_pos_emb"):
            if not hasattr(self, name):
                continue
            if inference_context is not None:
                angles.append(self._rotary_angles_from(inference_context, decoder_input, name))
            else:
                angles.append(
                    self._rotary_angles(input_ids, decoder_input, packed_seq_params, name)
                )
        return angles[0] if len(angles) == 1 else LayerAngles(*angles)

    def _rotary_angles(
        self, input_ids, decoder_input, packed_seq_params, name: str = "rotary_pos_emb"
    ) -> Tensor:
        """RoPE angles [s_local, 1, 1, r] of this rank's positions, on the activations'
        device (YaRN's cos/sin scale is applied by the attention, from the config), from the
        embedding's ``cached_angles`` (the last length's table kept on the device): unpacked
        rows take this CP rank's positions, packed rows index the whole table by each
        document's own positions. Training and cached inference share that one cache slot."""
        cp_group = self._cp_group.get()
        total = self._global_seq_length(input_ids, decoder_input, cp_group)
        hidden = decoder_input if decoder_input is not None else self.decoder.input_tensor
        device = hidden.device
        embedding = getattr(self, name)
        if packed_seq_params is not None:  # angles of the positions within each document
            positions = positions_in_documents(packed_seq_params, total, cp_group)
            return embedding.cached_angles(total, device)[0][positions.to(device)]
        return embedding.cached_angles(total, device, cp_group)[0]

    def _rotary_angles_from(
        self, inference_context, decoder_input, name: str = "rotary_pos_emb"
    ) -> Tensor:
        """RoPE angles of the positions [offset, offset + s) a cached forward runs (the
        table for the context's whole length: the embedding's ``cached_angles``); s is the
        whole sequence, TP times this rank's part under sequence parallelism."""
        hidden = decoder_input if decoder_input is not None else self.decoder.input_tensor
        length = inference_context.max_sequence_length
        table = getattr(self, name).cached_angles(length, hidden.device)[0]
        sp = get_pg_size(self.tp_group) if self.config.sequence_parallel else 1
        return offset_rows(inference_context, table, hidden.shape[0] * sp)

    def _global_seq_length(self, input_ids, decoder_input, cp_group) -> int:
        """The whole sequence's length s from this rank's inputs (for RoPE)."""
        cp = get_pg_size(cp_group)
        if input_ids is not None:
            return input_ids.shape[1] * cp
        hidden = decoder_input if decoder_input is not None else self.decoder.input_tensor
        sp = get_pg_size(self.tp_group) if self.config.sequence_parallel else 1
        return hidden.shape[0] * sp * cp


def positions_in_documents(packed_seq_params, total: int, cp_group) -> torch.Tensor:
    """Each local token's position within its document of a packed (THD) row of ``total``
    tokens: RoPE restarts in every document (as megatron-core's THD rotary path does). The
    local tokens are this CP rank's load-balanced share of every padded document; tokens
    past the last document count as one more document."""
    padded = packed_seq_params.cu_seqlens_q_padded
    if padded is None:
        padded = packed_seq_params.cu_seqlens_q
    local = thd_partitioned_indices(padded, total, get_pg_size(cp_group), get_pg_rank(cp_group))
    return thd_document_positions(local, padded, total)[1]
