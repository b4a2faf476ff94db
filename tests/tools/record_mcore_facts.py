"""Record API facts from the real megatron-core 0.16.1 into a JSON file.

Run with the interpreter that has megatron-core installed (never the project's own)::

    pip install --target /tmp/mcore_extra einops   # megatron-core's HyperCommGrid needs it
    cd /tmp && env -u PYTHONPATH PYTHONPATH=/tmp/mcore_extra /opt/mcore/bin/python \
        /path/to/repo/tests/tools/record_mcore_facts.py

It writes ``tests/unit_tests/data/mcore_facts.json`` with these sections (plus ``meta``):

- ``signatures``: the public callables named in SPEC section 2, keyed by dotted path, each
  with ``module``, ``qualname``, ``binding`` ("module" for a module attribute, else how the
  class holds it: "function", "classmethod" or "staticmethod") and ``parameters``, a list of
  ``{"name", "kind", "default"}`` with ``kind`` an ``inspect.Parameter`` kind name and
  ``default`` the default's repr, or null for no default;
- ``config_fields``: per config class, ``{field: {"type", "value", "init"}}`` with the raw
  dataclass default as ``repr`` (``str`` for a torch dtype, ``type`` "dtype");
- ``enums``: member names and values;
- ``rank_layouts``: megatron-core's rank groups for a set of (world, tp, cp, pp) layouts, keyed
  like ``w4_tp1_cp2_pp2``, computed with its pure rank generator (no process group involved)
  and cross-checked against an independent stride computation;
- ``rank_generators``: ``RankGenerator(tp, ep, dp, pp, cp, order).get_ranks(token)`` for
  every token (non-empty subset of the five axes) over many orders and sizes, or the
  exception type megatron-core raises for the arguments;
- ``init_layouts``: the groups ``initialize_model_parallel`` builds (dense and expert, incl.
  orders without cp and ``expert_tensor_parallel_size``), recorded by running megatron-core's
  own function once per rank with ``torch.distributed`` replaced by a recorder of rank lists
  (no process group is created), or the exception type it raises. Layouts given
  ``hierarchical_context_parallel_sizes`` (keys ending ``_hcp2x2`` etc.) also carry ``hcp``
  (the sizes) and ``hcp_groups``: per level, every group of that level (sorted), as
  ``get_hierarchical_context_parallel_groups`` returns them;
- ``hyper_comm_grid``: ``HyperCommGrid(shape, dim_names, rank_offset).get_rank_enum(dims)``
  (needs ``einops``: put a directory holding it on PYTHONPATH);
- ``schedule_helpers``: outputs of ``get_pp_rank_microbatches`` and ``get_schedule_table``;
- ``values``: module constants and dataclass field names (``megatron.core.config``,
  ``ProcessGroupCollection``).

Only facts are recorded (names, defaults, rank numbers); no megatron-core code is copied.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import json
import sys
import warnings
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
OUTPUT = REPO_ROOT / "tests" / "unit_tests" / "data" / "mcore_facts.json"
EXPECTED_VERSION = "0.16.1"
ORDER = "tp-cp-ep-dp-pp"

_PS = "megatron.core.parallel_state"
_SCHED = "megatron.core.pipeline_parallel.schedules"
_P2P = "megatron.core.pipeline_parallel.p2p_communication"
_DIST = "megatron.core.distributed"

# (module, qualname) pairs; the dotted path is "module.qualname".
_PS_GETTERS = [
    f"get_{axis}_parallel_{what}"
    for axis in ("tensor_model", "pipeline_model", "context", "data")
    for what in ("group", "world_size", "rank")
] + [
    "get_context_parallel_global_ranks",
    "get_tensor_and_data_parallel_group",
    "get_embedding_group",
    "get_position_embedding_group",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "get_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size",
]

_P2P_METHODS = [
    "__init__",
    "recv_forward",
    "recv_backward",
    "send_forward",
    "send_backward",
    "send_forward_recv_backward",
    "send_backward_recv_forward",
    "send_forward_recv_forward",
    "send_backward_recv_backward",
    "send_forward_backward_recv_forward_backward",
]

_DDP_METHODS = [
    "__init__",
    "no_sync",
    "start_grad_sync",
    "finish_grad_sync",
    "scale_gradients",
    "zero_grad_buffer",
    "broadcast_params",
]

_PS_EXTRA = [
    f"set_{axis}_parallel_{what}"
    for axis in ("tensor_model", "pipeline_model", "expert_model", "expert_tensor")
    for what in ("world_size", "rank")
] + [
    "set_data_parallel_rank",
    "set_virtual_pipeline_model_parallel_rank",
    "set_virtual_pipeline_model_parallel_world_size",
    "get_tensor_model_parallel_src_rank",
    "get_model_parallel_src_rank",
    "get_data_parallel_src_rank",
    "has_separate_all_gather_group",
    "is_initialized",
    "get_model_parallel_group",
    "get_tensor_and_context_parallel_group",
    "get_tensor_and_context_parallel_world_size",
    "get_tensor_and_context_parallel_rank",
    "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "generate_masked_orthogonal_rank_groups",
    "get_expert_model_parallel_group",
    "get_expert_model_parallel_world_size",
    "get_expert_model_parallel_rank",
    "get_expert_model_parallel_src_rank",
    "get_expert_tensor_parallel_group",
    "get_expert_tensor_parallel_world_size",
    "get_expert_tensor_parallel_rank",
    "get_expert_tensor_and_model_parallel_group",
    "get_expert_tensor_and_model_parallel_world_size",
    "get_expert_tensor_and_model_parallel_rank",
    "get_expert_tensor_model_pipeline_parallel_group",
    "get_expert_data_parallel_group",
    "get_expert_data_parallel_world_size",
    "get_expert_data_parallel_rank",
    "get_data_modulo_expert_parallel_group",
    "RankGenerator.__init__",
    "RankGenerator.get_mask",
    "RankGenerator.get_ranks",
    "get_hierarchical_context_parallel_groups",
]

_PP_UTILS = [
    "is_pp_first_stage",
    "is_pp_last_stage",
    "is_vp_first_stage",
    "is_vp_last_stage",
    "get_pp_first_rank",
    "get_pp_last_rank",
    "get_pp_next_rank",
    "get_pp_prev_rank",
]

_GRID_METHODS = ["__init__", "create_pg", "get_pg", "get_rank_enum"]

SIGNATURE_TARGETS: list[tuple[str, str]] = (
    [
        (_PS, "initialize_model_parallel"),
        (_PS, "destroy_model_parallel"),
        (_PS, "model_parallel_is_initialized"),
    ]
    + [(_PS, name) for name in _PS_GETTERS]
    + [
        ("megatron.core.process_groups_config", "ProcessGroupCollection.use_mpu_process_groups"),
        ("megatron.core.utils", "get_model_config"),
        ("megatron.core.utils", "get_attr_wrapped_model"),
        ("megatron.core.pipeline_parallel", "get_forward_backward_func"),
        (_SCHED, "forward_backward_no_pipelining"),
        (_SCHED, "forward_backward_pipelining_without_interleaving"),
        (_SCHED, "forward_backward_pipelining_with_interleaving"),
        (_SCHED, "forward_step"),
        (_SCHED, "forward_step_calc_loss"),
        (_SCHED, "backward_step"),
        (_SCHED, "deallocate_output_tensor"),
        (_SCHED, "custom_backward"),
    ]
    + [(_P2P, f"P2PCommunicator.{name}") for name in _P2P_METHODS]
    + [(_DIST, f"DistributedDataParallel.{name}") for name in _DDP_METHODS]
    + [(_DIST, "finalize_model_grads")]
    + [(_PS, name) for name in _PS_EXTRA]
    + [("megatron.core.pipeline_parallel.utils", name) for name in _PP_UTILS]
    + [(_SCHED, "get_pp_rank_microbatches"), (_SCHED, "get_schedule_table")]
    + [("megatron.core.hyper_comm_grid", f"HyperCommGrid.{name}") for name in _GRID_METHODS]
    + [
        ("megatron.core.config", "set_experimental_flag"),
        ("megatron.core.config", "is_experimental_enabled"),
        ("megatron.core.utils", "is_te_min_version"),
        ("megatron.core.utils", "is_torch_min_version"),
        ("megatron.core.utils", "get_pg_size"),
        ("megatron.core.utils", "get_pg_rank"),
        ("megatron.core.process_groups_config", "ProcessGroupCollection.__init__"),
    ]
)

_PARALLEL_SIZES = [
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
]

_MODEL_PARALLEL_FIELDS = _PARALLEL_SIZES + [
    "pipeline_dtype",
    "params_dtype",
    "bf16",
    "fp16",
    "variable_seq_lengths",
    "batch_p2p_comm",
    "batch_p2p_sync",
    "deallocate_pipeline_outputs",
    "microbatch_group_size_per_vp_stage",
    "finalize_model_grads_func",
    "grad_scale_func",
    "no_sync_func",
    "grad_sync_func",
    "param_sync_func",
    "timers",
    "enable_autocast",
    "autocast_dtype",
    "num_microbatches_with_partial_activation_checkpoints",
    "hierarchical_context_parallel_sizes",
]

CONFIG_TARGETS: list[tuple[str, str, list[str]]] = [
    ("megatron.core.model_parallel_config", "ModelParallelConfig", _MODEL_PARALLEL_FIELDS),
    (
        "megatron.core.transformer",
        "TransformerConfig",
        _MODEL_PARALLEL_FIELDS
        + [
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
            "calculate_per_token_loss",
        ],
    ),
    (
        _DIST,
        "DistributedDataParallelConfig",
        [
            "grad_reduce_in_fp32",
            "overlap_grad_reduce",
            "use_distributed_optimizer",
            "check_for_nan_in_grad",
            "bucket_size",
            "average_in_collective",
        ],
    ),
]

ENUM_TARGETS: list[tuple[str, str]] = [("megatron.core.enums", "ModelType")]

# (world_size, tp, cp, pp); dp is what is left.
LAYOUTS: list[tuple[int, int, int, int]] = [
    (4, 1, 2, 2),
    (4, 1, 4, 1),
    (4, 1, 1, 2),
    (4, 1, 2, 1),
    (4, 2, 1, 2),
    (4, 2, 2, 1),
    (4, 1, 1, 4),
    (4, 1, 1, 1),
    (8, 1, 2, 2),
    (8, 1, 4, 2),
    (8, 1, 8, 1),
    (8, 1, 2, 1),
    (8, 2, 2, 2),
    (8, 2, 1, 2),
    (8, 1, 1, 4),
    (8, 1, 1, 8),
    (8, 1, 4, 1),
]

# Group name in the JSON -> rank-generator token (None: derived from the pp groups).
GROUP_TOKENS: dict[str, str | None] = {
    "tp": "tp",
    "cp": "cp",
    "pp": "pp",
    "dp": "dp",
    "dp_cp": "dp-cp",
    "mp": "tp-pp",
    "tp_cp": "tp-cp",
    "tp_dp": "tp-dp",
    "tp_dp_cp": "tp-dp-cp",
    "embd": None,
    "pos_embd": None,
}

_SIMPLE_TYPES = (bool, int, float, str, type(None))


def _resolve(module: str, qualname: str) -> tuple[Any, Any]:
    """Return (owner, object) for ``module.qualname``; owner is None for module attributes."""
    owner: Any = None
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        owner, obj = obj, getattr(obj, part)
    return (owner if inspect.isclass(owner) else None), obj


def _binding(owner: Any, qualname: str) -> str:
    """How a callable is bound: module function, or the static kind of a class attribute."""
    if owner is None:
        return "module"
    raw = inspect.getattr_static(owner, qualname.rsplit(".", 1)[1])
    if isinstance(raw, classmethod):
        return "classmethod"
    if isinstance(raw, staticmethod):
        return "staticmethod"
    return "function"


def record_signature(module: str, qualname: str) -> dict[str, Any]:
    """Record the parameter list of one callable."""
    owner, obj = _resolve(module, qualname)
    params = []
    for param in inspect.signature(obj).parameters.values():
        has_default = param.default is not inspect.Parameter.empty
        params.append(
            {
                "name": param.name,
                "kind": param.kind.name,
                "default": repr(param.default) if has_default else None,
            }
        )
    return {
        "module": module,
        "qualname": qualname,
        "binding": _binding(owner, qualname),
        "parameters": params,
    }


def _default_fact(value: Any) -> dict[str, str]:
    import torch

    if isinstance(value, torch.dtype):
        return {"type": "dtype", "value": str(value)}
    if isinstance(value, _SIMPLE_TYPES):
        return {"type": type(value).__name__, "value": repr(value)}
    raise TypeError(f"default {value!r} is not a simple type")


def record_config(module: str, name: str, wanted: list[str]) -> dict[str, Any]:
    """Record raw dataclass defaults of the wanted fields of one config class."""
    cls = getattr(importlib.import_module(module), name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for field_name in wanted:
        field = fields[field_name]
        if field.default is not dataclasses.MISSING:
            fact = _default_fact(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            fact = {"type": "factory", "value": None}
        else:
            fact = {"type": "required", "value": None}
        out[field_name] = {**fact, "init": field.init}
    return {"module": module, "name": name, "fields": out}


def record_enum(module: str, name: str) -> dict[str, Any]:
    """Record the member names and values of one enum."""
    cls = getattr(importlib.import_module(module), name)
    return {
        "module": module,
        "name": name,
        "members": {member.name: member.value for member in cls},
    }


def _independent_groups(sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Rank groups for a mask, assuming the first axis of the order has stride 1.

    rank = sum_i coord_i * prod_{j<i} size_j. A group fixes the unmasked coordinates; groups
    are listed with the first unmasked axis fastest, members with the first masked axis fastest.
    """
    strides = [1]
    for size in sizes[:-1]:
        strides.append(strides[-1] * size)
    inside = [i for i, m in enumerate(mask) if m]
    outside = [i for i, m in enumerate(mask) if not m]

    def coords(axes: list[int]) -> list[tuple[int, ...]]:
        # itertools.product varies the last axis fastest; reverse to make the first fastest.
        return [c[::-1] for c in itertools.product(*(range(sizes[a]) for a in reversed(axes)))]

    groups = []
    for out_c in coords(outside):
        base = sum(c * strides[a] for a, c in zip(outside, out_c))
        groups.append(
            [base + sum(c * strides[a] for a, c in zip(inside, in_c)) for in_c in coords(inside)]
        )
    return groups


