"""``megatron.core.tensor_parallel`` keeps megatron-core 0.16.1's signatures (recorded in
``data/mcore_tensor_parallel_facts.json`` by ``tests/tools/record_tensor_parallel_facts.py``):
every megatron-core parameter with the same name, kind, position and default; extra
parameters only after them and with defaults. The package exports every name of its
``__all__`` that we implement; the missing ones are listed here, each with its reason.
"""

import json
from pathlib import Path

import pytest

import megatron.core.tensor_parallel as tp
from tests.unit_tests.mcore_facts import resolve, signature_parameters, signature_problems

FACTS = json.loads(
    (Path(__file__).parents[1] / "data" / "mcore_tensor_parallel_facts.json").read_text()
)

NOT_IMPLEMENTED = {
    "CheckpointWithoutOutput": "recompute-without-output (a memory optimization of MLA/MoE)",
}

pytestmark = pytest.mark.world(1)


def test_facts_are_from_megatron_core_0_16_1():
    assert FACTS["meta"]["megatron_core_version"] == "0.16.1"


@pytest.mark.parametrize("path", sorted(FACTS["signatures"]))
def test_signature_matches_megatron_core(path):
    fact = FACTS["signatures"][path]
    ours = signature_parameters(resolve(fact["module"], fact["qualname"])[1])
    theirs = fact["parameters"]
    problems = signature_problems(ours, theirs, variadic_by_kind=False)
    assert not problems, f"{path}:\n  " + "\n  ".join(problems)


def test_package_exports_megatron_cores_names():
    missing = sorted(set(FACTS["package_all"]) - set(tp.__all__) - set(NOT_IMPLEMENTED))
    assert not missing, f"megatron.core.tensor_parallel lacks {missing}"
    for name in tp.__all__:
        assert hasattr(tp, name), name
