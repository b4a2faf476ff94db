"""Record megatron-core 0.16.1's FP8 / low-precision config fields into
``tests/unit_tests/data/mcore_fp8_facts.json`` (checked by
``tests/unit_tests/transformer/test_fp8_config.py``).

Run with the real megatron-core, outside the repository so that ``import megatron`` finds it:

    cd /tmp && env -u PYTHONPATH /work/mcore-venv/bin/python \\
        /path/to/repo/tests/tools/record_fp8_facts.py

``config_fields``: every ``TransformerConfig`` field whose name holds "fp8", "fp4", "amax",
"kitchen" or "bf16" (the FP8 layer exemptions) except the MoE ones (``mcore_moe_facts.json``),
with its raw default (``type``, ``value`` as repr) and its annotation as text. Only facts are
recorded (names, defaults); no megatron-core code is copied.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

from record_mcore_facts import _default_fact

OUT = Path(__file__).resolve().parents[1] / "unit_tests" / "data" / "mcore_fp8_facts.json"
KEYS = ("fp8", "fp4", "amax", "kitchen", "in_bf16", "layers_bf16")


def record_config_fields() -> dict:
    from megatron.core.transformer.transformer_config import TransformerConfig

    out = {}
    for field in dataclasses.fields(TransformerConfig):
        if not any(key in field.name for key in KEYS) or "moe" in field.name:
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
            "generated_by": "tests/tools/record_fp8_facts.py",
        },
        "config_fields": record_config_fields(),
    }
    OUT.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}: {len(facts['config_fields'])} fields")


if __name__ == "__main__":
    main()
