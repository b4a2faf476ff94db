"""The key/value cache of one batch of sequences decoded together (megatron-core 0.16.1's
``StaticInferenceContext``: ``max_batch_size``, ``max_sequence_length``,
``sequence_len_offset``, ``batch_size_offset``, ``key_value_memory_dict``).

``GPTModel.forward(..., inference_context=ctx)`` on tokens at positions
[``sequence_len_offset``, ``sequence_len_offset`` + s) stores each layer's keys and values
at those positions (``key_value_memory_dict[layer_number]`` = (keys, values), each
[max_sequence_length, b, groups / TP, head dim]; multi-latent attention's: heads / TP, its
values zero-padded to the keys' head dim) and attends over everything cached so far;
the caller then advances ``sequence_len_offset`` by s (``increment_sequence_len_offset``).

Ours beyond megatron-core's: ``enable_static_decode`` keeps the offset on the device too, so
that a decoding step (one token) has the same shapes and reads its offset from memory at
every position, and can be captured as a CUDA graph (``megatron.training.generate
--enable-cuda-graph``): its keys and values are written at the device offset and it attends
over the whole buffer, masked past the offset (``attention.cached_attention``).
"""

from typing import Dict, Optional, Tuple

import torch

from megatron.core.transformer.utils import check_one_token_per_forward


class StaticInferenceContext:
    """A key/value cache for up to ``max_batch_size`` sequences of ``max_sequence_length``
    tokens (prompt and generated together)."""

    def __init__(self, max_batch_size: int, max_sequence_length: int) -> None:
        for name, value in (("max_batch_size", max_batch_size),
                            ("max_sequence_length", max_sequence_length)):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"StaticInferenceContext: {name} must be >= 1, got {value!r}")
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.decode_mode = False
        self.static_offset: Optional[torch.Tensor] = None  # enable_static_decode

    def is_static_batching(self) -> bool:
        return True

    def is_decode_only(self) -> bool:
        """True once the prompt is in the cache (one new token per step)."""
        return self.decode_mode

    def enable_prefill_mode(self) -> None:
        self.decode_mode = False

    def enable_decode_mode(self) -> None:
        self.decode_mode = True

    def increment_sequence_len_offset(self, length: int) -> None:
        """Advance past ``length`` tokens just run."""
        self.sequence_len_offset += length
        if self.static_offset is not None:
            self.static_offset.add_(length)

    def enable_static_decode(self, device: torch.device) -> None:
        """(Ours) From now on every forward runs one token, and the offset is also the device
        tensor ``static_offset`` [1], which ``store`` and ``offset_rows`` read instead of the
        integer (module docstring). The prompt must already be in the cache."""
        if not self.key_value_memory_dict:
            raise ValueError(
                "StaticInferenceContext.enable_static_decode: the cache is empty; run the "
                "prompt through it first"
            )
        self.static_offset = torch.tensor([self.sequence_len_offset], device=device)

    def reset(self) -> None:
        """Forget every cached sequence (the buffers are kept for the next batch)."""
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.decode_mode = False
        self.static_offset = None

    def store(
        self, layer_number: int, key: torch.Tensor, value: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Put ``key`` / ``value`` [s, b, g, d_k] / [s, b, g, d_v] at the current offset of
        layer ``layer_number``'s cache; the layer's keys and values for every position so
        far."""
        s, b = key.shape[:2]
        end = self.sequence_len_offset + s
        if end > self.max_sequence_length or b > self.max_batch_size:
            raise ValueError(
                f"StaticInferenceContext: {end} tokens x batch {b} exceed max_sequence_length "
                f"{self.max_sequence_length} / max_batch_size {self.max_batch_size}"
            )
        cache = self.key_value_memory_dict.get(layer_number)
        if cache is None or any(
            kept.shape[1:] != (self.max_batch_size, *new.shape[2:])
            for kept, new in zip(cache, (key, value))
        ):
            cache = tuple(
                new.new_zeros(self.max_sequence_length, self.max_batch_size, *new.shape[2:])
                for new in (key, value)
            )
            self.key_value_memory_dict[layer_number] = cache
        keys, values = cache
        if self.static_offset is not None:  # the whole buffers: the caller masks past it
            check_one_token_per_forward(s)
            keys[:, :b].index_copy_(0, self.static_offset, key)
            values[:, :b].index_copy_(0, self.static_offset, value)
            return keys[:, :b], values[:, :b]
        keys[self.sequence_len_offset : end, :b] = key
        values[self.sequence_len_offset : end, :b] = value
        return keys[:end, :b], values[:end, :b]
