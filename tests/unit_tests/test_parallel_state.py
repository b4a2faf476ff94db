"""parallel_state lays ranks out exactly as megatron-core 0.16.1 does (recorded facts).

The facts come from megatron-core itself (``tests/tools/record_mcore_facts.py``):
``rank_layouts`` (dense groups, default order), ``rank_generators`` (``RankGenerator`` over
many orders, sizes and tokens) and ``init_layouts`` (every group ``initialize_model_parallel``
builds, dense and expert, over orders with and without cp/ep, some with
``hierarchical_context_parallel_sizes`` and the groups of each level, or the error it raises).
"""

import contextlib
import dataclasses

import pytest
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.dist_utils import WORLD_SIZE, assert_no_failures, reset_layout
from tests.unit_tests.mcore_facts import facts_section, groups_of_rank

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
    for layout in facts_section("rank_layouts").values()
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
        with pytest.raises(AssertionError, match="vp_stage"):
            ps.is_pipeline_last_stage(ignore_virtual=False)
    finally:
        reset_layout()


@pytest.mark.world(4, 8)
def test_bad_layouts_are_rejected():
    reset_layout()
    with pytest.raises(RuntimeError, match="not divisible"):
        ps.initialize_model_parallel(context_parallel_size=3)
    with pytest.raises(NotImplementedError, match="num_distributed_optimizer_instances"):
        ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
    with pytest.raises(RuntimeError, match="expert_model_parallel_size"):
        ps.initialize_model_parallel(expert_model_parallel_size=3)
    with pytest.raises(RuntimeError, match="virtual_pipeline_model_parallel_size"):
        ps.initialize_model_parallel(virtual_pipeline_model_parallel_size=2)
    assert not ps.model_parallel_is_initialized()


def test_rank_generator_first_axis_has_stride_one():
    gen = ps.RankGenerator(tp=1, ep=1, dp=1, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("cp") == [[0, 1], [2, 3]]
    assert gen.get_ranks("pp") == [[0, 2], [1, 3]]
    swapped = ps.RankGenerator(tp=1, ep=1, dp=1, pp=2, cp=2, order="tp-pp-ep-dp-cp")
    assert swapped.get_ranks("cp") == [[0, 2], [1, 3]]


def test_uninitialized_state_reports_itself():
    reset_layout()
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_context_parallel_group()
    with pytest.raises(AssertionError, match="initialize_model_parallel"):
        ps.get_expert_model_parallel_group()
    assert ps.get_context_parallel_group(check_initialized=False) is None
    assert ps.get_hierarchical_context_parallel_groups(check_initialized=False) is None
    with pytest.raises(AssertionError, match="initialize_model_parallel"):
        ps.get_hierarchical_context_parallel_groups()


# ----------------------------------------------------------------------------- RankGenerator

GENERATORS = facts_section("rank_generators")
GENERATOR_ORDERS = sorted({fact["order"] for fact in GENERATORS.values()})


def _generator_failures(order):
    """Differences from megatron-core over every recorded size and token of ``order``."""
    failures = []
    for key, fact in GENERATORS.items():
        if fact["order"] != order:
            continue
        kwargs = dict(fact["sizes"], order=order, rank_offset=fact["rank_offset"])
        if "error" in fact:
            try:
                ps.RankGenerator(**kwargs)
                failures.append(f"{key}: accepted, megatron-core raises {fact['error']}")
            except Exception as exc:  # noqa: BLE001 - the type is what is compared
                if fact["error"] not in {c.__name__ for c in type(exc).__mro__}:
                    failures.append(f"{key}: {type(exc).__name__}, expected {fact['error']}")
            continue
        gen = ps.RankGenerator(**kwargs)
        if (gen.order, gen.ordered_size) != (fact["normalized_order"], fact["ordered_size"]):
            failures.append(f"{key}: order {gen.order} {gen.ordered_size}")
        for token, ranks in fact["ranks"].items():
            if gen.get_ranks(token) != ranks:
                failures.append(f"{key} {token}: {gen.get_ranks(token)} != {ranks}")
    return failures


@pytest.mark.world(1)
@pytest.mark.parametrize("order", GENERATOR_ORDERS)
def test_rank_generator_equals_megatron_core(order):
    """Every recorded size and token of ``order``: same groups, or the same exception type."""
    failures = _generator_failures(order)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.world(1)
def test_negative_control_last_axis_fastest_is_caught(monkeypatch):
    """Laying ranks out with the LAST axis of the order fastest breaks the comparison."""
    original = ps.generate_masked_orthogonal_rank_groups

    def reversed_layout(world_size, parallel_size, mask):
        groups = original(world_size, parallel_size[::-1], mask[::-1])
        return sorted(sorted(g) for g in groups)

    monkeypatch.setattr(ps, "generate_masked_orthogonal_rank_groups", reversed_layout)
    assert _generator_failures("tp-cp-ep-dp-pp")
    assert _generator_failures("tp-pp-dp")


@pytest.mark.world(1)
def test_rank_generator_rejects_a_token_outside_its_order():
    gen = ps.RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp")
    assert gen.order == "tp-dp-pp-ep-cp"
    with pytest.raises(ValueError, match="xx"):
        gen.get_ranks("tp-xx")
    with pytest.raises(ValueError, match="order"):
        ps.RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-tp-dp")


# ----------------------------------------------------------------------------- initialize

INIT_GETTERS = {
    **GETTERS,
    "ep": lambda: ps.get_expert_model_parallel_group(),
    "expt_tp": lambda: ps.get_expert_tensor_parallel_group(),
    "tp_ep": lambda: ps.get_expert_tensor_and_model_parallel_group(),
    "tp_ep_pp": lambda: ps.get_expert_tensor_model_pipeline_parallel_group(),
    "expt_dp": lambda: ps.get_expert_data_parallel_group(),
}

INIT_LAYOUTS = [
    x for x in facts_section("init_layouts").values() if x["world_size"] == WORLD_SIZE
] or [None]


def _init_id(x):
    if x is None:
        return "none"
    etp = "" if x["etp"] is None else f"-etp{x['etp']}"
    hcp = "" if "hcp" not in x else "-hcp" + "x".join(map(str, x["hcp"]))
    return f"tp{x['tp']}-cp{x['cp']}-pp{x['pp']}-ep{x['ep']}{etp}-{x['order']}{hcp}"


def _initialize(layout):
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout["tp"],
        pipeline_model_parallel_size=layout["pp"],
        context_parallel_size=layout["cp"],
        expert_model_parallel_size=layout["ep"],
        expert_tensor_parallel_size=layout["etp"],
        order=layout["order"],
        hierarchical_context_parallel_sizes=layout.get("hcp"),
    )


