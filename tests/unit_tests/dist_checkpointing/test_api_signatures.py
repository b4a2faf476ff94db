"""The checkpointing API has megatron-core 0.16.1's names, parameters and defaults.

Facts recorded from the real megatron-core by ``tests/tools/record_checkpoint_facts.py``
(``data/mcore_facts_checkpointing.json``); compared like ``test_api_compat``: every
megatron-core parameter present with the same name, kind, position and default repr, extra
parameters only after them and with defaults.
"""

import importlib
import inspect
import json
from pathlib import Path

import pytest

from tests.unit_tests.mcore_facts import (
    binding,
    resolve,
    signature_parameters,
    signature_problems,
)

pytestmark = pytest.mark.world(1)

FACTS = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "mcore_facts_checkpointing.json").read_text()
)
SIGNATURES = FACTS["signatures"]


@pytest.mark.parametrize("path", list(SIGNATURES), ids=lambda p: p.removeprefix("megatron.core."))
def test_signature_matches_mcore(path):
    fact = SIGNATURES[path]
    owner, obj = resolve(fact["module"], fact["qualname"])
    ours, theirs = signature_parameters(obj), fact["parameters"]
    problems = []
    if binding(owner, fact["qualname"]) != fact["binding"]:
        problems.append(f"bound as {binding(owner, fact['qualname'])}, not {fact['binding']}")
    problems += signature_problems(ours, theirs, variadic_by_kind=True)
    assert not problems, f"{path}{inspect.signature(obj)}:\n  " + "\n  ".join(problems)


def test_strict_handling_values_match_mcore():
    ((path, fact),) = FACTS["enums"].items()
    module, name = path.rsplit(".", 1)
    enum = getattr(importlib.import_module(module), name)
    recorded = fact.get("members", fact)
    assert {m.name: m.value for m in enum} == recorded
