"""Record API facts from the real megatron-core 0.16.1 into a JSON file.

Run with the interpreter that has megatron-core installed (never the project's own)::

    /opt/mcore/bin/python tests/tools/record_mcore_facts.py

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
  and cross-checked against an independent stride computation.

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
    return {
        "meta": {
            "megatron_core_version": version,
            "generated_by": "tests/tools/record_mcore_facts.py",
        },
        "signatures": signatures,
        "config_fields": configs,
        "enums": enums,
        "rank_layouts": layouts,
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
        f"{len(facts['config_fields'])} configs, {len(facts['rank_layouts'])} rank layouts"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
