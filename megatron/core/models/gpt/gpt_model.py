"""A small GPT whose pipeline chunks and context-parallel shards compute exactly what the
one-process model computes.

Embeddings (first stage) -> pre-norm transformer layers -> final norm and output layer (last
stage). Every parameter is drawn from its own generator, seeded from (seed, global layer,
parameter name), so any split of the layers over pipeline chunks holds the same weights.
"""

import hashlib
from typing import List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.context_parallel import cp_size_and_rank, mpu_context_parallel_group
from megatron.core.device import comm_device
from megatron.core.enums import ModelType
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.no_init import NoInitEmbedding, NoInitLinear
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig


class GPTModel(nn.Module):
    """Decoder-only language model chunk (no dropout, no tensor parallelism).

    Chunk ``vp_stage`` on pipeline rank p is virtual stage vp_stage * PP + p and holds the
    global layers [stage * L / (PP * V), (stage + 1) * L / (PP * V)). The pipeline rank comes
    from ``pp_rank`` if given, else ``pg_collection.pp``, else ``parallel_state`` (MPU
    fallback), else 0. The CP group of a step is ``pg_collection.cp`` when a collection is
    given, else ``parallel_state``'s (MPU fallback, resolved at every forward), else none.
    Parameters: Normal(0, init_method_std) weights, zero biases, unit LayerNorm weights, each
    from a generator seeded by (seed, scope, name); ``config.init_method`` is not used. They
    are created in ``config.params_dtype`` on the communication device (CPU for gloo or no
    torch.distributed, the current CUDA device for nccl), or on CPU with
    ``use_cpu_initialization``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        share_embeddings_and_output_weights: bool = False,
        vp_stage: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        seed: int = 1234,
        *,
        pp_rank: Optional[int] = None,
    ) -> None:
        super().__init__()
        _check_supported(config, pg_collection)
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.vp_stage = vp_stage
        self.pg_collection = pg_collection
        self.input_tensor: Optional[torch.Tensor] = None

        device = torch.device("cpu") if config.use_cpu_initialization else comm_device()
        dtype = config.params_dtype
        self.embedding = (
            LanguageModelEmbedding(config, vocab_size, max_sequence_length, device, dtype)
            if pre_process
            else None
        )
        self.decoder = TransformerBlock(
            config,
            post_process=post_process,
            vp_stage=vp_stage,
            pp_rank=_explicit_pipeline_rank(config, pg_collection, pp_rank),
            device=device,
            dtype=dtype,
        )
        owns_output_weight = post_process and not (
            share_embeddings_and_output_weights and pre_process
        )
        self.output_layer = (
            NoInitLinear(
                config.hidden_size,
                vocab_size,
                bias=False,
                device=device,
                dtype=dtype,
                gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            )
            if owns_output_weight
            else None
        )
        self._initialize_parameters(seed)
        if share_embeddings_and_output_weights and (pre_process or post_process):
            self.shared_embedding_or_output_weight().shared_embedding = True
        if self.output_layer is not None and share_embeddings_and_output_weights:
            # The last stage's copy of the tied weight: counted once (on the first stage)
            # by gradient-norm and weight-decay bookkeeping, as megatron-core marks it.
            self.output_layer.weight.shared = True

    def set_input_tensor(self, input_tensor: Union[torch.Tensor, List[torch.Tensor], None]) -> None:
        """Hidden states [s_local, b, h] from the previous stage (a tensor or a list of one)."""
        if not isinstance(input_tensor, (list, tuple)):
            input_tensor = [input_tensor]
        if len(input_tensor) != 1:
            raise ValueError(
                f"GPTModel.set_input_tensor: expected one input tensor, got {len(input_tensor)}"
            )
        self.input_tensor = input_tensor[0]

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor] = None,
        decoder_input: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        inference_context=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """Run this chunk on this CP rank's shard (megatron-core's argument order).

        ``input_ids``, ``position_ids`` (GLOBAL positions) and ``labels`` are [b, s_local].
        ``attention_mask`` is accepted and ignored: causal masking by global position is
        built in. ``decoder_input`` [s_local, b, h], when given on the first stage, replaces
        the embedding lookup. Returns, on the last stage, per-token cross-entropy
        [b, s_local] (float32 or wider, unreduced, unmasked) with ``labels``, logits
        [b, s_local, vocab] without; on other stages the hidden states [s_local, b, h].
        Inference contexts and packed sequences are not supported (a clear error).
        """
        for name, value in (
            ("inference_context", inference_context),
            ("packed_seq_params", packed_seq_params),
        ):
            if value is not None:
                raise NotImplementedError(f"GPTModel.forward: {name} is not supported; pass None")
        cp_group = self._cp_group()
        if self.pre_process and decoder_input is not None:
            hidden_states = decoder_input
        elif self.pre_process:
            hidden_states = self.embedding(input_ids, position_ids)
        elif self.input_tensor is None:
            raise RuntimeError(
                "GPTModel.forward: this chunk has pre_process=False and no input tensor; call "
                "set_input_tensor with the previous stage's hidden states first"
            )
        else:
            hidden_states = self.input_tensor
        hidden_states = self.decoder(hidden_states, cp_group)
        if not self.post_process:
            return hidden_states
        if self.output_layer is not None:  # fused with gradient_accumulation_fusion
            logits = self.output_layer(hidden_states).transpose(0, 1)
        else:  # tied, on the stage that also embeds: the word embeddings project
            weight = self.embedding.word_embeddings.weight
            logits = nn.functional.linear(hidden_states, weight).transpose(0, 1)
        if labels is None:
            return logits.contiguous()
        return per_token_cross_entropy(logits, labels)

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """The tied weight this chunk holds: word embeddings (first stage), output (last)."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def _cp_group(self) -> Optional[dist.ProcessGroup]:
        """This step's CP group: ``pg_collection.cp``, else the MPU fallback; checked
        against ``config.context_parallel_size``."""
        if self.pg_collection is not None:
            group = self.pg_collection.cp
        else:
            group = mpu_context_parallel_group()
        cp_size = cp_size_and_rank(group)[0]
        if cp_size != self.config.context_parallel_size:
            raise ValueError(
                f"GPTModel: the context-parallel group has {cp_size} rank(s) but "
                f"config.context_parallel_size is {self.config.context_parallel_size}"
            )
        return group

    @torch.no_grad()
    def _initialize_parameters(self, seed: int) -> None:
        """Seed every parameter from (seed, scope, name); scopes are layout-independent.

        The untied last-stage copy of a tied output weight uses the word embeddings' seed.
        """
        std = self.config.init_method_std
        if self.embedding is not None:
            seeded_init_(self.embedding, seed, "embedding", std)
        for layer in self.decoder.layers:
            seeded_init_(layer, seed, f"layer{layer.layer_number}", std)
        if self.decoder.final_layernorm is not None:
            seeded_init_(self.decoder.final_layernorm, seed, "final_layernorm", std)
        if self.output_layer is not None:
            if self.share_embeddings_and_output_weights:
                scope, name = "embedding", "word_embeddings.weight"
            else:
                scope, name = "output_layer", "weight"
            _fill_normal_(self.output_layer.weight, seed, scope, name, std)