def record_layout(world: int, tp: int, cp: int, pp: int) -> dict[str, Any]:
    """Rank groups of one layout from megatron-core's rank generator."""
    ps = importlib.import_module(_PS)
    dp = world // (tp * cp * pp)
    assert dp * tp * cp * pp == world, (world, tp, cp, pp)
    gen = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=ORDER, rank_offset=0)
    groups: dict[str, list[list[int]]] = {}
    for key, token in GROUP_TOKENS.items():
        if token is not None:
            groups[key] = gen.get_ranks(token)
    groups["embd"] = [list(ps.default_embedding_ranks(r)) for r in groups["pp"]]
    groups["pos_embd"] = [list(ps.default_position_embedding_ranks(r)) for r in groups["pp"]]

    sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    axes = ORDER.split("-")
    for key, token in GROUP_TOKENS.items():
        if token is None:
            continue
        mask = [axis in token.split("-") for axis in axes]
        expected = _independent_groups([sizes[a] for a in axes], mask)
        assert groups[key] == expected, (world, tp, cp, pp, key, groups[key], expected)
    return {
        "world_size": world,
        "tp": tp,
        "cp": cp,
        "pp": pp,
        "dp": dp,
        "ep": 1,
        "order": ORDER,
        "groups": groups,
    }


# ----------------------------------------------------------------------------- rank generators

