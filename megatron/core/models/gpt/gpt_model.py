"""GPT built from megatron-core layer specs, exact under tensor, sequence, context, pipeline
and data parallelism.

Embeddings (first stage) -> transformer layers from ``transformer_layer_spec`` -> final norm
and output layer (last stage). Parameter names line up with megatron-core 0.16.1's local-spec
GPTModel. Every parameter is drawn from its own generator, seeded from (seed, layout-free
name), as its FULL tensor; a TP rank keeps its slice of it, so every TP/CP/PP/VPP/DP layout
starts from the same model.
"""

import dataclasses
import hashlib
from typing import Any, Dict, List, Literal, Optional, Union

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.device import comm_device
from megatron.core.enums import ModelType
from megatron.core.fp8.linear import bind_cp_group
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.models.gpt.gpt_embeddings_utils import (
    RotaryAngles,
    check_yarn_fields,
    embedding_scale,
    rope_embedding,
    softcapped,
    yarn_embedding,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.utils import strided_shard
from megatron.core.transformer.module import MegatronModule, leave_as_allocated
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    attach_mtp_loss,
    check_mtp_placement,
)
from megatron.core.transformer.parallel_groups import ResolvedGroup, cp_group_of, tp_group_of
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import (  # shard_per_token_tensor: also importable from here
    get_pg_rank,
    get_pg_size,
    shard_per_token_tensor,
)


