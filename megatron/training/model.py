"""This rank's model: one GPT chunk per virtual pipeline stage, each wrapped in DDP, with
the schedule hooks set as megatron's training loop sets them.

Chunk v of pipeline rank p is virtual stage s = v * PP + p; it embeds tokens when s = 0 and
computes the loss when s = PP * V - 1. Weights are seeded per parameter (GPTModel), so every
layout starts from the same model.
"""

from typing import List, Optional

import torch
import torch.nn.functional as F

from megatron.core.communication import all_reduce
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.models.gpt.gpt_model import padded_vocab_size
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.lora import LoRAConfig, apply_lora, lora_modules
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.utils import openai_gelu
from megatron.training.arguments import Layout, TrainingConfig, flag_of


def build_model(
    config: TrainingConfig,
    layout: Layout,
    pg_collection: Optional[ProcessGroupCollection],
    ddp: bool = True,
) -> List[DistributedDataParallel]:
    """The DDP-wrapped GPT chunks of this rank, in virtual-stage order (``ddp=False``: the
    chunks without DDP and without the schedule hooks, e.g. a frozen DPO reference).

    Hooks on the shared TransformerConfig: ``no_sync_func`` (per chunk with VPP),
    ``grad_sync_func`` with ``--overlap-grad-reduce``, and ``finalize_model_grads_func``.
    With ``--bf16``/``--fp16`` each GPT is wrapped in ``Float16Module`` (half-precision
    weights and activations, fp32 loss) inside DDP, whose ``main_grad`` stays fp32.
    """
    transformer_config = transformer_config_from(config, layout)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=config.overlap_grad_reduce,
        use_distributed_optimizer=config.use_distributed_optimizer,
        overlap_param_gather=config.overlap_param_gather,
    )
    pp, vpp = layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size
    pp_rank = 0 if pg_collection is None else pg_collection.pp.rank()
    last_stage = pp * (vpp or 1) - 1
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage * pp + pp_rank
        gpt = GPTModel(
            config=transformer_config,
            # this chunk's layers, MoE where --moe-layer-freq puts them
            transformer_layer_spec=get_gpt_decoder_block_spec(
                transformer_config, use_transformer_engine=False, vp_stage=vp_stage, pp_rank=pp_rank
            ),
            vocab_size=padded_vocab_size(
                config.vocab_size,
                config.make_vocab_size_divisible_by,
                layout.tensor_model_parallel_size,
            ),
            true_vocab_size=config.vocab_size,
            max_sequence_length=config.max_position_embeddings or config.seq_length,
            pre_process=stage == 0,
            post_process=stage == last_stage,
            share_embeddings_and_output_weights=not config.untie_embeddings_and_output_weights,
            position_embedding_type=config.position_embedding_type,
            rotary_base=config.rotary_base,
            rope_scaling=config.use_rope_scaling,
            rope_scaling_factor=config.rope_scaling_factor,
            vp_stage=vp_stage if vpp else None,
            pg_collection=pg_collection,
            seed=config.seed,
            pp_rank=pp_rank,
        )
        if config.hf_model:  # before any wrapper copies the parameters
            from megatron.training.hf import load_hf_weights

            load_hf_weights(gpt, config.hf_model)
        if config.lora_dim is not None:  # after the base weights, before any wrapper
            apply_lora(gpt, lora_config(config))
            if config.hf_adapter:
                from megatron.training.hf import read_hf_config
                from megatron.training.hf.peft import load_peft_adapter

                arch, _ = read_hf_config(config.hf_model)
                load_peft_adapter(gpt, config.hf_adapter, arch, lora_config(config))
        if config.compile:
            compile_layers(gpt)
        if config.bf16 or config.fp16:  # adapters too: fp32 main params in the optimizer
            gpt = Float16Module(transformer_config, gpt)
        if not ddp:
            chunks.append(gpt)
            continue
        chunks.append(
            DistributedDataParallel(
                config=transformer_config,
                ddp_config=ddp_config,
                module=gpt,
                pg_collection=pg_collection,
            )
        )
    if not ddp:
        return chunks
    if config.lora_dim is not None:
        _check_some_layer_adapted(config, chunks, pg_collection)
    one_or_list = (lambda fns: fns) if vpp else (lambda fns: fns[0])
    transformer_config.no_sync_func = one_or_list([c.no_sync for c in chunks])
    if config.overlap_grad_reduce:
        transformer_config.grad_sync_func = one_or_list([c.start_grad_sync for c in chunks])
    transformer_config.finalize_model_grads_func = finalize_model_grads
    return chunks