class LanguageModelEmbedding(nn.Module):
    """Learned token and absolute-position embeddings.

    emb = word_embeddings[input_ids] + position_embeddings[position_ids], as [s, b, h].
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = NoInitEmbedding(vocab_size, hidden, device=device, dtype=dtype)
        self.position_embeddings = NoInitEmbedding(
            max_sequence_length, hidden, device=device, dtype=dtype
        )

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """[b, s] token ids and global positions -> [s, b, h]."""
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return embeddings.transpose(0, 1).contiguous()


def per_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """loss[b, t] = logsumexp(logits[b, t]) - logits[b, t, labels[b, t]], unreduced.

    Computed in float32 for half-precision logits, in the logits' dtype otherwise.
    """
    if logits.element_size() < 4:
        logits = logits.float()
    losses = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
    )
    return losses.view(labels.shape)


@torch.no_grad()
def seeded_init_(module: nn.Module, seed: int, scope: str, std: float) -> None:
    """Initialize ``module``'s parameters in place, independently of the global RNG.

    LayerNorm: weight 1, bias 0; other biases 0; other weights Normal(0, std) drawn from
    the generator of (seed, scope, parameter name relative to ``module``).
    """
    for module_name, submodule in module.named_modules():
        for param_name, param in submodule.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(submodule, nn.LayerNorm) and param_name == "weight":
                param.fill_(1.0)
            elif param_name == "bias":
                param.zero_()
            else:
                _fill_normal_(param, seed, scope, name, std)


@torch.no_grad()
def _fill_normal_(param: torch.Tensor, seed: int, scope: str, name: str, std: float) -> None:
    """param <- Normal(0, std) drawn in float32 on CPU from the (seed, scope, name) stream.

    Drawing in float32 on CPU makes the values independent of the parameter's dtype/device.
    """
    generator = torch.Generator(device="cpu")
    digest = hashlib.sha256(f"{seed}/{scope}/{name}".encode()).digest()
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    param.copy_(values)


def _check_supported(config: TransformerConfig, pg_collection) -> None:
    """Reject layouts this model does not implement, before anything is built."""
    if config.tensor_model_parallel_size > 1:
        raise NotImplementedError(
            "GPTModel does not implement tensor parallelism: got "
            f"config.tensor_model_parallel_size={config.tensor_model_parallel_size}, expected 1"
        )
    if pg_collection is not None and pg_collection.cp is None and config.context_parallel_size > 1:
        raise ValueError(
            "GPTModel: pg_collection has no cp group but config.context_parallel_size is "
            f"{config.context_parallel_size}; pass pg_collection.cp"
        )


def _explicit_pipeline_rank(
    config: TransformerConfig, pg_collection, pp_rank: Optional[int]
) -> Optional[int]:
    """The pipeline rank given by the caller (``pp_rank``, else ``pg_collection.pp``).

    None means no explicit rank: the layer offset then uses the MPU fallback.
    """
    if pp_rank is not None or pg_collection is None:
        return pp_rank
    pp_size = config.pipeline_model_parallel_size
    if pg_collection.pp is None:
        if pp_size == 1:
            return 0
        raise ValueError(
            "GPTModel: pg_collection has no pp group but config.pipeline_model_parallel_size "
            f"is {pp_size}; pass pg_collection.pp or pp_rank"
        )
    group_size = dist.get_world_size(group=pg_collection.pp)
    if group_size != pp_size:
        raise ValueError(
            f"GPTModel: pg_collection.pp has {group_size} rank(s) but "
            f"config.pipeline_model_parallel_size is {pp_size}"
        )
    return dist.get_rank(group=pg_collection.pp)
