"""parallel_state lays ranks out exactly as megatron-core 0.16.1 does (recorded facts)."""

import pytest
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.dist_utils import WORLD_SIZE, assert_no_failures, reset_layout
from tests.unit_tests.mcore_facts import groups_of_rank, load_mcore_facts

GETTERS = {
    "tp": lambda: ps.get_tensor_model_parallel_group(),
    "cp": lambda: ps.get_context_parallel_group(),
    "pp": lambda: ps.get_pipeline_model_parallel_group(),
    "dp": lambda: ps.get_data_parallel_group(),
    "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
    "mp": lambda: ps.get_model_parallel_group(),
    "tp_cp": lambda: ps.get_tensor_and_context_parallel_group(),
    "tp_dp": lambda: ps.get_tensor_and_data_parallel_group(),
    "tp_dp_cp": lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
    "embd": lambda: ps.get_embedding_group(),
    "pos_embd": lambda: ps.get_position_embedding_group(),
}

LAYOUTS = [
    layout
    for layout in load_mcore_facts()["rank_layouts"].values()
    if layout["world_size"] == WORLD_SIZE
] or [None]


@pytest.mark.world(4, 8)
@pytest.mark.parametrize(
    "layout",
    LAYOUTS,
    ids=[f"tp{x['tp']}-cp{x['cp']}-pp{x['pp']}" if x else "none" for x in LAYOUTS],
)
def test_groups_equal_megatron_core(layout):
    reset_layout()
    tp, cp, pp = layout["tp"], layout["cp"], layout["pp"]
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    )
    try:
        rank = dist.get_rank()
        expected = groups_of_rank(WORLD_SIZE, rank, tp, cp, pp)
        failures = []
        for name, getter in GETTERS.items():
            group = getter()
            got = None if group is None else dist.get_process_group_ranks(group)
            if got != expected[name]:
                failures.append(f"{name}: {got} != megatron-core {expected[name]}")
        pp_ranks = expected["pp"]
        stage = pp_ranks.index(rank)
        checks = {
            "pp rank": (ps.get_pipeline_model_parallel_rank(), stage),
            "pp size": (ps.get_pipeline_model_parallel_world_size(), pp),
            "cp rank": (ps.get_context_parallel_rank(), expected["cp"].index(rank)),
            "cp size": (ps.get_context_parallel_world_size(), cp),
            "cp ranks": (ps.get_context_parallel_global_ranks(), expected["cp"]),
            "tp size": (ps.get_tensor_model_parallel_world_size(), tp),
            "dp size": (ps.get_data_parallel_world_size(), len(expected["dp"])),
            "dp rank": (ps.get_data_parallel_rank(), expected["dp"].index(rank)),
            "dp_cp size": (ps.get_data_parallel_world_size(True), len(expected["dp_cp"])),
            "first rank": (ps.get_pipeline_model_parallel_first_rank(), pp_ranks[0]),
            "last rank": (ps.get_pipeline_model_parallel_last_rank(), pp_ranks[-1]),
            "next rank": (ps.get_pipeline_model_parallel_next_rank(), pp_ranks[(stage + 1) % pp]),
            "prev rank": (ps.get_pipeline_model_parallel_prev_rank(), pp_ranks[(stage - 1) % pp]),
            "first stage": (ps.is_pipeline_first_stage(), stage == 0),
            "last stage": (ps.is_pipeline_last_stage(), stage == pp - 1),
        }
        failures += [f"{k}: {got} != {want}" for k, (got, want) in checks.items() if got != want]
        mpu = ProcessGroupCollection.use_mpu_process_groups()
        if mpu.cp is not ps.get_context_parallel_group():
            failures.append("use_mpu_process_groups().cp is not parallel_state's cp group")
    finally:
        reset_layout()
    assert_no_failures(failures)


@pytest.mark.world(4, 8)
def test_virtual_pipeline_stage_queries():
    reset_layout()
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    try:
        last = ps.get_pipeline_model_parallel_rank() == 1
        assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
        assert ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0) == (not last)
        assert not ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=1)
        assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1) == last
        assert not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=0)
        with pytest.raises(ValueError, match="vp_stage"):
            ps.is_pipeline_last_stage(ignore_virtual=False)
    finally:
        reset_layout()


@pytest.mark.world(4, 8)
def test_bad_layouts_are_rejected():
    reset_layout()
    with pytest.raises(RuntimeError, match="not divisible"):
        ps.initialize_model_parallel(context_parallel_size=3)
    with pytest.raises(NotImplementedError, match="expert_model_parallel_size"):
        ps.initialize_model_parallel(expert_model_parallel_size=2)
    with pytest.raises(RuntimeError, match="virtual_pipeline_model_parallel_size"):
        ps.initialize_model_parallel(virtual_pipeline_model_parallel_size=2)
    assert not ps.model_parallel_is_initialized()


def test_rank_groups_stride_follows_order():
    sizes = {"tp": 1, "cp": 2, "ep": 1, "dp": 1, "pp": 2}
    order = "tp-cp-ep-dp-pp".split("-")
    assert ps.rank_groups(sizes, order, ("cp",)) == [[0, 1], [2, 3]]
    assert ps.rank_groups(sizes, order, ("pp",)) == [[0, 2], [1, 3]]
    assert ps.rank_groups(sizes, "tp-pp-ep-dp-cp".split("-"), ("cp",)) == [[0, 2], [1, 3]]


def test_uninitialized_state_reports_itself():
    reset_layout()
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_context_parallel_group()
    assert ps.get_context_parallel_group(check_initialized=False) is None
