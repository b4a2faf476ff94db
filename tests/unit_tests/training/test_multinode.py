"""Several nodes, simulated on this machine: two torchrun agents that meet through a c10d
rendezvous on 127.0.0.1, as two nodes of a cluster do (docs/multinode.md).

What differs from one node: global and node-local ranks differ (RANK vs LOCAL_RANK), so
whatever is done once must be done by global rank 0 (the comparison run, metrics, the common
checkpoint files) and nothing may key on LOCAL_RANK alone; the checkpoint is one directory on
a file system both "nodes" share, each rank writing its own shard.
"""

import json
from pathlib import Path

import pytest

from tests.unit_tests.launch import run_torchrun_nodes

pytestmark = pytest.mark.world(1)  # each test starts its own agents

# Both cases are in the slow run: two agents and a rendezvous cost ~20 s even for 3 steps.

LIMIT_S = 240
SMALL = ["--num-layers", "2", "--hidden-size", "16", "--seq-length", "16", "--no-progress"]


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 30)
def test_two_nodes_of_one_process_train_as_one_process(tmp_path: Path):
    """2 nodes x 1 process, C = 2 across the nodes: the run passes --compare-single-process
    (the one-process run and its verdict happen once, on global rank 0), and the checkpoint
    and metrics are written once."""
    target = ["-m", "megatron.training", "--cp", "2", "--train-iters", "3", *SMALL]
    target += ["--compare-single-process", "--save", str(tmp_path / "ck")]
    target += ["--save-metrics", str(tmp_path / "metrics")]
    results = run_torchrun_nodes(2, 1, target, limit_s=LIMIT_S)
    for node, (code, output) in enumerate(results):
        assert code == 0, f"node {node}:\n{output[-3000:]}"
    everything = "".join(output for _, output in results)
    assert everything.count(": PASS") == 1, everything[-3000:]
    assert "layout cp2-pp1-dp1 on 2 processes" in results[0][1], results[0][1][-3000:]
    assert ": PASS" not in results[1][1]  # the second node's agent printed no verdict
    tracker = tmp_path / "ck" / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == "3"
    records = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").open()]
    assert [r["iteration"] for r in records] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 30)
def test_the_parity_bucket_passes_on_two_nodes_of_two_processes():
    """The 4-rank CP-normalization parity bucket, launched as 2 nodes x 2 processes (the
    ranks of a CP group on different nodes); a pytest run per node, every one passing."""
    target = ["-m", "pytest", "tests/unit_tests/pipeline_parallel/test_cp_loss_normalization.py"]
    target += ["-q", "-p", "no:randomly", "-x"]
    results = run_torchrun_nodes(2, 2, target, limit_s=LIMIT_S)
    for node, (code, output) in enumerate(results):
        assert code == 0, f"node {node}:\n{output[-3000:]}"
        assert " passed" in output and " failed" not in output, output[-3000:]
