"""Index builders for the GPT and blended datasets, in numpy (no compiled extension).

megatron-core ships these as C++ (``helpers.cpp``, built by ``compile_helpers``). The sample
index is a prefix-sum plus binary search, which numpy does in bulk; the blending indices are
a greedy sequential rule (each step depends on the counts so far), kept as a short Python loop.
The results are the same arrays megatron-core builds, so a dataset samples identically.
"""

import math

import numpy


def build_sample_idx(
    sizes: numpy.ndarray,
    document_indices: numpy.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
) -> numpy.ndarray:
    """The ``[num_samples + 1, 2]`` sample index over the flattened document stream.

    Documents are concatenated in ``document_indices`` order; sample ``i`` starts at stream
    position ``q_i = i * sequence_length`` and covers ``sequence_length + e`` tokens (``e = 1``
    with the extra token). Row ``i`` is ``(d, q_i - start_d)`` where ``d`` is the first
    document whose end reaches ``q_i + e``; row 0 is ``(0, 0)``. A final partial sample that
    runs past the stream's end (``drop_last_partial_sequence=False``) ends at
    ``(last, len_last - e)``.
    """
    if sequence_length <= 1:
        raise ValueError(f"sequence_length={sequence_length}: expected > 1")
    if num_epochs <= 0:
        raise ValueError(f"num_epochs={num_epochs}: expected > 0")
    extra = 1 if add_extra_token_to_sequence else 0
    usable = num_epochs * tokens_per_epoch - extra
    if drop_last_partial_sequence:
        num_samples = usable // sequence_length
    else:
        num_samples = math.ceil(usable / sequence_length)
    top = max(document_indices.shape[0], int(sizes.max()) if sizes.size else 0)
    dtype = numpy.int32 if top <= numpy.iinfo(numpy.int32).max else numpy.int64

    lengths = sizes[document_indices].astype(numpy.int64)
    ends = numpy.cumsum(lengths)
    starts = ends - lengths
    positions = numpy.arange(num_samples + 1, dtype=numpy.int64) * sequence_length
    docs = numpy.searchsorted(ends, positions + extra, side="left")
    past_end = docs >= lengths.shape[0]
    docs = numpy.minimum(docs, lengths.shape[0] - 1)
    offsets = positions - starts[docs]
    offsets[past_end] = lengths[-1] - extra
    sample_idx = numpy.stack([docs, offsets], axis=1).astype(dtype)
    sample_idx[0] = 0
    return sample_idx


def build_blending_indices(
    dataset_index: numpy.ndarray,
    dataset_sample_index: numpy.ndarray,
    weights: numpy.ndarray,
    num_datasets: int,
    size: int,
    verbose: bool,
) -> None:
    """Fill ``dataset_index``/``dataset_sample_index`` (in place) for a weighted blend.

    Greedy: sample ``i`` goes to the dataset with the largest lag
    ``w_k * max(i, 1) - n_k`` (first one on ties), where ``n_k`` counts its samples so far.
    """
    w = [float(x) for x in weights[:num_datasets]]
    counts = [0] * num_datasets
    for i in range(size):
        best = _most_behind(w, counts, range(num_datasets), max(float(i), 1.0))
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    if verbose:
        print(" > sample ratios:", [c / max(size, 1) for c in counts])


def build_exhaustive_blending_indices(
    dataset_index: numpy.ndarray,
    dataset_sample_index: numpy.ndarray,
    sizes: numpy.ndarray,
    num_datasets: int,
) -> None:
    """Blend taking exactly ``sizes[k]`` samples from dataset ``k`` (in place).

    Same greedy lag rule with ``w_k = sizes[k] / sum(sizes)``, over datasets not yet spent.
    """
    sizes_list = [int(s) for s in sizes[:num_datasets]]
    total = sum(sizes_list)
    w = [s / total for s in sizes_list]
    counts = [0] * num_datasets
    unspent = [k for k in range(num_datasets) if sizes_list[k] > 0]
    i = 0
    while unspent:
        best = _most_behind(w, counts, unspent, max(float(i), 1.0))
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
        if counts[best] == sizes_list[best]:
            unspent.remove(best)
        i += 1


def _most_behind(weights, counts, candidates, scale: float) -> int:
    """The candidate k with the largest lag ``weights[k] * scale - counts[k]`` (the first one
    on ties)."""
    best, best_err = -1, -math.inf
    for k in candidates:
        err = weights[k] * scale - counts[k]
        if err > best_err:
            best, best_err = k, err
    return best