AXIS_NAMES = ("tp", "cp", "ep", "dp", "pp")

# Orders megatron-core accepts: permutations of the five axes or of a subset (the missing
# ones must have size 1 and go last).
GENERATOR_ORDERS = [
    "tp-cp-ep-dp-pp",
    "tp-cp-ep-pp-dp",
    "tp-pp-dp",
    "tp-dp-pp",
    "tp-ep-dp-pp",
    "tp-cp-dp-pp",
    "tp-cp-pp-dp",
    "pp-tp-dp",
    "dp-tp-pp",
    "dp-pp-tp-cp-ep",
    "cp-tp-ep-dp-pp",
    "ep-tp-dp-pp",
    "pp-dp-cp-tp-ep",
]

# (tp, ep, dp, pp, cp) for the pure generator.
GENERATOR_SIZES = [
    (1, 1, 1, 1, 1),
    (2, 1, 1, 1, 1),
    (1, 2, 1, 1, 1),
    (1, 1, 1, 1, 2),
    (2, 1, 2, 1, 1),
    (1, 1, 2, 2, 1),
    (2, 1, 1, 1, 2),
    (1, 2, 2, 1, 1),
    (2, 2, 1, 1, 1),
    (2, 1, 2, 2, 1),
    (2, 1, 1, 2, 2),
    (1, 2, 2, 2, 1),
    (2, 2, 2, 1, 1),
    (2, 1, 4, 1, 1),
    (2, 2, 1, 1, 2),
]


