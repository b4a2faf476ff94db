"""The parity bucket can fail: with reduce_loss_across_cp replaced from outside by the old
per-shard normalization, a 4-rank launch of the bucket fails on uneven masks at CP > 1."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "tests/unit_tests/pipeline_parallel/test_cp_loss_normalization.py"


# Slow: a 4-rank launch of its own. The default run catches per-shard normalization inside
# the bucket (test_cp_loss_normalization.py::test_negative_control_per_shard_normalization_fails,
# 4 ranks); this checks from outside that the launched bucket then exits non-zero.
@pytest.mark.slow
@pytest.mark.world(1)
@pytest.mark.timeout(180)
def test_bucket_fails_with_per_shard_normalization():
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "4",
        "--local-ranks-filter",
        "0",
        "-m",
        "pytest",
        "-p",
        "tests.tools.per_shard_normalization",
        BUCKET,
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "-k",
        "test_gradients_match_dense_reference and cp2-pp2-dp1-mb3",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    output = done.stdout + done.stderr
    assert (
        done.returncode != 0
    ), f"the bucket passed with per-shard normalization:\n{output[-3000:]}"
    assert "main_grad" in output and "relative error" in output, output[-3000:]
    assert "cp2-pp2-dp1-mb3-full-averaged PASSED" not in output  # sanity: ran the bucket