class GPTModel(RotaryAngles, MegatronModule):
    """Decoder-only language model chunk (megatron-core 0.16.1's constructor).

    Groups (explicit first): TP from ``pg_collection.tp``, CP from ``pg_collection.cp``
    (resolved at build time, again after ``parallel_state`` is re-initialized), the pipeline
    rank from ``pg_collection.pp``; without a collection, ``parallel_state``'s groups (MPU
    fallback) when initialized, else one rank.
    Chunk ``vp_stage`` on pipeline rank p is virtual stage vp_stage * PP + p and holds the
    global layers [stage * L / (PP * V), (stage + 1) * L / (PP * V)).

    Parameters: norm weights 1, biases and attention sinks 0; every other weight is built as
    the full (unsharded) float32 CPU tensor by its config init method, ``embedding_init_method`` for
    the word and position embeddings, ``output_layer_init_method`` for the attention
    projection and MLP fc2, ``init_method`` for the rest (megatron-core's roles; defaults
    Normal(0, std) and Normal(0, std / sqrt(2 L)), see ``TransformerConfig``), with the CPU
    generator seeded from (``seed``, its name in the one-chunk model), then sliced to this TP
    rank's shard (``partition_dim``, ``partition_stride``); with
    ``config.perform_initialization=False`` they are left as allocated (for a caller that
    loads weights). A tied output weight on a later stage is the word embeddings' tensor.
    Extras of this core (keyword-only): ``seed``, ``pp_rank`` (the pipeline rank,
    overriding ``pg_collection.pp``: several stages built in one process), and
    ``true_vocab_size``: ``vocab_size`` is the table's (padded, as megatron passes
    ``padded_vocab_size``: a multiple of TP) and ids >= ``true_vocab_size`` are padding:
    their logits are -inf (``exclude_padded_vocab``: never in the softmax, never sampled),
    their embedding and output rows start at zero and get zero gradient, and the true rows
    are drawn exactly as the unpadded model's, so loss and gradients equal the unpadded
    model's at any padding and TP. ``model.true_vocab_size`` (= ``vocab_size`` unpadded).

    Multi-token prediction (``mtp_block_spec``, from ``get_gpt_mtp_block_spec``; the last
    stage only): the depths ``mtp.layers.<k>`` and the last stage's copy of the word
    embeddings (its gradient summed with the first stage's by ``finalize_model_grads``);
    see ``megatron.core.transformer.multi_token_prediction``.

    Sequence parallelism: activations between the TP regions are sharded along s over TP;
    every parameter of the decoder that is not TP-split gets ``param.sequence_parallel =
    True`` (found by walking the parameters), so ``finalize_model_grads`` sums its gradient
    over TP. Parameters live on the communication device (CPU for gloo or no
    torch.distributed, the current CUDA device for nccl), or on CPU with
    ``use_cpu_initialization``. Dropout uses torch's generator (the RNG tracker's fork
    under SP): masks depend on the layout, so parity tests run with dropout 0; attention
    dropout is not applied.
    """

    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: Literal[
            "learned_absolute", "rope", "mrope", "yarn", "none"
        ] = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: Optional[float] = None,
        mtp_block_spec: Optional[ModuleSpec] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        vp_stage: Optional[int] = None,
        *,
        seed: int = 1234,
        pp_rank: Optional[int] = None,
        true_vocab_size: Optional[int] = None,
    ) -> None:
        super().__init__(config)
        check_mtp_placement(
            config, mtp_block_spec, pre_process, post_process, position_embedding_type
        )
        if config.fp32_residual_connection:
            raise NotImplementedError(
                "GPTModel: config.fp32_residual_connection=True is not supported"
            )
        if position_embedding_type not in ("learned_absolute", "rope", "yarn", "none"):
            raise NotImplementedError(
                f"GPTModel: position_embedding_type={position_embedding_type!r} is not "
                "supported; expected 'learned_absolute', 'rope', 'yarn' or 'none'"
            )
        check_yarn_fields(config, position_embedding_type)
        self.tp_group = tp_group_of(pg_collection, config)
        # resolved once; a mismatched CP group fails here, not mid-step
        self._cp_group = ResolvedGroup(cp_group_of, pg_collection, config)
        tp_size = get_pg_size(self.tp_group)
        if not isinstance(vocab_size, int) or vocab_size < 1 or vocab_size % tp_size:
            raise ValueError(
                f"GPTModel: vocab_size ({vocab_size!r}) must be a positive multiple of "
                f"tensor_model_parallel_size ({tp_size}); pad the vocabulary"
            )
        if true_vocab_size is None:
            true_vocab_size = vocab_size
        if not isinstance(true_vocab_size, int) or not 1 <= true_vocab_size <= vocab_size:
            raise ValueError(
                f"GPTModel: true_vocab_size ({true_vocab_size!r}) must be an integer in "
                f"[1, vocab_size ({vocab_size})]: the tokens the padded table holds"
            )
        if true_vocab_size < vocab_size and config.label_smoothing:
            raise NotImplementedError(
                f"GPTModel: label_smoothing={config.label_smoothing} with a padded vocabulary "
                f"(true_vocab_size {true_vocab_size} < vocab_size {vocab_size}) is not "
                "supported; expected label_smoothing=0 or an unpadded vocabulary"
            )
        self.transformer_layer_spec = transformer_layer_spec
        self.model_type = ModelType.encoder_or_decoder
        self.vocab_size = vocab_size
        self.true_vocab_size = true_vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.vp_stage = vp_stage
        self.pg_collection = pg_collection
        self.mtp_block_spec = mtp_block_spec
        self.mtp_process = mtp_block_spec is not None

        # The parts are built with megatron-core's keywords, one per line, like the layer
        # specs and the output projection: alike in shape, each names its own arguments.
        if pre_process or self.mtp_process:  # MTP embeds the tokens ahead
            self.embedding = LanguageModelEmbedding(
                config=config,
                vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                position_embedding_type=position_embedding_type,
                scatter_to_sequence_parallel=scatter_embedding_sequence_parallel,
                tp_group=self.tp_group,
            )
        if position_embedding_type == "rope" and not config.multi_latent_attention:
            self.rotary_pos_emb = rope_embedding(
                config,
                rotary_percent,
                rotary_base,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                rope_scaling=rope_scaling,
                rope_scaling_factor=rope_scaling_factor,
            )
        if position_embedding_type == "yarn":
            self.rotary_pos_emb = yarn_embedding(config, rotary_percent, rotary_base)
        if config.local_rotary_base is not None and hasattr(self, "rotary_pos_emb"):
            self.local_rotary_pos_emb = rope_embedding(
                config, rotary_percent, config.local_rotary_base
            )
        self.decoder = TransformerBlock(
            config=config,
            spec=transformer_layer_spec,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
            pp_rank=pp_rank,
        )
        bind_cp_group(self.decoder, cp_group_of(pg_collection, config))
        if self.mtp_process:
            self.mtp = MultiTokenPredictionBlock(
                config, mtp_block_spec, vp_stage, pg_collection, pp_rank=pp_rank
            )
            bind_cp_group(self.mtp, cp_group_of(pg_collection, config))
        holds_embedding = pre_process or self.mtp_process
        if post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size,
                vocab_size,
                config=config,
                init_method=leave_as_allocated,
                bias=False,
                skip_bias_add=False,
                gather_output=not parallel_output,
                skip_weight_param_allocation=holds_embedding
                and share_embeddings_and_output_weights,
                embedding_activation_buffer=None,
                grad_output_buffer=None,
                tp_group=self.tp_group,
            )
            self.output_layer.fp8_gemm = None  # the output layer stays in high precision
            if holds_embedding and share_embeddings_and_output_weights:
                # The tied weight also gets the embedding lookup's gradient through autograd;
                # adding the projection's into main_grad would make DDP skip that one.
                self.output_layer.gradient_accumulation_fusion = False
        self.to(
            torch.device("cpu") if config.use_cpu_initialization else comm_device(self.tp_group)
        )
        if config.perform_initialization:
            self._initialize_parameters(seed)
        self._mark_sequence_parallel_parameters()
        if share_embeddings_and_output_weights and (pre_process or post_process):
            self.shared_embedding_or_output_weight().shared_embedding = True
        if post_process and not pre_process and share_embeddings_and_output_weights:
            # The last stage's copy of the tied weight: counted once (on the first stage)
            # by gradient-norm and weight-decay bookkeeping, as megatron-core marks it.
            self.shared_embedding_or_output_weight().shared = True
        if self.mtp_process and not pre_process:
            # the MTP stage's copy of the word embeddings: its gradient is summed with the
            # first stage's (embedding group, finalize_model_grads), counted once
            self.embedding.word_embeddings.weight.shared = True
            self.embedding.word_embeddings.weight.shared_embedding = True

    def set_input_tensor(self, input_tensor: Union[Tensor, List[Tensor], None]) -> None:
        """Hidden states [s_local, b, h] from the previous stage (a tensor or a list of one)."""
        if not isinstance(input_tensor, (list, tuple)):
            input_tensor = [input_tensor]
        if len(input_tensor) != 1:
            raise ValueError(
                f"GPTModel.set_input_tensor: expected one input tensor, got {len(input_tensor)}"
            )
        self.decoder.set_input_tensor(input_tensor[0])

    def forward(
        self,
        input_ids: Optional[Tensor],
        position_ids: Optional[Tensor],
        attention_mask: Optional[Tensor] = None,
        decoder_input: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
        inference_context=None,
        packed_seq_params=None,
        extra_block_kwargs: Optional[dict] = None,
        runtime_gather_output: Optional[bool] = None,
        *,
        inference_params=None,
        loss_mask: Optional[Tensor] = None,
        padding_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """Run this chunk on this CP rank's shard (megatron-core's argument order).

        ``input_ids``, ``position_ids`` (GLOBAL positions) and ``labels`` are [b, s_local]
        (s_local = s / C, the load-balanced shard). ``attention_mask`` is ignored: causal
        masking by global position is built in. ``decoder_input`` [s_local, b, h] replaces
        the embedding lookup. Returns, on the last stage, per-token cross-entropy
        [b, s_local] (float32 or wider, unreduced, unmasked; label-smoothed by
        ``config.label_smoothing`` over the whole vocabulary) with ``labels``, logits
        [b, s_local, vocab / TP] (all of the vocabulary with ``parallel_output=False`` or
        ``runtime_gather_output=True``) without; on other stages the hidden states
        [s_local, b, h] ([s_local / TP, b, h] under sequence parallelism).
        ``packed_seq_params`` is handed to core attention. ``loss_mask`` [b, s_local] is read
        by multi-token prediction only (the returned main loss is unmasked: the loss callback
        masks); with ``mtp_block_spec`` and ``labels`` the MTP loss is attached to the
        returned loss's graph (``multi_token_prediction``). ``padding_mask`` [b, s_local]
        (True = padding; this CP rank's shard, like ``input_ids``) is given on every
        pipeline stage; MoE layers leave padding out of their router losses and counts. It
        is sharded like the hidden states (``shard_per_token_tensor``: over the model's TP
        group under sequence parallelism).
        """
        inference_context = inference_context if inference_context is not None else inference_params
        if decoder_input is None and self.pre_process:
            decoder_input = self._embed(input_ids, position_ids)
        if not self.pre_process and self.decoder.input_tensor is None:
            raise RuntimeError(
                "GPTModel.forward: this chunk has pre_process=False and no input tensor; call "
                "set_input_tensor with the previous stage's hidden states first"
            )
        if padding_mask is not None:
            block_kwargs = dict(extra_block_kwargs or {})
            block_kwargs["padding_mask"] = shard_per_token_tensor(
                padding_mask, self.tp_group, self.config.sequence_parallel
            )
            extra_block_kwargs = block_kwargs
        rotary_pos_emb = None
        rope = self.position_embedding_type in ("rope", "yarn")
        if rope and not self.config.multi_latent_attention:  # (MLA rotates inside its attention)
            rotary_pos_emb = self._layer_angles(
                input_ids, decoder_input, packed_seq_params, inference_context
            )
        hidden_states = self.decoder(
            hidden_states=decoder_input,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            **(extra_block_kwargs or {}),
        )
        if not self.post_process:
            return hidden_states
        if self.mtp_process and labels is not None and inference_context is None:
            hidden_states = attach_mtp_loss(
                self,
                hidden_states,
                (input_ids, position_ids, labels, loss_mask, padding_mask),
                dict(
                    attention_mask=attention_mask,
                    rotary_pos_emb=rotary_pos_emb,
                    packed_seq_params=packed_seq_params,
                ),
                runtime_gather_output,
            )
        logits, _ = self.output_layer(
            hidden_states,
            weight=(
                self.shared_embedding_or_output_weight()
                if self.share_embeddings_and_output_weights
                else None
            ),
            runtime_gather_output=runtime_gather_output,
        )
        logits = self.exclude_padded_vocab(softcapped(logits, self.config.final_logit_softcapping))
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)

    def _embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """The embedding lookup, times sqrt(hidden) with ``embedding_scale_sqrt_hidden``."""
        embedded = self.embedding(input_ids=input_ids, position_ids=position_ids)
        if self.config.embedding_scale_sqrt_hidden:
            embedded = embedded * embedding_scale(self.config.hidden_size, embedded)
        return embedded

    def exclude_padded_vocab(self, logits: Tensor) -> Tensor:
        """``logits`` [..., V / TP] (this rank's block) or [..., V] (gathered) with the padded
        columns (token ids >= ``true_vocab_size``) set to -inf: they take no probability in
        the softmax, so the loss and every gradient equal the unpadded model's, and their
        rows of the output weight get zero gradient. Unchanged without padding."""
        if self.true_vocab_size == self.vocab_size:
            return logits
        width = logits.shape[-1]
        start = 0 if width == self.vocab_size else get_pg_rank(self.tp_group) * width
        first_padded = self.true_vocab_size - start
        if first_padded >= width:
            return logits
        columns = torch.arange(width, device=logits.device)
        return logits.masked_fill(columns >= max(first_padded, 0), float("-inf"))

    def compute_language_model_loss(self, labels: Tensor, logits: Tensor) -> Tensor:
        """Per-token loss [b, s] from labels [b, s] and logits [s, b, V / TP] (or [s, b, V]
        when gathered): cross-entropy over the whole vocabulary, in float32 for
        half-precision logits unless ``fp16_lm_cross_entropy``;
        ``config.cross_entropy_loss_fusion``: the fused version, which reads half-precision
        logits directly and computes in float32."""
        tp_size = get_pg_size(self.tp_group)
        if tp_size > 1 and logits.shape[-1] == self.vocab_size:
            # Gathered logits: this rank's vocabulary block gives the same loss, and the
            # gather's backward keeps exactly this block's gradient.
            logits = logits.chunk(tp_size, dim=-1)[get_pg_rank(self.tp_group)]
        if self.config.cross_entropy_loss_fusion:
            loss = fused_vocab_parallel_cross_entropy(
                logits,
                labels.transpose(0, 1).contiguous(),
                self.tp_group,
                label_smoothing=self.config.label_smoothing,
            )
            return loss.transpose(0, 1).contiguous()
        if logits.element_size() < 4 and not self.fp16_lm_cross_entropy:
            logits = logits.float()
        loss = tensor_parallel.vocab_parallel_cross_entropy(
            logits,
            labels.transpose(0, 1).contiguous(),
            label_smoothing=self.config.label_smoothing,
            tp_group=self.tp_group,
        )
        return loss.transpose(0, 1).contiguous()

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[Dict] = None
    ) -> Dict[str, Any]:
        """This chunk's pieces for ``dist_checkpointing``, keyed like ``state_dict``; storage
        keys and boxes do not depend on the layout (megatron-core 0.16.1's scheme):

        - TP-split parameters are boxes along their ``partition_dim`` (fc1 of a gated MLP:
          two boxes, one per half), replica id (0, 0, dp_cp_rank);
        - parameters not split over TP are whole, replica id (0, tp_rank, dp_cp_rank), so
          exactly one rank writes each;
        - layers are stacked by their GLOBAL index on a prepended axis
          (``decoder.layers.<name>``, offset ``layer_number - 1``), norms under the spec's
          keys map (``self_attention.linear_qkv.layer_norm_weight``, ...);
        - the word embeddings and output weight may be loaded from a checkpoint of another
          padding (``allow_shape_mismatch``: the overlap is read);
        - LoRA adapters on some layers only are stored one layer at a time
          (``separate_partial_adapters``);
        - a tied output weight on a later stage than the embedding is stored as
          ``embedding.word_embeddings.weight`` with replica id (1, ...): never written
          twice, loaded from the embedding.
        - the MTP stage's copy of the word embeddings (``mtp.layers.<k>.*`` are whole on
          the last stage) likewise, with replica id (1, ...);
        - no ``output_layer._extra_state`` (megatron-core drops it: always empty).

        Groups: TP is the model's; DP x CP from ``metadata["dp_cp_group"]``, else
        ``pg_collection.dp_cp``, else ``parallel_state``'s (MPU fallback), else one rank.
        """
        from megatron.core.transformer.utils import module_sharded_state_dict

        metadata = dict(metadata or {})
        metadata.setdefault("tp_group", self.tp_group)
        if metadata.get("dp_cp_group") is None and self.pg_collection is not None:
            metadata["dp_cp_group"] = getattr(self.pg_collection, "dp_cp", None)
        sharded = module_sharded_state_dict(self, prefix, sharded_offsets, metadata)
        sharded.pop(f"{prefix}output_layer._extra_state", None)  # megatron-core stores none
        output_key = f"{prefix}output_layer.weight"
        if self.share_embeddings_and_output_weights and not self.pre_process:
            if output_key in sharded:
                tied = sharded[output_key]
                sharded[output_key] = dataclasses.replace(
                    tied,
                    key=f"{prefix}embedding.word_embeddings.weight",
                    replica_id=(1,) + tuple(tied.replica_id)[1:],
                )
        embedding_key = f"{prefix}embedding.word_embeddings.weight"
        if self.mtp_process and not self.pre_process and embedding_key in sharded:
            copy = sharded[embedding_key]  # the MTP stage's copy: loaded, never written
            sharded[embedding_key] = dataclasses.replace(
                copy, replica_id=(1,) + tuple(copy.replica_id)[1:]
            )
        for key in (embedding_key, output_key):
            piece = sharded.get(key)
            if piece is not None and hasattr(piece, "allow_shape_mismatch"):
                # the vocabulary's padding depends on TP: another padding loads the overlap
                # (the true rows; padded rows are zero on both sides)
                sharded[key] = dataclasses.replace(piece, allow_shape_mismatch=True)
        from megatron.core.transformer.lora import separate_partial_adapters

        separate_partial_adapters(self, sharded, prefix)  # LoRA adapters on some layers only
        return sharded

    def shared_embedding_or_output_weight(self) -> Optional[Tensor]:
        """The tied weight this chunk holds: word embeddings (first stage, and the MTP stage,
        which embeds too), output (last)."""
        if self.pre_process or self.mtp_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    @torch.no_grad()
    def _initialize_parameters(self, seed: int) -> None:
        """Fill every parameter with its shard of the full tensor its init method builds from
        the (seed, name) stream."""
        norms = (torch.nn.LayerNorm, torch.nn.RMSNorm)
        tp_size, tp_rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        experts = {}
        for module_name, module in self.named_modules():
            if hasattr(module, "initialize_experts"):
                experts[module_name] = module
        for module_name, module in experts.items():
            module.initialize_experts(self._expert_full_weight(module_name, seed))
        skip = {id(p) for module in experts.values() for p in module.parameters()}
        for module_name, module in self.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                if id(param) in skip:
                    continue
                name = self._reference_name(f"{module_name}.{param_name}")
                if isinstance(module, norms) and param_name == "weight":
                    param.fill_(0.0 if getattr(module, "zero_centered_gamma", False) else 1.0)
                elif param_name in ("bias", "softmax_offset"):  # attention sinks start at 0
                    param.zero_()
                else:
                    method = _init_method_for(name, self.config)
                    shape = _full_shape(param, tp_size)
                    padding = 0
                    if name in _VOCAB_PARAMETERS:  # the true rows as unpadded, padding zero
                        padding = shape[0] - self.true_vocab_size
                        shape = (self.true_vocab_size,) + tuple(shape[1:])
                    full = seeded_init(shape, seed, name, method)
                    if padding:
                        full = torch.cat([full, full.new_zeros((padding,) + shape[1:])])
                    param.copy_(tp_shard(full, param, tp_size, tp_rank))

    def _expert_full_weight(self, module_name: str, seed: int):
        """(projection, global expert, shape) -> the full float32 weight of that expert,
        drawn from the (seed, ``expert_weight_name``) stream: the same for every EP / ETP
        layout and for ``SequentialMLP`` and ``GroupedMLP``."""
        experts_name = self._reference_name(f"{module_name}.x")[: -len(".x")]

        def full_weight(projection: str, global_expert: int, shape) -> Tensor:
            name = expert_weight_name(experts_name, projection, global_expert)
            method = (
                self.config.output_layer_init_method
                if projection == "linear_fc2"
                else self.config.init_method
            )
            return seeded_init(shape, seed, name, method)

        return full_weight

    def _reference_name(self, name: str) -> str:
        """A parameter's name in the one-chunk model: layers numbered globally; a tied output
        weight named as the word embeddings."""
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(self.decoder.layers[int(parts[2])].layer_number - 1)
        if name == "output_layer.weight" and self.share_embeddings_and_output_weights:
            parts = ["embedding", "word_embeddings", "weight"]
        return ".".join(parts)

    def _mark_sequence_parallel_parameters(self) -> None:
        """Under SP, mark every decoder parameter not split over TP (norms, row-parallel
        biases, ...): its gradient comes from this rank's sequence shard only, and
        ``finalize_model_grads`` sums it over the TP group."""
        if not self.config.sequence_parallel or get_pg_size(self.tp_group) == 1:
            return
        parts = [self.decoder] + ([self.mtp] if self.mtp_process else [])
        for param in (p for part in parts for p in part.parameters()):
            expert = not getattr(param, "allreduce", True)  # reduced over expert DP instead
            whole = getattr(param, "grad_complete_over_tp", False)  # e.g. MLA's down projections
            if not getattr(param, "tensor_model_parallel", False) and not expert and not whole:
                param.sequence_parallel = True


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """The table size for ``vocab_size`` tokens: the next multiple of ``divisible_by`` x
    ``tp_size`` (megatron's ``--make-vocab-size-divisible-by`` rule), so each TP rank holds
    an equal block; pass it as ``vocab_size`` with ``true_vocab_size=vocab_size``."""
    for name, value in (("divisible_by", divisible_by), ("tp_size", tp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"padded_vocab_size: {name} must be a positive integer, got {value!r}")
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


# Parameters whose dim 0 is the (padded) vocabulary, by their one-chunk reference names.
_VOCAB_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")


def seeded_normal(shape, seed: int, name: str, std: float) -> Tensor:
    """Normal(0, std) values of ``shape`` drawn in float32 on CPU from the (seed, name)
    stream: the same whatever the layout, dtype or device."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(_stream_seed(seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)


def seeded_init(shape, seed: int, name: str, init_method) -> Tensor:
    """The full float32 CPU tensor of ``shape`` that ``init_method`` fills while the CPU
    generator is seeded from the (seed, name) stream (the caller's generator state is put
    back). For ``init_method_normal(std)`` these are ``seeded_normal``'s values."""
    full = torch.empty(shape, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_stream_seed(seed, name))
        init_method(full)
    return full


def _stream_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


_OUTPUT_LAYERS = (
    "self_attention.linear_proj.weight",
    "mlp.linear_fc2.weight",
    "shared_experts.linear_fc2.weight",
)
_EMBEDDINGS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")


def _init_method_for(name: str, config: TransformerConfig):
    """The config init method of the weight called ``name`` in the one-chunk model."""
    if name in _EMBEDDINGS:
        return config.embedding_init_method
    if name.endswith(_OUTPUT_LAYERS):
        return config.output_layer_init_method
    return config.init_method


def expert_weight_name(experts_name: str, projection: str, global_expert: int) -> str:
    """The name a routed expert's weight is seeded from: ``SequentialMLP``'s name with the
    GLOBAL expert index (``decoder.layers.<l>.mlp.experts.local_experts.<g>.<projection>
    .weight``), whatever the expert-parallel layout or expert module."""
    return f"{experts_name}.local_experts.{global_expert}.{projection}.weight"


def tp_shard(full: Tensor, param: Tensor, tp_size: int, tp_rank: int) -> Tensor:
    """This TP rank's slice of ``full``: cut along ``param.partition_dim`` into
    tp_size * stride blocks and keep blocks rank, rank + T, ... (megatron-core's strided
    split); the whole tensor for a parameter not split over TP."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    stride = getattr(param, "partition_stride", 1)
    return strided_shard(full, param.partition_dim, stride, tp_size, tp_rank)


def _full_shape(param: Tensor, tp_size: int) -> List[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return shape