def _tokens() -> list[str]:
    """Every one- and two-axis token, the three-axis ones megatron-core uses, two written in
    another order, and all five axes."""
    out = []
    for n in (1, 2):
        out += ["-".join(c) for c in itertools.combinations(AXIS_NAMES, n)]
    return out + ["tp-dp-cp", "tp-ep-pp", "tp-cp-dp", "pp-dp", "dp-cp", "tp-cp-ep-dp-pp"]


def generator_key(order: str, tp: int, ep: int, dp: int, pp: int, cp: int, offset: int) -> str:
    """Key of one generator in ``rank_generators``."""
    return f"{order}_tp{tp}_ep{ep}_dp{dp}_pp{pp}_cp{cp}_off{offset}"


def record_generator(order: str, tp: int, ep: int, dp: int, pp: int, cp: int, offset: int):
    """``get_ranks`` of every token, or the exception megatron-core raises."""
    ps = importlib.import_module(_PS)
    fact: dict[str, Any] = {
        "order": order,
        "sizes": {"tp": tp, "ep": ep, "dp": dp, "pp": pp, "cp": cp},
        "rank_offset": offset,
    }
    try:
        gen = ps.RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order, rank_offset=offset)
    except (AssertionError, RuntimeError, KeyError, ValueError) as exc:
        return {**fact, "error": type(exc).__name__}
    fact["normalized_order"] = gen.order
    fact["ordered_size"] = list(gen.ordered_size)
    fact["ranks"] = {token: gen.get_ranks(token) for token in _tokens()}
    return fact


