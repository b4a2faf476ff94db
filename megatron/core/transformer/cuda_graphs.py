"""megatron-core's ``megatron.core.transformer.cuda_graphs``: the pipeline-order helpers.

This core does not capture CUDA graphs (``TransformerConfig`` refuses ``enable_cuda_graph``
and ``external_cuda_graph``); what lives here are the two pure functions that turn a
schedule into the order in which graphs would be replayed, which megatron-core's schedule
tests check against ``schedules.get_schedule_table`` / ``get_pp_rank_microbatches``.

Order format: an entry c > 0 is a forward of model chunk c (1-based), an entry -c the
backward of chunk c; after ``get_overlap_moe_expert_parallel_comm_order`` the entries are
layer ids (1-based, counted over all chunks), and x - 0.5 marks the weight-gradient pass of
layer x's backward.
"""

from typing import List, Optional, Sequence, Tuple

__all__ = ["convert_schedule_table_to_order", "get_overlap_moe_expert_parallel_comm_order"]


def convert_schedule_table_to_order(
    num_warmup_microbatches: int, num_model_chunks: int, schedule_table: Sequence[Tuple[int, int]]
) -> List[int]:
    """The forward/backward order of one pipeline rank from its ``(microbatch, chunk)``
    schedule table: the first W = ``num_warmup_microbatches`` forwards, then forward k
    followed by backward k - W for each remaining k, then the last W backwards.

    Forward k of chunk v is ``v + 1``; backward k runs the table's k-th entry mirrored,
    chunk V - 1 - v, written ``-(V - v)`` (V = ``num_model_chunks``).
    """
    chunks = [chunk for _, chunk in schedule_table]
    forwards = [chunk + 1 for chunk in chunks]
    backwards = [chunk - num_model_chunks for chunk in chunks]
    warmup = num_warmup_microbatches
    order = forwards[:warmup]
    for k in range(warmup, len(forwards)):
        order += [forwards[k], backwards[k - warmup]]
    if warmup > 0:
        order += backwards[len(backwards) - warmup :]
    return order


def get_overlap_moe_expert_parallel_comm_order(
    order: Sequence[int], num_layers_per_chunk: Sequence[int], capture_wgrad_graph: bool
) -> Tuple[List[float], List[Optional[List[int]]]]:
    """Expand a chunk-wise ``order`` into a layer-wise one, so that the layers of a forward
    and of a backward that run side by side in the steady phase can interleave.

    Chunk c holds layers ``o_c + 1 .. o_c + n_c`` (``n`` = ``num_layers_per_chunk``,
    ``o_c`` the layers of the chunks before it). Warm-up forwards (before the first
    backward) list their layers in order; in the steady phase each (backward, forward) pair
    alternates layer i of the forward then layer i of the backward (the backward's layers
    run last to first); cool-down backwards list their layers. With
    ``capture_wgrad_graph`` each backward layer x is followed by its weight-gradient pass
    ``x - 0.5`` (in the steady phase the last one after the pair). Returns the new order and,
    per entry, ``[chunk index (0-based), layer index within the chunk]`` for a forward or
    None for a backward.
    """
    first_layer = [sum(num_layers_per_chunk[:c]) for c in range(len(num_layers_per_chunk))]

    def layers(entry: int) -> List[int]:
        chunk = abs(entry) - 1
        start, count = first_layer[chunk], num_layers_per_chunk[chunk]
        if entry > 0:
            return list(range(start + 1, start + count + 1))
        return list(range(-(start + count), -start))

    new_order: List[float] = []
    owners: List[Optional[List[int]]] = []

    def add(entry: int, layer: float, index: int = 0) -> None:
        new_order.append(layer)
        owners.append([entry - 1, index] if entry > 0 else None)

    backward_at = [i for i, entry in enumerate(order) if entry < 0]
    forward_at = [i for i, entry in enumerate(order) if entry > 0]
    first_backward = backward_at[0] if backward_at else len(order)
    last_forward = forward_at[-1] if forward_at else -1

    for entry in order[:first_backward]:
        for index, layer in enumerate(layers(entry)):
            add(entry, layer, index)

    steady = order[first_backward : last_forward + 1]
    for backward, forward in zip(steady[0::2], steady[1::2]):
        b_layers, f_layers = layers(backward), layers(forward)
        for index in range(max(len(b_layers), len(f_layers))):
            if index < len(f_layers):
                add(forward, f_layers[index], index)
            if index < len(b_layers):
                add(backward, b_layers[index])
                if capture_wgrad_graph and index < len(b_layers) - 1:
                    add(backward, b_layers[index] - 0.5)
        if capture_wgrad_graph and b_layers:
            add(backward, b_layers[-1] - 0.5)

    for entry in order[max(last_forward + 1, first_backward) :]:
        for layer in layers(entry):
            add(entry, layer)
            if capture_wgrad_graph:
                add(entry, layer - 0.5)
    return new_order, owners
