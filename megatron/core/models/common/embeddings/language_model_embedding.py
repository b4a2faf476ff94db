"""Token (vocab-parallel) and learned absolute-position embeddings of a language model."""

from typing import Literal, Optional

import torch
import torch.distributed as dist

from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule, leave_as_allocated
from megatron.core.transformer.transformer_config import TransformerConfig


class LanguageModelEmbedding(MegatronModule):
    """emb = word_embeddings[input_ids] (+ position_embeddings[position_ids]) as [s, b, h],
    then dropout; under sequence parallelism scattered along s over the TP group.

    ``word_embeddings`` is a ``VocabParallelEmbedding`` (rows split over TP);
    ``position_embeddings`` (learned_absolute only) an ordinary embedding replicated over TP.
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: Literal[
            "learned_absolute", "rope", "yarn", "none"
        ] = "learned_absolute",
        num_tokentypes: int = 0,
        scatter_to_sequence_parallel: bool = True,
        tp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__(config)
        if num_tokentypes:
            raise NotImplementedError("LanguageModelEmbedding: num_tokentypes > 0 is not supported")
        if position_embedding_type not in ("learned_absolute", "rope", "yarn", "none"):
            raise ValueError(
                "position_embedding_type must be 'learned_absolute', 'rope', 'yarn' or 'none', "
                f"got {position_embedding_type!r}"
            )
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        self.num_tokentypes = num_tokentypes
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        self.tp_group = tp_group
        self.reduce_scatter_embeddings = (
            not self.add_position_embedding
            and config.sequence_parallel
            and scatter_to_sequence_parallel
        )
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            num_embeddings=vocab_size,
            embedding_dim=config.hidden_size,
            init_method=leave_as_allocated,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings,
            config=config,
            tp_group=tp_group,
        )
        if self.add_position_embedding:
            self.position_embeddings = torch.nn.Embedding(  # allocated, not drawn
                max_sequence_length,
                config.hidden_size,
                _weight=torch.empty(
                    max_sequence_length, config.hidden_size, dtype=config.params_dtype
                ),
            )
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, tokentype_ids: int = None
    ) -> torch.Tensor:
        """[b, s] token ids and (global) positions -> [s, b, h] ([s / TP, b, h] under SP)."""
        embeddings = self.word_embeddings(input_ids)
        if self.add_position_embedding:
            embeddings = embeddings + self.position_embeddings(position_ids)
        if not self.reduce_scatter_embeddings:  # else the lookup returned [s / TP, b, h]
            embeddings = embeddings.transpose(0, 1).contiguous()
            if self.config.sequence_parallel and self.scatter_to_sequence_parallel:
                embeddings = tensor_parallel.scatter_to_sequence_parallel_region(
                    embeddings, group=self.tp_group
                )
        if self.config.sequence_parallel and self.training and self.embedding_dropout.p > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.embedding_dropout(embeddings)
        return self.embedding_dropout(embeddings)