def record_generators() -> dict[str, Any]:
    """All GENERATOR_ORDERS x GENERATOR_SIZES, plus two offsets."""
    out = {}
    cases = [(o, *sz, 0) for o in GENERATOR_ORDERS for sz in GENERATOR_SIZES]
    cases += [("tp-cp-ep-dp-pp", 2, 1, 2, 1, 1, 4), ("tp-pp-dp", 1, 1, 2, 2, 1, 8)]
    for case in cases:
        out[generator_key(*case)] = record_generator(*case)
    return out


# ----------------------------------------------------------------------------- initialize

# (world, tp, cp, pp, ep, etp or None, order)
INIT_LAYOUTS: list[tuple[int, int, int, int, int, int | None, str]] = [
    (1, 1, 1, 1, 1, None, "tp-cp-ep-dp-pp"),
    (2, 1, 1, 1, 2, None, "tp-cp-ep-dp-pp"),
    (2, 2, 1, 1, 2, 1, "tp-cp-ep-dp-pp"),
    (2, 1, 2, 1, 2, None, "tp-cp-ep-dp-pp"),
    (2, 1, 1, 2, 1, None, "tp-pp-dp"),
    (2, 2, 1, 1, 1, None, "tp-dp-pp"),
    (2, 1, 1, 1, 1, None, "pp-dp-tp"),
    (4, 2, 1, 1, 2, None, "tp-cp-ep-dp-pp"),
    (4, 2, 1, 1, 2, 1, "tp-cp-ep-dp-pp"),
    (4, 2, 1, 1, 4, 1, "tp-cp-ep-dp-pp"),
    (4, 1, 2, 1, 2, None, "tp-cp-ep-dp-pp"),
    (4, 1, 2, 2, 1, None, "tp-cp-ep-pp-dp"),
    (4, 1, 1, 2, 2, None, "tp-cp-ep-dp-pp"),
    (4, 2, 1, 2, 2, 1, "tp-cp-ep-dp-pp"),
    (4, 1, 1, 2, 1, None, "tp-pp-dp"),
    (4, 2, 1, 1, 1, None, "tp-dp-pp"),
    (4, 1, 1, 2, 2, None, "tp-ep-pp-dp"),
    (4, 1, 1, 2, 1, None, "pp-tp-dp"),
    (4, 2, 2, 1, 1, None, "dp-tp-cp-pp"),
    (4, 1, 1, 2, 1, 2, "tp-cp-ep-pp-dp"),
    (4, 1, 1, 2, 1, None, "tp-cp-ep-pp-dp"),
    (8, 2, 1, 2, 1, None, "tp-cp-ep-pp-dp"),
    (8, 2, 2, 2, 1, None, "tp-cp-ep-dp-pp"),
    (8, 2, 2, 2, 2, 1, "tp-cp-ep-dp-pp"),
    (8, 2, 1, 1, 4, 1, "tp-cp-ep-dp-pp"),
    (8, 1, 1, 1, 8, None, "tp-cp-ep-dp-pp"),
    (8, 2, 1, 2, 2, None, "tp-cp-ep-dp-pp"),
    (8, 1, 2, 2, 2, None, "tp-cp-ep-pp-dp"),
    (8, 2, 1, 2, 1, None, "tp-pp-dp"),
    (8, 1, 2, 2, 1, None, "tp-cp-pp-dp"),
    (8, 2, 2, 1, 2, 4, "tp-cp-ep-dp-pp"),
]

