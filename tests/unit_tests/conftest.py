"""Test-session setup shared by every bucket.

Under torchrun (WORLD_SIZE set) one gloo process group is created per session. Tests marked
``@pytest.mark.world(4, 8)`` run only in launches of those sizes (a test and its parameter may
both be marked: every mark must allow the size); other launches deselect them and say so in
the summary, so nothing is skipped silently.
"""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))

# gloo on CPU by default; TEST_BACKEND=nccl runs the same tests on one GPU per rank.
BACKEND = os.environ.get("TEST_BACKEND", "gloo")

if "WORLD_SIZE" in os.environ and not dist.is_initialized():
    torch.set_num_threads(1)
    if BACKEND == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=120))


def pytest_configure(config):
    xmlpath = getattr(config.option, "xmlpath", None)
    if xmlpath and "RANK" in os.environ:  # one JUnit report per rank
        stem = xmlpath[:-4] if xmlpath.endswith(".xml") else xmlpath
        config.option.xmlpath = f"{stem}-rank{os.environ['RANK']}.xml"
    config.addinivalue_line(
        "markers", "world(*sizes): run only under torchrun with one of these world sizes"
    )


def pytest_collection_modifyitems(config, items):
    keep, dropped = [], []
    for item in items:
        # Every world mark must allow this size (a parameter's mark narrows its function's).
        if any(WORLD_SIZE not in marker.args for marker in item.iter_markers("world")):
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
        config._world_deselected = len(dropped)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    count = getattr(config, "_world_deselected", 0)
    if count:
        terminalreporter.write_line(
            f"world size {WORLD_SIZE}: deselected {count} tests written for other world sizes "
            "(the README test command runs them under torchrun with 2, 4 and 8 ranks)"
        )


def pytest_sessionfinish(session, exitstatus):
    """``tests/run_tests.sh --slow``: a world size that holds no slow test is not a failure."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and os.environ.get(
        "MEGATRON_TESTS_ALLOW_EMPTY"
    ):
        session.exitstatus = pytest.ExitCode.OK
