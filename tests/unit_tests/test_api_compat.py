"""API compatibility with megatron-core 0.16.1 (SPEC section 2), checked against recorded facts.

The facts (``data/mcore_facts.json``) come from the real megatron-core through
``tests/tools/record_mcore_facts.py``. For each recorded callable, ours must have every
megatron-core parameter with the same name, kind, position and default repr; extra parameters
may only follow megatron-core's and must have defaults. Type annotations are not compared.

Run against the real megatron-core (from a directory where ``import megatron`` resolves to the
installed package), every test passes except those marked as extensions of the SPEC:
``test_forward_step_gains_cp_group``, ``test_process_group_collection_unset_fields_are_none``
and ``test_is_te_min_version_is_false_without_transformer_engine`` (megatron-core raises
``TypeError`` there).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import pytest

from tests.unit_tests.mcore_facts import (
    GROUP_NAMES,
    binding,
    facts_section,
    format_parameter,
    rank_layout,
    resolve,
    signature_parameters,
    signature_problems,
)

SIGNATURES: dict[str, Any] = facts_section("signatures")
CONFIGS: dict[str, Any] = facts_section("config_fields")
ENUMS: dict[str, Any] = facts_section("enums")
LAYOUTS: dict[str, Any] = facts_section("rank_layouts")
VALUES: dict[str, Any] = facts_section("values")

# SPEC section 2: these keep megatron-core's parameters and gain an optional ``cp_group=None``.
CP_GROUP_PATHS = [
    "megatron.core.pipeline_parallel.schedules.forward_step",
    "megatron.core.pipeline_parallel.schedules.forward_step_calc_loss",
]

# Single-process checks of signatures and recorded facts: one run is enough.
pytestmark = pytest.mark.world(1)

PGC_FIELDS = ["tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "tp_dp_cp", "dp", "dp_cp"]


def _short(path: str) -> str:
    return path.removeprefix("megatron.core.")


def _ours(path: str) -> tuple[Any, Any, dict[str, Any]]:
    fact = SIGNATURES[path]
    owner, obj = resolve(fact["module"], fact["qualname"])
    return owner, obj, fact


def test_facts_are_from_megatron_core_0_16_1() -> None:
    """The facts file was recorded from megatron-core 0.16.1."""
    assert facts_section("meta")["megatron_core_version"] == "0.16.1"
    assert set(CP_GROUP_PATHS) <= set(SIGNATURES)


@pytest.mark.parametrize("path", list(SIGNATURES), ids=_short)
def test_signature_matches_mcore(path: str) -> None:
    """Every megatron-core parameter exists in ours, same name/kind/position/default repr."""
    owner, obj, fact = _ours(path)
    ours, theirs = signature_parameters(obj), fact["parameters"]
    problems = []
    bound = binding(owner, fact["qualname"])
    if bound != fact["binding"]:
        problems.append(f"bound as {bound}, megatron-core has {fact['binding']}")
    problems += signature_problems(ours, theirs, variadic_by_kind=True)
    expected = ", ".join(format_parameter(p) for p in theirs)
    assert not problems, (
        f"{path}{inspect.signature(obj)} differs from megatron-core ({expected}):\n  "
        + "\n  ".join(problems)
    )


@pytest.mark.parametrize("path", CP_GROUP_PATHS, ids=_short)
def test_forward_step_gains_cp_group(path: str) -> None:
    """SPEC extension (fails on real megatron-core): a trailing optional ``cp_group=None``."""
    _, obj, fact = _ours(path)
    extras = {p["name"]: p for p in signature_parameters(obj)[len(fact["parameters"]) :]}
    assert "cp_group" in extras, f"{path}{inspect.signature(obj)} lacks a trailing cp_group"
    cp_group = extras["cp_group"]
    assert cp_group["default"] == "None", f"cp_group defaults to {cp_group['default']}"
    assert cp_group["kind"] in {"POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY"}, cp_group["kind"]


@pytest.mark.parametrize("path", list(CONFIGS), ids=_short)
def test_config_field_defaults(path: str) -> None:
    """Each recorded config field exists with megatron-core's raw dataclass default."""
    fact = CONFIGS[path]
    cls = getattr(importlib.import_module(fact["module"]), fact["name"])
    assert dataclasses.is_dataclass(cls), f"{path} is not a dataclass"
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problems = []
    for name, want in fact["fields"].items():
        field = fields.get(name)
        if field is None:
            problems.append(f"{name}: missing")
            continue
        if field.default is not dataclasses.MISSING:
            got = str(field.default) if want["type"] == "dtype" else repr(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            got = "<factory>"
        else:
            got = "<required>"
        expected = want["value"] if want["value"] is not None else f"<{want['type']}>"
        if got != expected:
            problems.append(f"{name}: default {got}, megatron-core has {expected}")
        if field.init != want["init"]:
            problems.append(f"{name}: init={field.init}, megatron-core has init={want['init']}")
    assert not problems, f"{path}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("path", list(ENUMS), ids=_short)
def test_enum_members(path: str) -> None:
    """Each megatron-core enum member exists in ours with the same value."""
    fact = ENUMS[path]
    cls = getattr(importlib.import_module(fact["module"]), fact["name"])
    ours = {member.name: member.value for member in cls}
    for name, value in fact["members"].items():
        assert ours.get(name) == value, f"{path}.{name}: ours {ours.get(name)!r}, expected {value}"


def _process_group_collection() -> Any:
    module = importlib.import_module("megatron.core.process_groups_config")
    return module.ProcessGroupCollection


def test_process_group_collection_rejects_unknown_field() -> None:
    """Keyword construction with an unknown name raises, naming it."""
    with pytest.raises((TypeError, ValueError), match="foo"):
        _process_group_collection()(foo=1)


def test_process_group_collection_accepts_fields() -> None:
    """Every SPEC field can be given as a keyword and reads back unchanged."""
    values = {name: object() for name in PGC_FIELDS}
    pgc = _process_group_collection()(**values)
    for name, value in values.items():
        assert getattr(pgc, name) is value, name


def test_process_group_collection_unset_fields_are_none() -> None:
    """SPEC extension (real megatron-core raises AttributeError): unset fields read as None."""
    cls = _process_group_collection()
    assert all(getattr(cls(), name) is None for name in PGC_FIELDS)
    pgc = cls(tp="tp-group")
    assert pgc.tp == "tp-group"
    assert all(getattr(pgc, name) is None for name in PGC_FIELDS if name != "tp")


@pytest.mark.parametrize("key", list(LAYOUTS))
def test_rank_layout_facts_are_consistent(key: str) -> None:
    """Recorded groups partition the world with the expected sizes (a check of the data)."""
    layout = LAYOUTS[key]
    world, groups = layout["world_size"], layout["groups"]
    assert set(groups) == set(GROUP_NAMES)
    sizes = {"tp": layout["tp"], "cp": layout["cp"], "pp": layout["pp"], "dp": layout["dp"]}
    for name in GROUP_NAMES:
        if name in ("embd", "pos_embd"):
            continue
        axes = {"mp": ["tp", "pp"]}.get(name, name.split("_"))
        size = 1
        for axis in axes:
            size *= sizes[axis]
        assert sorted(r for ranks in groups[name] for r in ranks) == list(range(world)), name
        assert all(len(ranks) == size for ranks in groups[name]), name
    for pp_ranks, embd, pos_embd in zip(groups["pp"], groups["embd"], groups["pos_embd"]):
        assert embd == sorted({pp_ranks[0], pp_ranks[-1]}, key=pp_ranks.index)
        assert pos_embd == [pp_ranks[0]]


def test_rank_layout_first_axis_has_stride_one() -> None:
    """World 4, C=2, PP=2, as SPEC section 2 spells it out."""
    groups = rank_layout(4, cp=2, pp=2)["groups"]
    assert groups["cp"] == [[0, 1], [2, 3]]
    assert groups["pp"] == [[0, 2], [1, 3]]
    assert groups["embd"] == [[0, 2], [1, 3]]
    assert groups["pos_embd"] == [[0], [1]]


def test_experimental_flag_round_trips() -> None:
    """megatron.core.config: off by default (as recorded), set_experimental_flag sets it."""
    config = importlib.import_module("megatron.core.config")
    assert config.ENABLE_EXPERIMENTAL is VALUES["megatron.core.config.ENABLE_EXPERIMENTAL"]
    try:
        config.set_experimental_flag(True)
        assert config.ENABLE_EXPERIMENTAL and config.is_experimental_enabled()
    finally:
        config.set_experimental_flag(False)
    assert not config.is_experimental_enabled()


def test_is_te_min_version_is_false_without_transformer_engine() -> None:
    """SPEC: False without Transformer Engine (megatron-core raises TypeError there)."""
    utils = importlib.import_module("megatron.core.utils")
    try:
        importlib.import_module("transformer_engine")
    except ImportError:
        assert utils.is_te_min_version("0.1") is False
        assert utils.is_te_min_version("1.0", check_equality=False) is False
    else:  # pragma: no cover - only where TE is installed
        assert isinstance(utils.is_te_min_version("0.1"), bool)


def test_legacy_mpu_alias_and_torch_version() -> None:
    """``megatron.core.mpu`` is parallel_state; ``is_torch_min_version`` compares torch."""
    core = importlib.import_module("megatron.core")
    import torch

    assert core.mpu is core.parallel_state
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert core.is_torch_min_version(major_minor) is True
    assert core.is_torch_min_version("999.0") is False


def test_is_te_min_version_compares_an_installed_transformer_engine(monkeypatch) -> None:
    """With a Transformer Engine importable (a stand-in module at version 2.5.0), the
    answer is the version comparison megatron-core makes."""
    import importlib.machinery
    import sys
    import types

    fake = types.ModuleType("transformer_engine")
    fake.__version__ = "2.5.0"
    fake.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine", fake)
    utils = importlib.import_module("megatron.core.utils")
    assert utils.is_te_min_version("2.0") is True
    assert utils.is_te_min_version("2.5.0") is True
    assert utils.is_te_min_version("2.5.0", check_equality=False) is False
    assert utils.is_te_min_version("2.10") is False