# (world, tp, cp, pp, ep, etp or None, order, hierarchical_context_parallel_sizes): the
# levels over one context-parallel group, incl. a size-1 level, three levels, context-parallel
# groups that are not contiguous ("tp-pp-dp-cp") and sizes whose product is not cp (error).
HCP_INIT_LAYOUTS: list[tuple[int, int, int, int, int, int | None, str, list[int]]] = [
    (2, 1, 2, 1, 1, None, "tp-cp-ep-dp-pp", [1, 2]),
    (2, 1, 2, 1, 1, None, "tp-cp-ep-dp-pp", [2]),
    (2, 1, 2, 1, 1, None, "tp-cp-ep-dp-pp", [2, 2]),
    (4, 1, 4, 1, 1, None, "tp-cp-ep-dp-pp", [2, 2]),
    (4, 1, 2, 2, 1, None, "tp-cp-ep-dp-pp", [2, 1]),
    (4, 1, 4, 1, 1, None, "tp-cp-ep-dp-pp", [2, 3]),
    (8, 2, 4, 1, 1, None, "tp-cp-ep-dp-pp", [2, 2]),
    (8, 1, 8, 1, 1, None, "tp-cp-ep-dp-pp", [2, 4]),
    (8, 1, 8, 1, 1, None, "tp-cp-ep-dp-pp", [4, 2]),
    (8, 1, 8, 1, 1, None, "tp-cp-ep-dp-pp", [2, 2, 2]),
    (8, 1, 4, 1, 1, None, "tp-pp-dp-cp", [2, 2]),
    (8, 1, 4, 2, 2, None, "tp-cp-ep-dp-pp", [2, 2]),
    (8, 1, 4, 1, 1, None, "tp-cp-ep-dp-pp", [8]),
]

# Group name -> megatron-core getter (called with no arguments unless a lambda).
INIT_GETTERS = {
    "tp": "get_tensor_model_parallel_group",
    "cp": "get_context_parallel_group",
    "pp": "get_pipeline_model_parallel_group",
    "dp": "get_data_parallel_group",
    "dp_cp": ("get_data_parallel_group", {"with_context_parallel": True}),
    "mp": "get_model_parallel_group",
    "tp_cp": "get_tensor_and_context_parallel_group",
    "tp_dp": "get_tensor_and_data_parallel_group",
    "tp_dp_cp": ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    "embd": ("get_embedding_group", {"check_initialized": False}),
    "pos_embd": ("get_position_embedding_group", {"check_initialized": False}),
    "ep": "get_expert_model_parallel_group",
    "expt_tp": "get_expert_tensor_parallel_group",
    "tp_ep": "get_expert_tensor_and_model_parallel_group",
    "tp_ep_pp": "get_expert_tensor_model_pipeline_parallel_group",
    "expt_dp": "get_expert_data_parallel_group",
}


class _FakeGroup:
    """Stands for a process group: its global ranks, and the rank being recorded."""

    current_rank = 0

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = list(ranks)

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        return (
            self.ranks.index(_FakeGroup.current_rank)
            if _FakeGroup.current_rank in self.ranks
            else -1
        )


def init_key(world: int, tp: int, cp: int, pp: int, ep: int, etp: int | None, order: str) -> str:
    """Key of one layout in ``init_layouts``."""
    return f"w{world}_tp{tp}_cp{cp}_pp{pp}_ep{ep}_etp{etp}_{order}"


def hcp_key(sizes: list[int]) -> str:
    """Suffix of an ``init_layouts`` key for hierarchical context-parallel sizes."""
    return "_hcp" + "x".join(str(s) for s in sizes)


def record_init_layout(world, tp, cp, pp, ep, etp, order, hcp=None) -> dict[str, Any]:
    """Run megatron-core's initialize_model_parallel on each rank against a fake
    torch.distributed; collect each group getter's ranks (every distinct group, sorted), and
    with ``hcp`` (hierarchical_context_parallel_sizes) the groups of each level."""
    from unittest import mock

    import torch.distributed as tdist

    ps = importlib.import_module(_PS)
    fact: dict[str, Any] = {
        "world_size": world,
        "tp": tp,
        "cp": cp,
        "pp": pp,
        "ep": ep,
        "etp": etp,
        "order": order,
    }
    if hcp is not None:
        fact["hcp"] = list(hcp)
    groups: dict[str, set] = {name: set() for name in INIT_GETTERS}
    levels: list[set] = [set() for _ in hcp or []]
    patches = {
        "is_initialized": lambda: True,
        "get_world_size": lambda group=None: world,
        "get_rank": lambda group=None: _FakeGroup.current_rank,
        "new_group": lambda ranks=None, **kw: _FakeGroup(ranks),
        "destroy_process_group": lambda group=None: None,
    }
    with mock.patch.multiple(tdist, **patches):
        for rank in range(world):
            _FakeGroup.current_rank = rank
            ps.destroy_model_parallel()
            try:
                ps.initialize_model_parallel(
                    tensor_model_parallel_size=tp,
                    pipeline_model_parallel_size=pp,
                    context_parallel_size=cp,
                    expert_model_parallel_size=ep,
                    expert_tensor_parallel_size=etp,
                    order=order,
                    create_gloo_process_groups=False,
                    hierarchical_context_parallel_sizes=hcp,
                )
            except (AssertionError, RuntimeError, KeyError, ValueError) as exc:
                ps.destroy_model_parallel()
                return {**fact, "error": type(exc).__name__}
            for name, getter in INIT_GETTERS.items():
                fn, kwargs = (getter, {}) if isinstance(getter, str) else getter
                group = getattr(ps, fn)(**kwargs)
                if group is not None and rank in group.ranks:
                    groups[name].add(tuple(group.ranks))
            if hcp is not None:
                mine = ps.get_hierarchical_context_parallel_groups(check_initialized=False)
                assert len(mine) == len(hcp), (rank, hcp, mine)
                for found, group in zip(levels, mine):
                    assert rank in group.ranks, (rank, hcp, group.ranks)
                    found.add(tuple(group.ranks))
            ps.destroy_model_parallel()
    fact["groups"] = {name: [list(g) for g in sorted(found)] for name, found in groups.items()}
    if hcp is not None:
        fact["hcp_groups"] = [[list(g) for g in sorted(found)] for found in levels]
    return fact