def _assert_raises_like_megatron_core(layout):
    """``initialize_model_parallel`` raises the recorded exception type (or a subclass) and
    leaves nothing initialized."""
    with pytest.raises(Exception) as info:
        _initialize(layout)
    assert layout["error"] in {c.__name__ for c in type(info.value).__mro__}, info.value
    assert not ps.model_parallel_is_initialized()


@contextlib.contextmanager
def _megatron_core_layout(layout):
    """Initialize a recorded layout for the body (yields True) and reset it afterwards; a
    recorded error is checked instead (yields False: the body has nothing to compare)."""
    reset_layout()
    if "error" in layout:
        _assert_raises_like_megatron_core(layout)
        yield False
        return
    _initialize(layout)
    try:
        yield True
    finally:
        reset_layout()


@pytest.mark.world(2, 4, 8)
@pytest.mark.parametrize("layout", INIT_LAYOUTS, ids=[_init_id(x) for x in INIT_LAYOUTS])
def test_initialize_groups_equal_megatron_core(layout):
    """Dense and expert groups, sizes, ranks and source ranks of megatron-core's own
    ``initialize_model_parallel`` for this order and these sizes (or its exception type)."""
    with _megatron_core_layout(layout) as built:
        if not built:
            return
        rank = dist.get_rank()
        expected = {
            name: next((g for g in groups if rank in g), None)
            for name, groups in layout["groups"].items()
        }
        failures = []
        for name, getter in INIT_GETTERS.items():
            group = getter()
            got = None if group is None else dist.get_process_group_ranks(group)
            if got != expected[name]:
                failures.append(f"{name}: {got} != megatron-core {expected[name]}")
        checks = {
            "ep size": (ps.get_expert_model_parallel_world_size(), len(expected["ep"])),
            "ep rank": (ps.get_expert_model_parallel_rank(), expected["ep"].index(rank)),
            "ep src": (ps.get_expert_model_parallel_src_rank(), expected["ep"][0]),
            "etp size": (ps.get_expert_tensor_parallel_world_size(), len(expected["expt_tp"])),
            "etp rank": (ps.get_expert_tensor_parallel_rank(), expected["expt_tp"].index(rank)),
            "tp_ep size": (
                ps.get_expert_tensor_and_model_parallel_world_size(),
                len(expected["tp_ep"]),
            ),
            "tp_ep rank": (
                ps.get_expert_tensor_and_model_parallel_rank(),
                expected["tp_ep"].index(rank),
            ),
            "edp size": (ps.get_expert_data_parallel_world_size(), len(expected["expt_dp"])),
            "edp rank": (ps.get_expert_data_parallel_rank(), expected["expt_dp"].index(rank)),
            "tp src": (ps.get_tensor_model_parallel_src_rank(), expected["tp"][0]),
            "mp src": (ps.get_model_parallel_src_rank(), expected["mp"][0]),
            "dp src": (ps.get_data_parallel_src_rank(), expected["dp"][0]),
            "tp_cp size": (ps.get_tensor_and_context_parallel_world_size(), len(expected["tp_cp"])),
            "pos embd": (
                ps.is_rank_in_position_embedding_group(),
                expected["pos_embd"] is not None,
            ),
        }
        failures += [f"{k}: {got} != {want}" for k, (got, want) in checks.items() if got != want]
        mpu = ProcessGroupCollection.use_mpu_process_groups()
        for field in ("ep", "expt_tp", "tp_ep", "tp_ep_pp", "expt_dp"):
            if getattr(mpu, field) is not INIT_GETTERS[field]():
                failures.append(f"use_mpu_process_groups().{field} is not parallel_state's")
    assert_no_failures(failures)


