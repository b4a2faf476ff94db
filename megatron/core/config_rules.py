"""Rules on the parallel and model settings, shared by ``TransformerConfig`` /
``ModelParallelConfig`` and the trainer's ``validate_config`` (no torch import here, so the
trainer's launcher checks a command line without loading torch).

Each rule answers "is this setting valid" and, where there is a list of accepted values,
holds that list. The wording of the error is the caller's: the library names fields
(``num_attention_heads (6)``), the trainer names flags (``--num-attention-heads 6``).
"""

import math
from typing import List, Mapping, Optional, Sequence, Tuple, Union

CP_COMM_TYPES = ("all_gather", "p2p", "a2a", "a2a+p2p")
"""The context-parallel attention exchanges (megatron-core's ``cp_comm_type`` values)."""

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
"""The accepted ``normalization`` values."""

ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
"""megatron-core's ``AttnBackend`` names (``TransformerConfig.attention_backend``)."""


def is_positive_multiple(value: object, of: int) -> bool:
    """True when ``value`` is an int >= 1 and ``value % of == 0``."""
    return _is_int(value) and value >= 1 and value % of == 0


def tensor_parallel_misfits(tp: int, sizes: Mapping[str, object]) -> List[Tuple[str, object]]:
    """The (name, value) pairs of ``sizes`` that tensor parallelism cannot split: each size
    (attention heads, query groups, FFN hidden size, vocabulary) is divided evenly over the
    ``tp`` ranks, so it must be a positive multiple of ``tp``. Order is that of ``sizes``."""
    return [(name, value) for name, value in sizes.items() if not is_positive_multiple(value, tp)]


def sequence_parallel_allowed(sequence_parallel: bool, tp: int) -> bool:
    """Sequence parallelism splits the sequence over the TP ranks: it needs TP > 1."""
    return not sequence_parallel or tp > 1


def label_smoothing_allowed(label_smoothing: float) -> bool:
    """Label smoothing ``s`` mixes ``(1 - s)`` of the target with ``s`` of the uniform
    distribution: ``0 <= s < 1``."""
    return 0.0 <= label_smoothing < 1.0


def cp_comm_kinds(cp_comm_type: Union[None, str, Sequence[str]]) -> List[Optional[str]]:
    """``cp_comm_type`` as a list of kinds: one kind (or None) for every layer, or a per-layer
    list as given."""
    if isinstance(cp_comm_type, (list, tuple)):
        return list(cp_comm_type)
    return [cp_comm_type]


def unknown_cp_comm_types(cp_comm_type: Union[None, str, Sequence[str]]) -> List[object]:
    """The entries of ``cp_comm_type`` that are not in ``CP_COMM_TYPES`` (None is allowed:
    no context parallelism)."""
    return [k for k in cp_comm_kinds(cp_comm_type) if k is not None and k not in CP_COMM_TYPES]


def cp_comm_type_length_ok(cp_comm_type: Union[None, str, Sequence[str]], num_layers: int) -> bool:
    """One kind for every layer, or a list with exactly one entry per layer."""
    return not isinstance(cp_comm_type, (list, tuple)) or len(cp_comm_type) == num_layers


def hierarchical_sizes_valid(sizes: object) -> bool:
    """``hierarchical_context_parallel_sizes`` is a list (or tuple) of ints >= 1."""
    return isinstance(sizes, (list, tuple)) and all(_is_int(s) and s >= 1 for s in sizes)


def hierarchical_sizes_product(sizes: Sequence[int]) -> int:
    """The context-parallel size the levels span: the product of the sizes (they must
    multiply to ``context_parallel_size``; an empty list means no hierarchy)."""
    return math.prod(sizes)


def window_size_valid(window_size: object) -> bool:
    """``window_size`` (sliding-window attention, megatron-core's field) is None or a pair
    (left, right) of ints with left >= 0 or -1 (no limit) and right 0 or -1: attention is
    causal, so query i sees keys i - left .. i and never a later one."""
    if window_size is None:
        return True
    if not isinstance(window_size, (list, tuple)) or len(window_size) != 2:
        return False
    left, right = window_size
    return _is_int(left) and _is_int(right) and left >= -1 and right in (0, -1)


def window_left(window_size: Optional[Sequence[int]]) -> Optional[int]:
    """How many earlier keys a query sees under ``window_size`` (a valid one), or None when
    there is no limit (None, or left = -1)."""
    if window_size is None or window_size[0] == -1:
        return None
    return window_size[0]


def _is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)