def record_init_layouts() -> dict[str, Any]:
    """Every INIT_LAYOUTS entry, then every HCP_INIT_LAYOUTS entry."""
    out = {init_key(*lay): record_init_layout(*lay) for lay in INIT_LAYOUTS}
    for *lay, hcp in HCP_INIT_LAYOUTS:
        out[init_key(*lay) + hcp_key(hcp)] = record_init_layout(*lay, hcp=hcp)
    return out


# ----------------------------------------------------------------------------- other helpers

GRID_CASES = [
    ([2, 2, 2], ["a", "b", "c"], 0, [["a"], ["b"], ["c"], ["a", "b"], ["b", "a"], ["a", "c"]]),
    ([2, 4], ["tp", "dp"], 0, [["tp"], ["dp"], ["dp", "tp"], "dp"]),
    ([2, 1, 2, 2], ["tp", "cp", "pp", "dp"], 0, [["tp"], ["cp"], ["pp"], ["dp"], ["cp", "dp"]]),
    ([2, 2], ["tp", "dp"], 4, [["tp"], ["dp"], ["tp", "dp"]]),
    ([4, 2], ["ep", "pp"], 0, [["ep"], ["pp"], ["pp", "ep"]]),
]


def record_hyper_comm_grid() -> list[dict[str, Any]]:
    """``get_rank_enum`` of GRID_CASES (world size 8 via the environment)."""
    import os

    hcg = importlib.import_module("megatron.core.hyper_comm_grid")
    os.environ["WORLD_SIZE"] = "8"
    out = []
    for shape, names, offset, dims_list in GRID_CASES:
        grid = hcg.HyperCommGrid(shape, names, rank_offset=offset)
        out.append(
            {
                "shape": shape,
                "dim_names": names,
                "rank_offset": offset,
                "enums": [{"dims": dims, "ranks": grid.get_rank_enum(dims)} for dims in dims_list],
            }
        )
    return out


class _FakeP2P:
    """What get_pp_rank_microbatches reads of a P2PCommunicator."""

    def __init__(self, pp_size: int, pp_rank: int, vp_size: int | None) -> None:
        _FakeGroup.current_rank = pp_rank
        self.pp_group = _FakeGroup(list(range(pp_size)))
        self.virtual_pipeline_model_parallel_size = vp_size


def record_schedule_helpers() -> dict[str, Any]:
    """Outputs of get_pp_rank_microbatches and get_schedule_table on a grid of inputs."""
    sched = importlib.import_module(_SCHED)
    micro = []
    for pp_size, vp_size, m, chunks, g, forward_only, overlap in itertools.product(
        (1, 2, 4), (None, 2, 3), (1, 3, 8), (1, 2, 3), (1, 2, 4), (False, True), (False, True)
    ):
        if vp_size is None and chunks != 1 or vp_size is not None and chunks != vp_size:
            continue
        for rank in range(pp_size):
            out = sched.get_pp_rank_microbatches(
                m,
                chunks,
                g,
                forward_only,
                overlap,
                p2p_communicator=_FakeP2P(pp_size, rank, vp_size),
            )
            args = [m, chunks, g, forward_only, overlap, pp_size, rank, vp_size]
            micro.append({"args": args, "result": list(out)})
    tables = []
    for m, chunks, g in itertools.product((1, 2, 3, 5, 8), (1, 2, 3), (1, 2, 3, 4)):
        table = sched.get_schedule_table(m, chunks, g)
        tables.append({"args": [m, chunks, g], "table": [list(x) for x in table]})
    return {"get_pp_rank_microbatches": micro, "get_schedule_table": tables}


