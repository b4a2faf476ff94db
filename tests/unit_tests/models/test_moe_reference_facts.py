"""The float64 MoE reference agrees with megatron-core 0.16.1's routing and router-loss
semantics, recorded by ``tests/tools/record_moe_facts.py`` in ``data/mcore_moe_facts.json``
(one process; the reference is checked, not our model code): for every recorded routing
setting the same experts and combine weights per token, and the same aux and z losses."""

import json
from pathlib import Path

import pytest
import torch

from tests.unit_tests.models.moe_reference import MoEArch, route, router_losses

FACTS = json.loads((Path(__file__).parents[1] / "data" / "mcore_moe_facts.json").read_text())
ROUTING = FACTS["routing"]

pytestmark = pytest.mark.world(1)


def _moe(kwargs: dict) -> MoEArch:
    return MoEArch(
        experts=len(ROUTING["logits"][0]),
        topk=kwargs["topk"],
        ffn=1,
        score=kwargs.get("score_function", "softmax"),
        pre_softmax=kwargs.get("use_pre_softmax", False),
        scaling=kwargs.get("scaling_factor"),
        num_groups=kwargs.get("num_groups"),
        group_topk=kwargs.get("group_topk"),
        expert_bias="expert_bias" in kwargs,
    )


def test_facts_are_from_megatron_core_0_16_1():
    assert FACTS["meta"]["megatron_core_version"] == "0.16.1"


@pytest.mark.parametrize("case_id", sorted(ROUTING["cases"]))
def test_reference_routing_equals_megatron_core(case_id):
    case = ROUTING["cases"][case_id]
    moe = _moe(case["kwargs"])
    logits = torch.tensor(ROUTING["logits"], dtype=torch.float64)
    bias = torch.tensor(ROUTING["expert_bias"], dtype=torch.float64)
    for t, row in enumerate(logits):
        decision, weights = route(row, moe, bias if moe.expert_bias else None)
        assert decision.margin > 1e-6, f"{case_id} token {t}: the recorded case is a near tie"
        chosen = [e for e, on in enumerate(case["routing_map"][t]) if on]
        assert sorted(decision.experts) == chosen, f"{case_id} token {t}"
        expected = [case["probs"][t][e] for e in decision.experts]
        # megatron-core computes softmax/sigmoid scores in float32 even for float64 logits
        assert [float(w) for w in weights] == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_reference_aux_and_z_losses_equal_megatron_core():
    """One sequence, no padding: aux = switch_load_balancing_loss_func with the aux map's
    counts, z = z_loss_func (a mean over the tokens)."""
    logits = torch.tensor(ROUTING["logits"], dtype=torch.float64)[None]  # [b=1, s, E]
    valid = torch.ones(logits.shape[:2], dtype=torch.bool)
    args = ROUTING["switch_load_balancing"]["args"]
    moe = MoEArch(
        experts=args["num_experts"],
        topk=args["topk"],
        ffn=1,
        aux=args["moe_aux_loss_coeff"],
        seq_aux=args["moe_aux_loss_coeff"],
        z=ROUTING["z_loss"]["coeff"],
    )
    stats = router_losses(logits, valid, moe)
    assert float(stats.aux) == pytest.approx(ROUTING["switch_load_balancing"]["loss"], rel=1e-12)
    # (the recorded inputs were float64 softmax scores, so this one is float64 exact)
    # one sequence: the sequence-level loss is the micro-batch one
    assert float(stats.seq_aux) == pytest.approx(float(stats.aux), rel=1e-12)
    assert float(stats.z) == pytest.approx(ROUTING["z_loss"]["loss"], rel=1e-12)