@pytest.mark.world(2)
def test_setters_override_until_reset():
    """set_* values win over the groups' sizes and ranks; None or destroy restores them."""
    reset_layout()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        setters = [
            (ps.set_tensor_model_parallel_world_size, ps.get_tensor_model_parallel_world_size, 2),
            (ps.set_tensor_model_parallel_rank, ps.get_tensor_model_parallel_rank, dist.get_rank()),
            (
                ps.set_pipeline_model_parallel_world_size,
                ps.get_pipeline_model_parallel_world_size,
                1,
            ),
            (ps.set_pipeline_model_parallel_rank, ps.get_pipeline_model_parallel_rank, 0),
            (ps.set_expert_model_parallel_world_size, ps.get_expert_model_parallel_world_size, 1),
            (ps.set_expert_model_parallel_rank, ps.get_expert_model_parallel_rank, 0),
            (ps.set_expert_tensor_parallel_world_size, ps.get_expert_tensor_parallel_world_size, 2),
            (
                ps.set_expert_tensor_parallel_rank,
                ps.get_expert_tensor_parallel_rank,
                dist.get_rank(),
            ),
            (ps.set_data_parallel_rank, ps.get_data_parallel_rank, 0),
        ]
        for setter, getter, natural in setters:
            assert getter() == natural, getter.__name__
            setter(7)
            assert getter() == 7, getter.__name__
            setter(None)
            assert getter() == natural, getter.__name__
        ps.set_pipeline_model_parallel_world_size(4)
        ps.set_pipeline_model_parallel_rank(3)
        assert ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage()
    finally:
        reset_layout()
    with pytest.raises(AssertionError, match="initialize_model_parallel"):
        ps.get_pipeline_model_parallel_world_size()  # the set value is gone with the state


@pytest.mark.world(2)
def test_separate_all_gather_group():
    reset_layout()
    ps.initialize_model_parallel()
    try:
        assert not ps.has_separate_all_gather_group()
        with pytest.raises(AssertionError, match="create_all_gather_group"):
            ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
    finally:
        reset_layout()
    ps.initialize_model_parallel(create_all_gather_group=True)
    try:
        assert ps.has_separate_all_gather_group()
        ag = ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        assert ag is not dp_cp
        assert dist.get_process_group_ranks(ag) == dist.get_process_group_ranks(dp_cp)
    finally:
        reset_layout()


