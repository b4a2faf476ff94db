"""Rules on the parallel and model settings, shared by ``TransformerConfig`` /
``ModelParallelConfig`` and the trainer's ``validate_config`` (no torch import here, so the
trainer's launcher checks a command line without loading torch).

Each rule answers "is this setting valid" and, where there is a list of accepted values,
holds that list. The wording of the error is the caller's: the library names fields
(``num_attention_heads (6)``), the trainer names flags (``--num-attention-heads 6``).
"""

import math
from typing import Callable, List, Mapping, Optional, Sequence, Tuple, Union

CP_COMM_TYPES = ("all_gather", "p2p", "a2a", "a2a+p2p")
"""The context-parallel attention exchanges (megatron-core's ``cp_comm_type`` values)."""

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
"""The accepted ``normalization`` values."""

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")
"""``recompute_modules`` entries implemented here (megatron-core 0.16.1's names)."""
RECOMPUTE_MODULES_MCORE_ONLY = ("moe_act", "mla_up_proj", "moe", "shared_experts")
"""megatron-core's other entries: MoE-part recomputation and multi-latent attention, which
this core lacks."""

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


def recompute_problems(
    granularity: Optional[str],
    method: Optional[str],
    num_layers: Optional[int],
    modules: Optional[Sequence[str]],
    layers_per_stage: int,
    name: Callable[[str], str] = str,
) -> List[str]:
    """What is wrong with a recompute setting (megatron-core 0.16.1's checks, plus a
    ``recompute_method`` / ``recompute_num_layers`` that would be ignored); ``name`` turns a
    field name into the caller's wording (a field, or a trainer flag)."""
    g, m, n, mods = (
        name("recompute_granularity"),
        name("recompute_method"),
        name("recompute_num_layers"),
        name("recompute_modules"),
    )
    if granularity is None:
        out = []
        if method is not None:
            out.append(f"{m}={method!r} needs {g}='full' (got {g}=None)")
        if num_layers is not None:
            out.append(f"{n}={num_layers!r} needs {g}='full' (got {g}=None)")
        return out
    if granularity not in RECOMPUTE_GRANULARITIES:
        return [f"{g}={granularity!r}; expected 'full' or 'selective'"]
    if granularity == "selective":
        out = []
        if method is not None:
            out.append(f"{m}={method!r} is only used with {g}='full' (got 'selective')")
        if num_layers is not None:
            out.append(f"with {g}='selective', {n} must be None (got {num_layers!r})")
        for module in modules or ():
            if module in RECOMPUTE_MODULES_MCORE_ONLY:
                out.append(
                    f"{mods} entry {module!r} needs MoE recomputation / multi-latent "
                    "attention, which this core does not implement (recompute_granularity="
                    "'full' recomputes MoE layers)"
                )
            elif module not in RECOMPUTE_MODULES:
                out.append(f"{mods} entry {module!r}; expected some of {RECOMPUTE_MODULES}")
        return out
    if method not in RECOMPUTE_METHODS:
        return [f"{m}={method!r}; with {g}='full' it must be 'uniform' or 'block'"]
    if not (_is_int(num_layers) and num_layers >= 1):
        return [
            f"{n}={num_layers!r}; with {g}='full' it must be an int between 1 and "
            f"num_layers_per_pipeline_rank ({layers_per_stage}; larger values recompute every "
            "layer of a stage)"
        ]
    return []


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


SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
# The cp_comm_types that compute a sliding window at CP > 1 (the registry's strategies with
# ``sliding_window``; asserted equal in ``cp_attention/registry.py``).
WINDOWED_CP_COMM_TYPES = ("a2a",)


def window_attn_skip_freq_valid(freq: object, num_layers: int) -> bool:
    """``window_attn_skip_freq`` (megatron-core's field) is None (every layer has the
    window), an int >= 1 (every freq-th layer, 1-based, has full attention) or one 0/1 per
    layer (1: the window, 0: full attention)."""
    if freq is None:
        return True
    if _is_int(freq):
        return freq >= 1
    return (
        isinstance(freq, (list, tuple))
        and len(freq) == num_layers
        and all(_is_int(x) and x in (0, 1) for x in freq)
    )


