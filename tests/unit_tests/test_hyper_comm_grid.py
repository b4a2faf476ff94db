"""HyperCommGrid: rank enumerations equal megatron-core 0.16.1's (recorded facts); groups are
made once per set of dims and found again by get_pg."""

import pytest
import torch.distributed as dist

from megatron.core.hyper_comm_grid import HyperCommGrid
from tests.unit_tests.dist_utils import WORLD_SIZE, assert_no_failures
from tests.unit_tests.mcore_facts import facts_section

GRIDS = facts_section("hyper_comm_grid")


@pytest.mark.world(1)
@pytest.mark.parametrize("fact", GRIDS, ids=["-".join(map(str, g["shape"])) for g in GRIDS])
def test_rank_enum_equals_megatron_core(fact, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    grid = HyperCommGrid(fact["shape"], fact["dim_names"], rank_offset=fact["rank_offset"])
    for case in fact["enums"]:
        assert grid.get_rank_enum(case["dims"]) == case["ranks"], case["dims"]


@pytest.mark.world(1)
def test_bad_grids_raise(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="dim_names"):
        HyperCommGrid([2, 2], ["tp"])
    with pytest.raises(RuntimeError, match="shape"):
        HyperCommGrid([2, 4], ["tp", "dp"])
    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    with pytest.raises(ValueError, match="pp"):
        grid.get_rank_enum(["pp"])
    with pytest.raises(KeyError, match="create_pg"):
        grid.get_pg("tp")


@pytest.mark.world(2, 4)
def test_create_pg_builds_this_ranks_group_once():
    grid = HyperCommGrid([2, WORLD_SIZE // 2], ["tp", "dp"])
    rank = dist.get_rank()
    failures = []
    for dims in ("tp", ["dp"], ["dp", "tp"]):
        group = grid.create_pg(dims)
        want = next(r for r in grid.get_rank_enum(dims) if rank in r)
        if dist.get_process_group_ranks(group) != want:
            failures.append(f"{dims}: {dist.get_process_group_ranks(group)} != {want}")
        if grid.get_pg(dims) is not group:
            failures.append(f"{dims}: get_pg returned another group")
    if grid.get_pg(["tp", "dp"]) is not grid.get_pg(["dp", "tp"]):
        failures.append("the order of dims changed the group")
    with pytest.raises(KeyError, match="already"):
        grid.create_pg("tp")
    assert_no_failures(failures)