def moe_fields(config: TrainingConfig, layout: Layout) -> dict:
    """TransformerConfig's mixture-of-experts fields from the flags (none without
    ``--num-experts``)."""
    if config.num_experts is None:
        return {}
    return dict(
        num_moe_experts=config.num_experts,
        moe_router_topk=config.moe_router_topk,
        moe_ffn_hidden_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
        moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=config.moe_shared_expert_gate,
        moe_router_load_balancing_type=config.moe_router_load_balancing_type,
        moe_aux_loss_coeff=config.moe_aux_loss_coeff,
        moe_z_loss_coeff=config.moe_z_loss_coeff,
        moe_router_pre_softmax=config.moe_router_pre_softmax,
        moe_router_score_function=config.moe_router_score_function,
        moe_router_dtype=config.moe_router_dtype,
        moe_router_enable_expert_bias=config.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=config.moe_router_bias_update_rate,
        moe_router_topk_scaling_factor=config.moe_router_topk_scaling_factor,
        moe_router_num_groups=config.moe_router_num_groups,
        moe_router_group_topk=config.moe_router_group_topk,
        moe_layer_freq=config.moe_layer_freq,
        moe_grouped_gemm=config.moe_grouped_gemm,
        moe_token_dispatcher_type=config.moe_token_dispatcher_type,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
    )


def lora_config(config: TrainingConfig) -> LoRAConfig:
    """The ``LoRAConfig`` of a run's ``--lora-*`` flags (errors name the flags)."""
    return LoRAConfig(
        target_modules=tuple(config.lora_target_modules),
        exclude_modules=tuple(config.lora_exclude_modules),
        dim=config.lora_dim,
        alpha=config.lora_alpha,
        dropout=config.lora_dropout,
        dropout_position=config.lora_dropout_position,
        lora_A_init_method=config.lora_a_init_method,
        lora_B_init_method=config.lora_b_init_method,
        seed=config.seed,
        flags={f: flag_of(f"lora_{f}") for f in ("dim", "alpha", "dropout")}
        | {"target_modules": "--lora-target-modules", "exclude_modules": "--lora-exclude-modules"},
    )


def _check_some_layer_adapted(config: TrainingConfig, chunks, pg_collection) -> None:
    """Refuse targets that match no layer of the model, or no layer of some pipeline stage
    (a stage without a trainable parameter would need megatron-core's stub optimizer, which
    is not implemented). Each stage's count is gathered over the pipeline group (each stage
    sees its own layers; the other groups hold the same ones), so every rank decides alike."""
    pp = None if pg_collection is None else pg_collection.pp
    stages = 1 if pp is None else pp.size()
    counts = torch.zeros(stages, dtype=torch.int64)
    counts[0 if pp is None else pp.rank()] = sum(len(lora_modules(c)) for c in chunks)
    counts = all_reduce(counts, pp)
    targets = (
        f"--lora-target-modules {' '.join(config.lora_target_modules)} (less "
        f"--lora-exclude-modules {' '.join(config.lora_exclude_modules) or '(none)'})"
    )
    if int(counts.sum()) == 0:
        raise ValueError(f"{targets} matches no layer of the model")
    bare = [str(stage) for stage, n in enumerate(counts.tolist()) if n == 0]
    if bare:
        raise ValueError(
            f"{targets} matches no layer of pipeline stage(s) {', '.join(bare)} of "
            f"--pipeline-model-parallel-size {stages}: every stage needs a trainable "
            "parameter (a frozen stage is not supported); target a layer of every stage, or "
            "use fewer pipeline stages"
        )