@pytest.mark.world(1)
def test_initialize_before_torch_distributed_is_an_assertion_error():
    """megatron-core asserts here; scripts catching AssertionError keep working."""
    with pytest.raises(AssertionError, match="init_process_group"):
        ps.initialize_model_parallel()
    assert ps.get_tensor_model_parallel_world_size() == 0
    ps.set_tensor_model_parallel_world_size(2)
    ps.set_expert_tensor_parallel_rank(1)
    try:
        assert ps.get_tensor_model_parallel_world_size() == 2
        assert ps.get_expert_tensor_parallel_world_size() == 2  # falls back to the tp value
        assert ps.get_expert_tensor_parallel_rank() == 1
    finally:
        ps.destroy_model_parallel()


@pytest.mark.world(1)
def test_process_group_collection_is_a_dataclass():
    fields = [f.name for f in dataclasses.fields(ProcessGroupCollection)]
    assert fields == facts_section("values")["ProcessGroupCollection.fields"]
    pgc = ProcessGroupCollection(tp="tp-group")
    copy = dataclasses.replace(pgc, cp="cp-group")
    assert (copy.tp, copy.cp, copy.dp) == ("tp-group", "cp-group", None)
    assert pgc.cp is None
    with pytest.raises(ValueError, match="foo"):
        ProcessGroupCollection(foo=1)


@pytest.mark.world(2)
def test_megatron_core_private_globals_read_the_state():
    """Tests written for megatron-core read its module globals, e.g. after destroy."""
    reset_layout()
    assert ps._MODEL_PARALLEL_GROUP is None and ps._PIPELINE_GLOBAL_RANKS is None
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        assert ps._PIPELINE_MODEL_PARALLEL_GROUP is ps.get_pipeline_model_parallel_group()
        assert ps._PIPELINE_GLOBAL_RANKS == [0, 1]
        assert ps._EXPERT_MODEL_PARALLEL_RANKS == [dist.get_rank()]
        ps.set_tensor_model_parallel_world_size(3)
        assert ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE == 3
    finally:
        reset_layout()
    assert ps._MODEL_PARALLEL_GROUP is None and ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is None
    with pytest.raises(AttributeError, match="_NO_SUCH_GROUP"):
        ps._NO_SUCH_GROUP  # noqa: B018


# ----------------------------------------------------------------------------- hierarchical CP

HCP_LAYOUTS = [x for x in INIT_LAYOUTS if x is not None and "hcp" in x] or [None]


@pytest.mark.world(2, 4, 8)
@pytest.mark.parametrize("layout", HCP_LAYOUTS, ids=[_init_id(x) for x in HCP_LAYOUTS])
def test_hierarchical_cp_groups_equal_megatron_core(layout):
    """This rank's group of every level equals the one megatron-core's own
    ``initialize_model_parallel`` builds for these sizes (or its exception type); the other
    groups of these layouts are checked by ``test_initialize_groups_equal_megatron_core``."""
    with _megatron_core_layout(layout) as built:
        if not built:
            return
        rank = dist.get_rank()
        expected = [next((g for g in level if rank in g), None) for level in layout["hcp_groups"]]
        groups = ps.get_hierarchical_context_parallel_groups()
        got = [dist.get_process_group_ranks(group) for group in groups]
        failures = []
        if got != expected:
            failures.append(f"rank {rank}: levels {got} != megatron-core {expected}")
        ranks = ps.get_hierarchical_context_parallel_global_ranks()
        if ranks != expected:
            failures.append(f"rank {rank}: recorded ranks {ranks} != megatron-core {expected}")
        if ProcessGroupCollection.use_mpu_process_groups().hcp != groups:
            failures.append("use_mpu_process_groups().hcp is not parallel_state's")
    assert_no_failures(failures)


@pytest.mark.world(1)
def test_hierarchical_cp_rank_lists_split_one_group_level_by_level():
    """megatron-core's docstring example: 16 ranks, sizes [2, 2, 4]; and a group that is not
    contiguous (the levels index the group's own list, not global ranks)."""
    levels = ps.hierarchical_cp_rank_lists(list(range(16)), [2, 2, 4])
    assert levels[0] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert levels[1] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert levels[2] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert ps.hierarchical_cp_rank_lists([1, 3, 5, 7], [2, 2]) == [
        [[1, 3], [5, 7]],
        [[1, 5], [3, 7]],
    ]
    assert ps.hierarchical_cp_rank_lists([4, 5], [1, 2]) == [[[4], [5]], [[4, 5]]]
    with pytest.raises(ValueError, match=r"prod\(sizes=\[2, 3\]\) = 6 != 4"):
        ps.hierarchical_cp_rank_lists([0, 1, 2, 3], [2, 3])


