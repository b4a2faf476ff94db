"""The GPT-building modules keep megatron-core 0.16.1's signatures (recorded in
``data/mcore_gpt_signatures.json`` by ``tests/tools/record_gpt_signature_facts.py``): every
megatron-core parameter with the same name, kind, position and default; extra parameters
only after them and with defaults.
"""

import json
from pathlib import Path

import pytest

from tests.unit_tests.mcore_facts import resolve, signature_parameters, signature_problems

FACTS = json.loads((Path(__file__).parents[1] / "data" / "mcore_gpt_signatures.json").read_text())

pytestmark = pytest.mark.world(1)

# Deliberate differences, each with its reason.
DEFAULT_DIFFERENCES = {
    # megatron-core requires attention_mask; we accept its omission (the mask is causal by
    # global position and is ignored), so older callers keep working
    ("megatron.core.models.gpt.gpt_model.GPTModel.forward", "attention_mask"): "None",
}


def test_facts_are_from_megatron_core_0_16_1():
    assert FACTS["meta"]["megatron_core_version"] == "0.16.1"


@pytest.mark.parametrize("path", sorted(FACTS["signatures"]))
def test_signature_matches_megatron_core(path):
    fact = FACTS["signatures"][path]
    ours = signature_parameters(resolve(fact["module"], fact["qualname"])[1])
    theirs = [dict(p) for p in fact["parameters"]]
    for want in theirs:
        if (path, want["name"]) in DEFAULT_DIFFERENCES:
            want["default"] = DEFAULT_DIFFERENCES[(path, want["name"])]
    problems = signature_problems(ours, theirs, variadic_by_kind=False)
    assert not problems, f"{path}:\n  " + "\n  ".join(problems)
