"""Names, parameters and defaults of the datasets, tokenizers, optimizer and scheduler equal
megatron-core 0.16.1's (facts recorded by ``tests/tools/record_mcore_data_opt_facts.py``).

Every megatron-core parameter must exist in ours at the same position with the same kind and
default repr; extra parameters must come after them with defaults. Config dataclasses must
have every recorded field with the same default.
"""

import dataclasses
import importlib
import inspect
import json
from pathlib import Path

import pytest

FACTS = json.loads(
    (Path(__file__).parent / "data" / "mcore_facts_data_opt.json").read_text(encoding="utf-8")
)

pytestmark = pytest.mark.world(1)


def _params(obj):
    return [
        {
            "name": p.name,
            "kind": p.kind.name,
            "default": None if p.default is inspect.Parameter.empty else repr(p.default),
        }
        for p in inspect.signature(obj).parameters.values()
    ]


def _resolve(module, qualname):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(
    "path", sorted(FACTS["signatures"]), ids=lambda p: p[len("megatron.core.") :]
)
def test_signature(path):
    fact = FACTS["signatures"][path]
    ours = _params(_resolve(fact["module"], fact["qualname"]))
    theirs = fact["parameters"]
    problems = []
    for i, want in enumerate(theirs):
        got = ours[i] if i < len(ours) else None
        same = got is not None and (
            got["kind"] == want["kind"]
            if want["kind"] in ("VAR_POSITIONAL", "VAR_KEYWORD")
            else got == want
        )
        if not same:
            problems.append(f"#{i}: expected {want}, got {got}")
    for extra in ours[len(theirs) :]:
        if extra["default"] is None and extra["kind"] not in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            problems.append(f"extra parameter {extra} without a default")
    assert not problems, path + "\n" + "\n".join(problems)


@pytest.mark.parametrize("path", sorted(FACTS["config_fields"]), ids=lambda p: p.rsplit(".", 1)[1])
def test_config_fields(path):
    fact = FACTS["config_fields"][path]
    cls = getattr(importlib.import_module(fact["module"]), fact["name"])
    ours = {f.name: f for f in dataclasses.fields(cls)}
    problems = []
    for name, want in fact["fields"].items():
        if name not in ours:
            problems.append(f"missing field {name}")
            continue
        default = ours[name].default
        got = None
        if default is not dataclasses.MISSING:
            got = str(default) if "torch" in repr(type(default)) else repr(default)
        if got != want["value"] or ours[name].init != want["init"]:
            problems.append(f"{name}: default {got} (init={ours[name].init}), expected {want}")
    assert not problems, path + "\n" + "\n".join(problems)
