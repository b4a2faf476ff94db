"""Record megatron-core 0.16.1's mixture-of-experts facts into
``tests/unit_tests/data/mcore_moe_facts.json`` (checked by
``tests/unit_tests/transformer/test_moe_facts.py``).

Run with the real megatron-core, outside the repository so that ``import megatron`` finds it:

    cd /tmp && env -u PYTHONPATH /work/mcore-venv/bin/python \\
        /path/to/repo/tests/tools/record_moe_facts.py

Sections:
- ``config_fields``: every ``TransformerConfig`` field whose name holds "moe" or "expert",
  with its raw default (``type``, ``value`` as repr) and its annotation as text;
- ``signatures``: the MoE classes' constructors and the ``moe_utils`` functions (same format
  as ``mcore_facts.json``);
- ``routing``: outputs of ``topk_routing_with_score_function`` on small float64 CPU logits for
  each routing setting (probabilities and map as lists), and of
  ``switch_load_balancing_loss_func`` and ``z_loss_func`` on fixed inputs: the semantics the
  float64 reference (``tests/unit_tests/models/moe_reference.py``) must agree with.

Only facts are recorded (names, defaults, numbers); no megatron-core code is copied.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import warnings
from pathlib import Path

from record_mcore_facts import _default_fact, record_signature

OUT = Path(__file__).resolve().parents[1] / "unit_tests" / "data" / "mcore_moe_facts.json"

_M = "megatron.core.transformer.moe"
SIGNATURES = [
    (f"{_M}.moe_layer", "MoELayer.__init__"),
    (f"{_M}.moe_layer", "MoELayer.forward"),
    (f"{_M}.moe_layer", "MoESubmodules.__init__"),
    (f"{_M}.router", "TopKRouter.__init__"),
    (f"{_M}.router", "TopKRouter.forward"),
    (f"{_M}.router", "TopKRouter.routing"),
    (f"{_M}.token_dispatcher", "MoEAllGatherTokenDispatcher.__init__"),
    (f"{_M}.token_dispatcher", "MoEAlltoAllTokenDispatcher.__init__"),
    (f"{_M}.experts", "SequentialMLP.__init__"),
    (f"{_M}.experts", "GroupedMLP.__init__"),
    (f"{_M}.shared_experts", "SharedExpertMLP.__init__"),
    (f"{_M}.moe_utils", "switch_load_balancing_loss_func"),
    (f"{_M}.moe_utils", "z_loss_func"),
    (f"{_M}.moe_utils", "topk_routing_with_score_function"),
    (f"{_M}.moe_utils", "permute"),
    (f"{_M}.moe_utils", "unpermute"),
    (f"{_M}.moe_utils", "save_to_aux_losses_tracker"),
    (f"{_M}.moe_utils", "clear_aux_losses_tracker"),
    (f"{_M}.moe_utils", "track_moe_metrics"),
    (f"{_M}.moe_utils", "get_default_pg_collection"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_decoder_block_spec"),
]

# (id, keyword arguments of topk_routing_with_score_function besides logits)
ROUTINGS = [
    ("softmax-top2", {"topk": 2}),
    ("softmax-top1", {"topk": 1}),
    ("presoftmax-top2", {"topk": 2, "use_pre_softmax": True}),
    ("presoftmax-top2-scaled", {"topk": 2, "use_pre_softmax": True, "scaling_factor": 2.5}),
    ("sigmoid-top2", {"topk": 2, "score_function": "sigmoid"}),
    ("sigmoid-top1", {"topk": 1, "score_function": "sigmoid"}),
    ("sigmoid-top2-bias", {"topk": 2, "score_function": "sigmoid", "expert_bias": "bias"}),
    ("grouped-top2", {"topk": 2, "num_groups": 4, "group_topk": 2, "use_pre_softmax": True}),
    (
        "grouped-sigmoid-top4",
        {"topk": 4, "num_groups": 4, "group_topk": 2, "score_function": "sigmoid"},
    ),  # noqa: E501
]
NUM_TOKENS, NUM_EXPERTS = 6, 8


def logits_and_bias():
    """The inputs (float64, CPU), from a fixed formula rather than a random generator."""
    import torch

    t = torch.arange(NUM_TOKENS, dtype=torch.float64)[:, None]
    e = torch.arange(NUM_EXPERTS, dtype=torch.float64)[None, :]
    logits = torch.sin(1.3 * t + 0.7 * e * e) * 2.0 + 0.1 * e
    bias = torch.cos(e.view(-1) * 1.1) * 0.5
    return logits, bias


def record_routing() -> dict:
    import torch

    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")

    logits, bias = logits_and_bias()
    out = {"logits": logits.tolist(), "expert_bias": bias.tolist(), "cases": {}}
    for case_id, kwargs in ROUTINGS:
        call = dict(kwargs)
        if call.get("expert_bias") == "bias":
            call["expert_bias"] = bias
        probs, routing_map = moe_utils.topk_routing_with_score_function(logits, **call)
        out["cases"][case_id] = {
            "kwargs": kwargs,
            "probs": probs.tolist(),
            "routing_map": routing_map.int().tolist(),
        }
    probs = torch.softmax(logits, -1)
    top = probs.topk(2, dim=-1).indices  # the aux map's counts: top-2 of the softmax scores
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.float64).scatter_add(
        0, top.reshape(-1), torch.ones(top.numel(), dtype=torch.float64)
    )
    out["switch_load_balancing"] = {
        "args": {"total_num_tokens": 6, "topk": 2, "num_experts": 8, "moe_aux_loss_coeff": 0.3},
        "tokens_per_expert": counts.tolist(),
        "loss": float(
            moe_utils.switch_load_balancing_loss_func(
                probs, counts, total_num_tokens=6, topk=2, num_experts=8, moe_aux_loss_coeff=0.3
            )
        ),
    }
    out["z_loss"] = {"coeff": 0.01, "loss": float(moe_utils.z_loss_func(logits, 0.01))}
    return out


def record_config_fields() -> dict:
    from megatron.core.transformer.transformer_config import TransformerConfig

    out = {}
    for field in dataclasses.fields(TransformerConfig):
        if "moe" not in field.name and "expert" not in field.name:
            continue
        if field.default is not dataclasses.MISSING:
            fact = _default_fact(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            fact = {"type": "factory", "value": None}
        else:
            fact = {"type": "required", "value": None}
        out[field.name] = {**fact, "annotation": str(field.type), "init": field.init}
    return out


def main() -> None:
    import megatron.core

    warnings.simplefilter("ignore")
    facts = {
        "meta": {
            "megatron_core_version": megatron.core.__version__,
            "generated_by": "tests/tools/record_moe_facts.py",
        },
        "config_fields": record_config_fields(),
        "signatures": {f"{m}.{q}": record_signature(m, q) for m, q in SIGNATURES},
        "routing": record_routing(),
    }
    OUT.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}: {len(facts['config_fields'])} fields, {len(SIGNATURES)} signatures")


if __name__ == "__main__":
    main()
