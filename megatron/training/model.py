"""This rank's model: one GPT chunk per virtual pipeline stage (``chunk.build_gpt_chunk``),
each wrapped in DDP, with the schedule hooks set as megatron's training loop sets them.

The configs come from the options' ``library=`` declarations (``options.library_values``).
Weights are seeded per parameter (GPTModel), so every layout starts from the same model.
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
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_model import padded_vocab_size
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.lora import apply_lora, lora_modules
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.utils import openai_gelu
from megatron.training import chunk
from megatron.training.arguments import Layout, TrainingConfig
from megatron.training.dpo_checks import variable_seq_lengths
from megatron.training.lora_settings import lora_config
from megatron.training.options import (
    DDP_CONFIG,
    GPT_MODEL,
    TRANSFORMER_CONFIG,
    library_values,
)


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
        grad_reduce_in_fp32=True, **library_values(config, layout, DDP_CONFIG)
    )
    vpp = layout.virtual_pipeline_model_parallel_size
    pp_rank = 0 if pg_collection is None else pg_collection.pp.rank()
    chunks = []
    for vp_stage in range(vpp or 1):
        gpt = chunk.build_gpt_chunk(
            transformer_config,
            pg_collection,
            vp_stage if vpp else None,
            pp_rank,
            vocab_size=padded_vocab_size(
                config.vocab_size,
                config.make_vocab_size_divisible_by,
                layout.tensor_model_parallel_size,
            ),
            true_vocab_size=config.vocab_size,
            **library_values(config, layout, GPT_MODEL),
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
    """The TransformerConfig of a run: the fields its options declare (``option(...,
    library=...)`` in ``arguments.py``; a MoE field only with ``--num-experts``) and the few
    that no one option sets (``computed_fields``)."""
    values = library_values(config, layout, TRANSFORMER_CONFIG)
    return chunk.transformer_config_class(values)(**values, **computed_fields(config))


def computed_fields(config: TrainingConfig) -> dict:
    """The TransformerConfig fields no single option sets: the activation (``--swiglu``: silu,
    gated; ``--openai-gelu``), the weights' dtype (``params_dtype`` and ``pipeline_dtype``, as
    megatron's arguments set them), no dropout, pipeline outputs deallocated, the pipeline
    messages' shapes sent ahead for rows of packed pairs (``dpo_checks``)."""
    dtype = precision_dtype(config)
    return dict(
        activation_func=activation_of(config),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        deallocate_pipeline_outputs=True,
        variable_seq_lengths=variable_seq_lengths(config),
    )


def compile_layers(gpt: GPTModel) -> None:
    """``torch.compile`` every transformer layer of ``gpt`` in place: norms, RoPE, the
    activation and the residual adds between the GEMMs become fused kernels; the linear
    layers and core attention stay eager (``keep_eager``), and so do the MoE experts' paths
    that read the tokens per expert on the host (``experts._eager_if_counts_on_host``: traced,
    they recompiled for every split of the tokens). The layers share their compilations (the
    router files its losses under its layer number eagerly: ``router._file_in_tracker``);
    dynamo's cache limit is still raised with the layer count, a margin for what else may
    differ between layers (dense and MoE layers, a first call) so that none falls back to
    eager."""
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
    (the flash-class kernels with their own backward). The graph breaks around them. An FP8
    linear (``fp8_gemm``) is traced: its casts then fuse into the layer's graph and it pays
    no per-call Python cost (eager, its launches made a 4-layer step CPU-bound: 241 ms
    against 147 ms in bf16 on an H200)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    eager = (ColumnParallelLinear, RowParallelLinear, DotProductAttention)
    for module in layer.modules():
        if isinstance(module, eager) and getattr(module, "fp8_gemm", None) is None:
            module.forward = torch.compiler.disable(module.forward)


def activation_of(config: TrainingConfig):
    """silu (``--swiglu``, gated), quick_gelu (``--quick-geglu``, gated), OpenAI's tanh GELU
    (``--openai-gelu``; gated with ``--geglu``) or exact GELU."""
    if config.quick_geglu:
        return quick_gelu
    return F.silu if config.swiglu else openai_gelu if config.openai_gelu else F.gelu


def precision_dtype(config: TrainingConfig) -> torch.dtype:
    """The weights' dtype: bf16 (``--bf16``), fp16 (``--fp16``) or float32."""
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
