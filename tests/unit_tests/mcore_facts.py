"""Access to the facts recorded from megatron-core 0.16.1 (``data/mcore_facts.json``).

The file is written by ``tests/tools/record_mcore_facts.py`` (run with the interpreter that has
the real megatron-core installed). Sections: ``signatures``, ``config_fields``, ``enums``,
``rank_layouts``, ``rank_generators``, ``init_layouts``, ``hyper_comm_grid``,
``schedule_helpers`` and ``values``; see that script's docstring for their format.
"""

from __future__ import annotations

import copy
import functools
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