def record_values() -> dict[str, Any]:
    """Constants and dataclass facts."""
    config = importlib.import_module("megatron.core.config")
    pgc = importlib.import_module("megatron.core.process_groups_config").ProcessGroupCollection
    return {
        "megatron.core.config.ENABLE_EXPERIMENTAL": config.ENABLE_EXPERIMENTAL,
        "ProcessGroupCollection.fields": [f.name for f in dataclasses.fields(pgc)],
        "ProcessGroupCollection.is_dataclass": dataclasses.is_dataclass(pgc),
    }


def layout_key(world: int, tp: int, cp: int, pp: int) -> str:
    """Key of a layout in ``rank_layouts``, e.g. ``w4_tp1_cp2_pp2``."""
    return f"w{world}_tp{tp}_cp{cp}_pp{pp}"


def _check_by_hand(layouts: dict[str, Any]) -> None:
    """World 4, C=2, PP=2: the first axis of the order (tp, then cp) has stride 1."""
    groups = layouts[layout_key(4, 1, 2, 2)]["groups"]
    assert groups["cp"] == [[0, 1], [2, 3]], groups["cp"]
    assert groups["pp"] == [[0, 2], [1, 3]], groups["pp"]
    assert groups["embd"] == [[0, 2], [1, 3]], groups["embd"]
    assert groups["pos_embd"] == [[0], [1]], groups["pos_embd"]
    assert groups["dp_cp"] == [[0, 1], [2, 3]], groups["dp_cp"]


def to_json(value: Any, indent: int = 0, lead: int = 0, width: int = 100) -> str:
    """Dump ``value`` as JSON, one line per container whenever it fits in ``width`` columns.

    ``indent`` is the indentation of the container's closing line, ``lead`` the column its
    first character starts at.
    """
    line = json.dumps(value, separators=(", ", ": "))
    if not isinstance(value, (dict, list)) or not value or max(lead, indent) + len(line) < width:
        return line
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            head = f"{pad}{json.dumps(key)}: "
            items.append(head + to_json(item, indent + 2, len(head), width))
    else:
        items = [pad + to_json(item, indent + 2, indent + 2, width) for item in value]
    opening, closing = ("{", "}") if isinstance(value, dict) else ("[", "]")
    return opening + "\n" + ",\n".join(items) + "\n" + " " * indent + closing


def collect() -> dict[str, Any]:
    """Collect all facts from the installed megatron-core."""
    import megatron.core

    version = getattr(megatron.core, "__version__", None)
    if version != EXPECTED_VERSION:
        raise SystemExit(f"expected megatron-core {EXPECTED_VERSION}, found {version}")
    location = Path(megatron.core.__file__).resolve()
    if REPO_ROOT in location.parents:
        raise SystemExit(
            f"megatron.core resolves to this repository ({location}), not the real one"
        )

    signatures = {f"{m}.{q}": record_signature(m, q) for m, q in SIGNATURE_TARGETS}
    configs = {f"{m}.{n}": record_config(m, n, f) for m, n, f in CONFIG_TARGETS}
    enums = {f"{m}.{n}": record_enum(m, n) for m, n in ENUM_TARGETS}
    layouts = {layout_key(*lay): record_layout(*lay) for lay in LAYOUTS}
    _check_by_hand(layouts)
    generators = record_generators()
    init_layouts = record_init_layouts()
    grids = record_hyper_comm_grid()
    schedule_helpers = record_schedule_helpers()
    values = record_values()
    return {
        "meta": {
            "megatron_core_version": version,
            "generated_by": "tests/tools/record_mcore_facts.py",
        },
        "signatures": signatures,
        "config_fields": configs,
        "enums": enums,
        "rank_layouts": layouts,
        "rank_generators": generators,
        "init_layouts": init_layouts,
        "hyper_comm_grid": grids,
        "schedule_helpers": schedule_helpers,
        "values": values,
    }


def main(argv: list[str] | None = None) -> int:
    """Write the facts file (or the path given as the only argument)."""
    argv = sys.argv[1:] if argv is None else argv
    target = Path(argv[0]) if argv else OUTPUT
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        facts = collect()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(to_json(facts) + "\n")
    print(
        f"wrote {target}: {len(facts['signatures'])} signatures, "
        f"{len(facts['config_fields'])} configs, {len(facts['rank_layouts'])} rank layouts, "
        f"{len(facts['rank_generators'])} generators, {len(facts['init_layouts'])} init layouts"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
