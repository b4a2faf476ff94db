"""One GPT chunk of a rank: the builder the trainer (``model.build_model``) and the
HuggingFace loader (``hf.loading``) share.

Chunk v of pipeline rank p is virtual stage s = v * PP + p; it embeds tokens when s = 0 and
computes the loss (and holds the multi-token prediction depths, with ``mtp_num_layers``)
when s = PP * V - 1; its layers are MoE layers where ``moe_layer_freq``
says (megatron-core's block spec, no Transformer Engine).
"""

from typing import Any, Optional

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig


def build_gpt_chunk(
    config: TransformerConfig,
    pg_collection: Optional[ProcessGroupCollection],
    vp_stage: Optional[int],
    pp_rank: int,
    **gpt_kwargs: Any,
) -> GPTModel:
    """Chunk ``vp_stage`` (None: the only one) of pipeline rank ``pp_rank``; ``gpt_kwargs``
    are GPTModel's other arguments (vocabulary, positions, seed, ...)."""
    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size or 1
    stage = (vp_stage or 0) * pp + pp_rank
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, vp_stage=vp_stage, pp_rank=pp_rank
    )
    last = stage == pp * vpp - 1
    mtp = get_gpt_mtp_block_spec(config, spec, False, vp_stage, pp_rank) if last else None
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        pre_process=stage == 0,
        post_process=last,
        mtp_block_spec=mtp,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
        pp_rank=pp_rank,
        **gpt_kwargs,
    )


def transformer_config_class(values: dict) -> type:
    """``MLATransformerConfig`` when ``values`` ask for multi-latent attention, else
    ``TransformerConfig``."""
    return MLATransformerConfig if values.get("multi_latent_attention") else TransformerConfig
