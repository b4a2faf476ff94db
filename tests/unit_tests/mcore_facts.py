"""Access to the facts recorded from megatron-core 0.16.1 (``data/mcore_facts.json``).

The file is written by ``tests/tools/record_mcore_facts.py`` (run with the interpreter that has
the real megatron-core installed). Sections: ``signatures``, ``config_fields``, ``enums``,
``rank_layouts``, ``rank_generators``, ``init_layouts``, ``hyper_comm_grid``,
``schedule_helpers`` and ``values``; see that script's docstring for their format.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
from pathlib import Path
from typing import Any

FACTS_PATH = Path(__file__).resolve().parent / "data" / "mcore_facts.json"

# Group names recorded for every layout, as in ProcessGroupCollection.
GROUP_NAMES = (
    "tp",
    "cp",
    "pp",
    "dp",
    "dp_cp",
    "mp",
    "tp_cp",
    "tp_dp",
    "tp_dp_cp",
    "embd",
    "pos_embd",
)


@functools.lru_cache(maxsize=1)
def _read() -> dict[str, Any]:
    with FACTS_PATH.open() as handle:
        return json.load(handle)


def load_mcore_facts() -> dict[str, Any]:
    """Return the parsed facts file (a private copy: callers may modify it)."""
    return copy.deepcopy(_read())


def facts_section(name: str) -> Any:
    """One section of the facts, shared and read-only: no copy is made (the file is large and
    every rank of every launch reads it), so callers must not modify it."""
    return _read()[name]


def layout_key(world_size: int, tp: int = 1, cp: int = 1, pp: int = 1) -> str:
    """Key of a layout in ``rank_layouts``, e.g. ``w4_tp1_cp2_pp2``."""
    return f"w{world_size}_tp{tp}_cp{cp}_pp{pp}"


def rank_layout(world_size: int, tp: int = 1, cp: int = 1, pp: int = 1) -> dict[str, Any]:
    """Return one recorded layout: sizes (``tp, cp, pp, dp, ep``), ``order`` and ``groups``.

    ``groups`` maps each name of ``GROUP_NAMES`` to megatron-core's list of rank lists
    (order "tp-cp-ep-dp-pp"; ``dp`` excludes context parallelism, ``dp_cp`` includes it,
    ``mp`` is tensor + pipeline, ``embd`` the first and last pipeline stage of each pipeline,
    ``pos_embd`` its first stage).
    """
    layouts = _read()["rank_layouts"]
    key = layout_key(world_size, tp, cp, pp)
    if key not in layouts:
        raise KeyError(f"no recorded layout {key!r}; recorded: {sorted(layouts)}")
    return copy.deepcopy(layouts[key])


def groups_of_rank(
    world_size: int, rank: int, tp: int = 1, cp: int = 1, pp: int = 1
) -> dict[str, list[int] | None]:
    """Map each group name to the ranks of the group holding ``rank`` (None if none does).

    Only ``embd`` and ``pos_embd`` can be None: a middle pipeline stage is in neither.
    """
    groups = rank_layout(world_size, tp, cp, pp)["groups"]
    return {
        name: next((ranks for ranks in groups[name] if rank in ranks), None) for name in GROUP_NAMES
    }


# ---- comparing our signatures with recorded ones --------------------------------------------
# Every facts file records a callable as ``{"module", "qualname", "parameters"}`` with each
# parameter as ``{"name", "kind", "default"}`` (``default`` is the repr, None when absent).

VARIADIC = frozenset({"VAR_POSITIONAL", "VAR_KEYWORD"})


def resolve(module: str, qualname: str) -> tuple[Any, Any]:
    """Import ``module`` and walk ``qualname``; return (owning class or None, object)."""
    owner: Any = None
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        owner, obj = obj, getattr(obj, part)
    return (owner if inspect.isclass(owner) else None), obj


def binding(owner: Any, qualname: str) -> str:
    """How ``qualname`` is bound: module, classmethod, staticmethod or function."""
    if owner is None:
        return "module"
    raw = inspect.getattr_static(owner, qualname.rsplit(".", 1)[1])
    if isinstance(raw, classmethod):
        return "classmethod"
    if isinstance(raw, staticmethod):
        return "staticmethod"
    return "function"


def signature_parameters(obj: Any) -> list[dict[str, Any]]:
    """Parameters of ``obj`` in the recorded format (default repr, None when absent)."""
    return [
        {
            "name": p.name,
            "kind": p.kind.name,
            "default": None if p.default is inspect.Parameter.empty else repr(p.default),
        }
        for p in inspect.signature(obj).parameters.values()
    ]


def format_parameter(param: dict[str, Any]) -> str:
    """``name (KIND)`` or ``name (KIND) = default``."""
    text = f"{param['name']} ({param['kind']})"
    return text if param["default"] is None else f"{text} = {param['default']}"


def signature_problems(
    ours: list[dict[str, Any]],
    theirs: list[dict[str, Any]],
    *,
    variadic_by_kind: bool,
    extra_variadic_ok: bool = False,
) -> list[str]:
    """Differences between our parameters and megatron-core's (empty when compatible).

    Each of megatron-core's parameters must be ours at the same position with equal name, kind
    and default; with ``variadic_by_kind`` a recorded ``*args`` / ``**kwargs`` matches any
    parameter of the same kind. Our extra parameters must follow and have defaults; a variadic
    extra is allowed only with ``extra_variadic_ok``.
    """
    problems = []
    for index, want in enumerate(theirs):
        if index >= len(ours):
            problems.append(f"#{index}: missing {format_parameter(want)}")
            continue
        got = ours[index]
        same = (
            got["kind"] == want["kind"]
            if variadic_by_kind and want["kind"] in VARIADIC
            else got == want
        )
        if not same:
            problems.append(
                f"#{index}: expected {format_parameter(want)}, got {format_parameter(got)}"
            )
    for index, extra in enumerate(ours[len(theirs) :], start=len(theirs)):
        if extra["kind"] in VARIADIC:
            bad = not extra_variadic_ok
        else:
            bad = extra["default"] is None
        if bad:
            problems.append(f"#{index}: extra parameter {format_parameter(extra)} needs a default")
    return problems