def transformer_config_from(config: TrainingConfig, layout: Layout) -> TransformerConfig:
    """The TransformerConfig of a run: float32 (or bf16/fp16 with ``--bf16``/``--fp16``:
    ``params_dtype`` and ``pipeline_dtype`` too, as megatron's arguments set them), no
    dropout, the layout's parallel sizes, the architecture flags (``--swiglu``: gated linear
    unit with silu); with ``--hf-model`` weights are not drawn (they are loaded)."""
    dtype = precision_dtype(config)
    # A field table, one TransformerConfig keyword per line: ``duplicates`` pairs its runs of
    # ``name=config.name`` with the other tables that build a config from flags (the
    # optimizer's in training.py, generate's, the HF converter's); each maps its own fields.
    return TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        ffn_hidden_size=config.ffn_hidden_size,
        normalization=config.normalization,
        kv_channels=config.kv_channels,
        layernorm_epsilon=config.norm_epsilon,
        gated_linear_unit=config.swiglu,
        activation_func=activation_of(config),
        add_bias_linear=not config.disable_bias_linear,
        add_qkv_bias=config.add_qkv_bias,
        qk_layernorm=config.qk_layernorm,
        qk_layernorm_whole_projection=config.qk_layernorm_whole_projection,
        perform_initialization=not config.hf_model,
        window_size=None if config.window_size is None else tuple(config.window_size),
        attention_backend=config.attention_backend,
        label_smoothing=config.label_smoothing,
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        sequence_parallel=config.sequence_parallel,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=config.init_method_std,
        context_parallel_size=layout.context_parallel_size,
        hierarchical_context_parallel_sizes=layout.hierarchical_sizes,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        calculate_per_token_loss=config.calculate_per_token_loss,
        gradient_accumulation_fusion=config.gradient_accumulation_fusion,
        deallocate_pipeline_outputs=True,
        cp_comm_type=config.cp_comm_type,
        recompute_granularity=config.recompute_granularity,
        recompute_method=config.recompute_method,
        recompute_num_layers=config.recompute_num_layers,
        recompute_modules=config.recompute_modules,
        **(fusions_of(config) if config.compile else {}),
        **moe_fields(config, layout),
        **fp8_fields(config),
    )


def fp8_fields(config: TrainingConfig) -> dict:
    """TransformerConfig's FP8 fields from the flags (docs/fp8.md)."""
    return dict(
        fp8=config.fp8_format,
        fp8_recipe=config.fp8_recipe,
        fp8_margin=config.fp8_margin,
        fp8_amax_history_len=config.fp8_amax_history_len,
        fp8_amax_compute_algo=config.fp8_amax_compute_algo,
        fp8_wgrad=config.fp8_wgrad,
    )


# megatron-core's fusion switches, turned on by --compile (torch.compile'd functions).
FUSIONS = dict(
    bias_activation_fusion=True,
    bias_dropout_fusion=True,
    apply_rope_fusion=True,
    persist_layer_norm=True,
    cross_entropy_loss_fusion=True,
)


def fusions_of(config: TrainingConfig) -> dict:
    """``FUSIONS``, without ``bias_activation_fusion`` for an activation it does not fuse
    (OpenAI's tanh GELU)."""
    fusions = dict(FUSIONS)
    if not config.swiglu and config.openai_gelu:
        fusions["bias_activation_fusion"] = False
    return fusions


def compile_layers(gpt: GPTModel) -> None:
    """``torch.compile`` every transformer layer of ``gpt`` in place: norms, RoPE, the
    activation and the residual adds between the GEMMs become fused kernels; the linear
    layers and core attention stay eager (``keep_eager``). One graph is reused by all layers
    (dynamo's cache limit is raised to the layer count so that none falls back to eager)."""
    import torch._dynamo

    layers = list(gpt.decoder.layers)
    limit = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = max(limit, 2 * len(layers) + 8)
    for layer in layers:
        keep_eager(layer)
        layer.compile()


def keep_eager(layer: torch.nn.Module) -> None:
    """Mark the modules of ``layer`` that ``torch.compile`` must not trace: the linear
    layers (hand-written autograd with ``gradient_accumulation_fusion``'s fp32 GEMMs; a LoRA
    adapter is part of its base layer's call, so it adds no graph break) and core attention
    (the flash-class kernels with their own backward). The graph breaks around them."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    eager = (ColumnParallelLinear, RowParallelLinear, DotProductAttention)
    for module in layer.modules():
        if isinstance(module, eager):
            module.forward = torch.compiler.disable(module.forward)


def activation_of(config: TrainingConfig):
    """silu (``--swiglu``, gated), OpenAI's tanh GELU (``--openai-gelu``) or exact GELU."""
    return F.silu if config.swiglu else openai_gelu if config.openai_gelu else F.gelu


def precision_dtype(config: TrainingConfig) -> torch.dtype:
    """The weights' dtype: bf16 (``--bf16``), fp16 (``--fp16``) or float32."""
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
