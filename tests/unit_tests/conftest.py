"""Test-session setup shared by every bucket.

Under torchrun (WORLD_SIZE set) one gloo process group is created per session. Tests marked
``@pytest.mark.world(4, 8)`` run only in launches of those sizes (a test and its parameter may
both be marked: every mark must allow the size); other launches deselect them and say so in
the summary, so nothing is skipped silently. A test without a world mark runs in every launch.

``--plan-worlds DIR`` (given by tests/run_tests.sh to the one-process run, which collects the
whole tree anyway) writes ``DIR/world{N}-{default,slow}.txt`` for N in ``LAUNCH_WORLDS``: the
test files holding a test that an N-rank launch would run, in the default run or under
``-m slow``. Each torchrun launch then collects only those files, so a rank never imports a
module (or transformers) it has nothing to run from. See tests/README.md.
"""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))

# The torchrun launches of tests/run_tests.sh (8 ranks only in its --slow run).
LAUNCH_WORLDS = (2, 4, 8)

# gloo on CPU by default; TEST_BACKEND=nccl runs the same tests on one GPU per rank.
BACKEND = os.environ.get("TEST_BACKEND", "gloo")

if "WORLD_SIZE" in os.environ and not dist.is_initialized():
    torch.set_num_threads(1)
    if BACKEND == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=120))


def pytest_addoption(parser):
    parser.addoption(
        "--plan-worlds",
        metavar="DIR",
        default=None,
        help="write DIR/world{N}-{default,slow}.txt: the test files holding tests for N ranks",
    )


def pytest_configure(config):
    xmlpath = getattr(config.option, "xmlpath", None)
    if xmlpath and "RANK" in os.environ:  # one JUnit report per rank
        stem = xmlpath[:-4] if xmlpath.endswith(".xml") else xmlpath
        config.option.xmlpath = f"{stem}-rank{os.environ['RANK']}.xml"
    config.addinivalue_line(
        "markers", "world(*sizes): run only under torchrun with one of these world sizes"
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the plan covers default and slow
def pytest_collection_modifyitems(config, items):
    plan_dir = config.getoption("plan_worlds")
    if plan_dir:
        write_world_plan(items, plan_dir)
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


def allowed_worlds(item) -> set:
    """The launch sizes ``item`` runs in: those every world mark allows (all when unmarked)."""
    worlds = set(LAUNCH_WORLDS)
    for marker in item.iter_markers("world"):
        worlds &= set(marker.args)
    return worlds


def write_world_plan(items, plan_dir: str) -> None:
    """``plan_dir/world{N}-{default,slow}.txt``: the files with a test an N-rank launch runs
    (experimental tests are in neither run)."""
    files = {(n, run): set() for n in LAUNCH_WORLDS for run in ("default", "slow")}
    for item in items:
        if item.get_closest_marker("experimental"):
            continue
        run = "slow" if item.get_closest_marker("slow") else "default"
        path = item.nodeid.split("::")[0]
        for n in allowed_worlds(item):
            files[(n, run)].add(path)
    os.makedirs(plan_dir, exist_ok=True)
    for (n, run), paths in files.items():
        # Written whole, then renamed: pytest-xdist workers each collect and write the same.
        path = os.path.join(plan_dir, f"world{n}-{run}.txt")
        temporary = f"{path}.{os.getpid()}"
        with open(temporary, "w") as handle:
            handle.writelines(f"{name}\n" for name in sorted(paths))
        os.replace(temporary, path)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    count = getattr(config, "_world_deselected", 0)
    if count:
        terminalreporter.write_line(
            f"world size {WORLD_SIZE}: deselected {count} tests written for other world sizes "
            "(tests/run_tests.sh runs them under torchrun with 2 and 4 ranks, 8 in --slow)"
        )


def pytest_sessionfinish(session, exitstatus):
    """``tests/run_tests.sh --slow``: a world size that holds no slow test is not a failure."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and os.environ.get(
        "MEGATRON_TESTS_ALLOW_EMPTY"
    ):
        session.exitstatus = pytest.ExitCode.OK
