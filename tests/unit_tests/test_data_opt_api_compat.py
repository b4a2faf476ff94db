"""Names, parameters and defaults of the datasets, tokenizers, optimizer and scheduler equal
megatron-core 0.16.1's (facts recorded by ``tests/tools/record_mcore_data_opt_facts.py``).

Every megatron-core parameter must exist in ours at the same position with the same kind and
default repr; extra parameters must come after them with defaults. Config dataclasses must
have every recorded field with the same default.
"""

import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from tests.unit_tests.mcore_facts import resolve, signature_parameters, signature_problems

FACTS = json.loads(
    (Path(__file__).parent / "data" / "mcore_facts_data_opt.json").read_text(encoding="utf-8")
)

pytestmark = pytest.mark.world(1)


@pytest.mark.parametrize(
    "path", sorted(FACTS["signatures"]), ids=lambda p: p[len("megatron.core.") :]
)
def test_signature(path):
    fact = FACTS["signatures"][path]
    ours = signature_parameters(resolve(fact["module"], fact["qualname"])[1])
    theirs = fact["parameters"]
    problems = signature_problems(ours, theirs, variadic_by_kind=True, extra_variadic_ok=True)
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
