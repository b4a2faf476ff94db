"""A script written only against megatron-core's public API runs unchanged on this core
(examples/megatron_style_step.py) on CP=2 x PP=2, PP=2 x VPP=2 and CP=2 x DP=2."""

import importlib.util
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.unit_tests.dist_utils import assert_no_failures, reset_layout

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "megatron_style_step.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("megatron_style_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.world(4)
@pytest.mark.parametrize(
    "layout",
    [dict(cp=2, pp=2), dict(pp=2, vpp=2), dict(cp=2)],
    ids=["cp2-pp2", "pp2-vpp2", "cp2-dp2"],
)
def test_script_runs_unchanged_and_learns(layout):
    reset_layout()
    losses = _load_script().main(steps=3, **layout)
    failures = []
    if losses and not losses[-1] < losses[0]:
        failures.append(f"loss did not fall: {losses}")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, bool(losses))
    if not any(everyone):
        failures.append("no rank reported a loss")
    assert_no_failures(failures)