def window_attn_skip_freq_problems(freq: object, window_size: object, num_layers: int) -> List[str]:
    """What is wrong with ``window_attn_skip_freq`` (its value, and the window it picks
    layers for), each message naming the field, its value and what was expected."""
    if freq is None:
        return []
    if not window_attn_skip_freq_valid(freq, num_layers):
        return [
            f"window_attn_skip_freq={freq!r}; expected None, an int >= 1 or a list of "
            f"num_layers ({num_layers}) values 0 (full attention) or 1 (sliding window)"
        ]
    if window_left(window_size) is None:
        return [
            f"window_attn_skip_freq={freq!r} needs window_size (LEFT, 0) with LEFT >= 0 (it "
            f"says which layers keep the sliding window), got window_size={window_size!r}"
        ]
    return []


def is_window_layer(window_size, freq, layer_number: int) -> bool:
    """Whether global layer ``layer_number`` (1-based) has ``window_size``'s sliding window,
    as megatron-core's ``is_layer_window_attention``: all layers when ``freq`` is None, all
    but every freq-th for an int, entry layer_number - 1 of a list."""
    if window_left(window_size) is None:
        return False
    if freq is None:
        return True
    if _is_int(freq):
        return layer_number % freq != 0
    return bool(freq[layer_number - 1])


def layer_window_size(window_size, freq, layer_number: int) -> Optional[Tuple[int, int]]:
    """The ``window_size`` of global layer ``layer_number``: None for a full-attention one."""
    if not is_window_layer(window_size, freq, layer_number):
        return None
    return tuple(window_size)


def unwindowed_cp_layers(
    window_size, skip_freq, cp_comm_type, num_layers: int
) -> List[Tuple[int, Optional[str]]]:
    """(layer number, its cp_comm_type) of the layers with a sliding window whose
    cp_comm_type cannot compute it at CP > 1."""
    kinds = cp_comm_kinds(cp_comm_type)
    out = []
    for layer in range(1, num_layers + 1):
        kind = kinds[layer - 1] if len(kinds) == num_layers else kinds[0]
        windowed = is_window_layer(window_size, skip_freq, layer)
        if windowed and (kind or "all_gather") not in WINDOWED_CP_COMM_TYPES:
            out.append((layer, kind))
    return out


def gpt_oss_problems(
    softmax_type: object,
    glu_linear_offset: object,
    clamp: object,
    gated: bool,
) -> List[str]:
    """What is wrong with the GPT-OSS fields (megatron-core's names), each message naming the
    field, its value and what was expected."""
    out = []
    if softmax_type not in SOFTMAX_TYPES:
        out.append(f"softmax_type={softmax_type!r}; expected one of {SOFTMAX_TYPES}")
    offset_set = glu_linear_offset not in (0, 0.0)
    if not isinstance(glu_linear_offset, (int, float)) or isinstance(glu_linear_offset, bool):
        out.append(f"glu_linear_offset={glu_linear_offset!r}; expected a number")
    elif offset_set and not gated:
        out.append(
            f"glu_linear_offset={glu_linear_offset!r} needs gated_linear_unit=True (it offsets "
            "the gated unit's linear half)"
        )
    if clamp is not None:
        if not (isinstance(clamp, (int, float)) and not isinstance(clamp, bool) and clamp > 0):
            out.append(f"activation_func_clamp_value={clamp!r}; expected a number > 0 or None")
        elif not gated:
            out.append(
                f"activation_func_clamp_value={clamp!r} needs gated_linear_unit=True (it "
                "clamps the gated unit's two halves)"
            )
    return out


def softcap_valid(value: object) -> bool:
    """A logit soft-cap (``attn_logit_softcapping``, ``final_logit_softcapping``): None (off)
    or a finite number > 0."""
    if value is None:
        return True
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


MOE_TOKEN_DISPATCHERS = ("allgather", "alltoall")
"""``moe_token_dispatcher_type`` values implemented here (megatron-core also has "flex")."""

MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
"""``moe_router_load_balancing_type`` values implemented here."""

MOE_LOAD_BALANCING_REFUSED = {
    "global_aux_loss": "a running average over micro-batches and data-parallel ranks",
    "sinkhorn": "Sinkhorn balancing iterates over the local shard's tokens only",
}
"""megatron-core's other load-balancing types, with why their result would depend on the
layout."""

MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_ROUTER_DTYPES = (None, "fp32", "fp64")


def moe_layer_pattern(moe_layer_freq, num_layers: int) -> Optional[List[int]]:
    """``moe_layer_freq`` as one 0/1 entry per layer (1 = MoE): an int N makes every N-th
    layer (0, N, 2N, ...) a MoE layer; a list is taken as is. None when it does not fit
    (a list of the wrong length, entries other than 0/1, N < 1)."""
    if _is_int(moe_layer_freq):
        if moe_layer_freq < 1:
            return None
        return [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    if isinstance(moe_layer_freq, (list, tuple)):
        if len(moe_layer_freq) != num_layers or any(v not in (0, 1) for v in moe_layer_freq):
            return None
        return [int(v) for v in moe_layer_freq]
    return None


# LoRA (megatron.core.transformer.lora; the trainer's --lora-* flags): the layers an adapter
# can go on, the init methods of A and B, and where dropout acts (Megatron-Bridge's names).
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# multi-latent attention's projections (Megatron-Bridge's names), adaptable by name too
LORA_MLA_TARGETS = (
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_q_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
)
LORA_ALL_TARGETS = LORA_TARGETS + LORA_MLA_TARGETS


def lora_attention_names(mla: bool = False, q_lora: bool = True) -> Tuple[str, ...]:
    """An attention's adaptable linear layers, in order (``mla``: multi-latent attention's,
    with a q down/up pair when ``q_lora``, else one ``linear_q_proj``)."""
    if not mla:
        return ("linear_qkv", "linear_proj")
    q = ("linear_q_down_proj", "linear_q_up_proj") if q_lora else ("linear_q_proj",)
    return q + ("linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")


LORA_INIT_METHODS = ("xavier", "normal", "kaiming", "zero")
LORA_DROPOUT_POSITIONS = ("pre", "post")


def lora_module_names(
    num_layers: int,
    moe_pattern: Optional[Sequence[int]] = None,
    num_experts: int = 0,
    shared_experts: bool = False,
    attention: Sequence[str] = ("linear_qkv", "linear_proj"),
) -> List[str]:
    """The global names of a GPT's linear layers an adapter pattern can name, in order:
    per layer its attention's ``attention`` layers (``lora_attention_names``), then a dense
    layer's ``mlp.linear_fc1`` / ``linear_fc2``, or a MoE layer's (``moe_pattern[i]`` 1) routed
    experts ``mlp.experts.local_experts.<g>.linear_fc1`` / ``fc2`` (global expert g) and,
    with ``shared_experts``, ``mlp.shared_experts.linear_fc1`` / ``fc2``."""
    names = []
    for i in range(num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "self_attention." + n for n in attention]
        if moe_pattern and moe_pattern[i]:
            names += [f"{p}mlp.experts.local_experts.{g}.linear_fc{n}"
                      for g in range(num_experts) for n in (1, 2)]  # fmt: skip
            if shared_experts:
                names += [p + "mlp.shared_experts.linear_fc1", p + "mlp.shared_experts.linear_fc2"]
        else:
            names += [p + "mlp.linear_fc1", p + "mlp.linear_fc2"]
    return names


def lora_is_pattern(text: str) -> bool:
    """Whether a LoRA target is a wildcard on the global module name (else a last name)."""
    return any(c in text for c in "*?[.")


def lora_pattern_matches(name: str, pattern: str) -> bool:
    """Whether LoRA target ``pattern`` names the module with global name ``name``: a
    wildcard matches the whole name, a plain name (``linear_qkv``) its last component."""
    import fnmatch

    if lora_is_pattern(pattern):
        return fnmatch.fnmatchcase(name, pattern)
    return name.rsplit(".", 1)[-1] == pattern


# Preference training (megatron.core.preference; the trainer's --dpo-loss-type).
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")
# the reported metrics of preference training (TRL's names without the slash; the logged
# scalars have it: rewards/chosen)
DPO_METRIC_KEYS = (
    "rewards_chosen",
    "rewards_rejected",
    "rewards_accuracies",
    "rewards_margins",
    "logps_chosen",
    "logps_rejected",
)
