"""Names of GPT chunk parameters in the one-chunk (PP=1) model, for the GPT tests."""

from typing import Iterator, Tuple

import torch

from megatron.core.models.gpt import GPTModel


def reference_names(chunk: GPTModel) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """(name in the one-chunk model, parameter): layers renumbered globally, the last
    stage's copy of a tied output weight named as the word embeddings."""
    for name, param in chunk.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number - 1)
        if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
            parts = ["embedding", "word_embeddings", "weight"]
        yield ".".join(parts), param