@pytest.mark.world(2, 4, 8)
def test_hierarchical_cp_groups_are_built_per_level():
    """Every level's group of this rank holds the ranks ``hierarchical_cp_rank_lists`` gives
    for its context-parallel group; the getters and ProcessGroupCollection agree."""
    reset_layout()
    sizes = [2, WORLD_SIZE // 2]
    ps.initialize_model_parallel(
        context_parallel_size=WORLD_SIZE, hierarchical_context_parallel_sizes=sizes
    )
    try:
        rank = dist.get_rank()
        expected = [
            next(g for g in level if rank in g)
            for level in ps.hierarchical_cp_rank_lists(list(range(WORLD_SIZE)), sizes)
        ]
        groups = ps.get_hierarchical_context_parallel_groups()
        assert [dist.get_process_group_ranks(g) for g in groups] == expected
        assert ps.get_hierarchical_context_parallel_global_ranks() == expected
        assert ProcessGroupCollection.use_mpu_process_groups().hcp == groups
        assert ps._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS == groups
        assert all(g is not ps.get_context_parallel_group() for g in groups)
    finally:
        reset_layout()
    ps.initialize_model_parallel(context_parallel_size=2)
    try:
        assert ps.get_hierarchical_context_parallel_groups(check_initialized=False) is None
        assert ps.get_hierarchical_context_parallel_global_ranks(check_initialized=False) is None
        with pytest.raises(AssertionError, match="pass hierarchical_context_parallel_sizes"):
            ps.get_hierarchical_context_parallel_groups()
        assert ProcessGroupCollection.use_mpu_process_groups().hcp is None
        assert ProcessGroupCollection.use_mpu_process_groups(["hcp"]).hcp is None
    finally:
        reset_layout()


@pytest.mark.world(2, 4, 8)
@pytest.mark.parametrize(
    "sizes, error, match",
    [
        ([2, 2], AssertionError, r"\[2, 2\] multiply to 4, but context_parallel_size is 2"),
        ([1], AssertionError, r"\[1\] multiply to 1, but context_parallel_size is 2"),
        (2, ValueError, "hierarchical_context_parallel_sizes must be a list of ints >= 1, got 2"),
        ("2", ValueError, "must be a list of ints >= 1, got '2'"),
        ([2, 0], ValueError, r"got \[2, 0\] \(0\)"),
        ([-1, -2], ValueError, r"got \[-1, -2\] \(-1\)"),
        ([2.0, 1], ValueError, r"\(2.0\)"),
        ([True, 2], ValueError, r"\(True\)"),
    ],
    ids=["product", "product-1", "int", "str", "zero", "negative", "float", "bool"],
)
def test_bad_hierarchical_cp_sizes_are_named(sizes, error, match):
    """A product that is not context_parallel_size raises an AssertionError (megatron-core
    asserts); sizes that are not a list of positive ints a ValueError naming the culprit.
    Nothing is left initialized."""
    reset_layout()
    with pytest.raises(error, match=match):
        ps.initialize_model_parallel(
            context_parallel_size=2, hierarchical_context_parallel_sizes=sizes
        )
    assert not ps.model_parallel_is_initialized()


@pytest.mark.world(1)
def test_model_parallel_config_checks_hierarchical_cp_sizes():
    config = ModelParallelConfig(
        context_parallel_size=8, hierarchical_context_parallel_sizes=[2, 4]
    )
    assert config.hierarchical_context_parallel_sizes == [2, 4]
    assert ModelParallelConfig().hierarchical_context_parallel_sizes is None
    ModelParallelConfig(context_parallel_size=4, hierarchical_context_parallel_sizes=[])
    with pytest.raises(ValueError, match=r"\[2, 2\] multiply to 4, but context_parallel_size is 8"):
        ModelParallelConfig(context_parallel_size=8, hierarchical_context_parallel_sizes=[2, 2])
    with pytest.raises(ValueError, match=r"list of ints >= 1, got \[4, 0\]"):
        ModelParallelConfig(context_parallel_size=4, hierarchical_context_parallel_sizes=[4, 0])
    with pytest.raises(ValueError, match="list of ints >= 1, got 4"):
        ModelParallelConfig(context_parallel_size=4, hierarchical_context_parallel_sizes=4)
