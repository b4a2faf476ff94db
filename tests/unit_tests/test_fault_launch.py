"""A rank that fails mid-schedule ends the whole torchrun launch (SPEC section 8).

Launches ``tests/unit_tests/fault_scripts/forward_raises_mid_schedule.py`` on 4 ranks
(PP=2, CP=2, rank 1 raises inside ``forward_step_func`` at microbatch 2) and checks that the
launch exits non-zero, well within its time limit, with the raised message in its output.
"""

import pytest

from tests.unit_tests.fault_scripts.forward_raises_mid_schedule import (
    FAULT_MICROBATCH,
    FAULT_RANK,
    MESSAGE,
)
from tests.unit_tests.launch import run_torchrun

LIMIT_S = 120  # the launch is killed after this; it must end long before


@pytest.mark.world(1)
@pytest.mark.timeout(LIMIT_S + 30)
def test_a_rank_raising_in_forward_step_func_ends_the_launch_non_zero_and_quickly():
    module = "tests.unit_tests.fault_scripts.forward_raises_mid_schedule"
    code, output, seconds = run_torchrun(4, ["-m", module], limit_s=LIMIT_S)
    print(f"fault launch ended with exit code {code} after {seconds:.1f} s")
    expected = MESSAGE.format(rank=FAULT_RANK, microbatch=FAULT_MICROBATCH)
    assert code != 0, output[-4000:]
    assert expected in output, output[-4000:]
    assert f"rank {FAULT_RANK}: step finished" not in output
    assert seconds < LIMIT_S / 2, f"the launch took {seconds:.1f} s"
