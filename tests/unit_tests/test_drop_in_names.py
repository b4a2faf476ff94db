"""Names megatron-core's own test modules and scripts import (issue 21, drop-in): the
CUDA-graph order helpers, ``megatron.core.extensions.transformer_engine`` without Transformer
Engine, ``megatron.core.utils.get_tensor_model_parallel_group_if_none`` / ``get_pg_src_rank``
and ``megatron.core.transformer.module.param_is_not_shared``.

The order helpers are checked against the examples megatron-core documents for them and
against invariants of any valid pipeline order (every backward after its forward); their
outputs were also compared with megatron-core 0.16.1's on 928 schedules (a local check).
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table
from megatron.core.transformer.cuda_graphs import (
    convert_schedule_table_to_order,
    get_overlap_moe_expert_parallel_comm_order,
)
from megatron.core.utils import get_pg_src_rank, get_tensor_model_parallel_group_if_none
from tests.unit_tests.dist_utils import fresh_layout


@pytest.mark.world(1)
def test_schedule_table_to_order_documented_example():
    # PP 2, 5 microbatches, VP 2, groups of 3: microbatches 0 1 2 0 1 2 3 4 3 4
    table = list(zip([0, 1, 2, 0, 1, 2, 3, 4, 3, 4], [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]))
    assert table == get_schedule_table(5, 2, 3)
    expected = [1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1]
    assert convert_schedule_table_to_order(5, 2, table) == expected
    assert convert_schedule_table_to_order(0, 1, [(0, 0), (1, 0)]) == [1, -1, 1, -1]


@pytest.mark.world(1)
@pytest.mark.parametrize("wgrad", [False, True])
def test_overlap_order_documented_example(wgrad):
    order, owners = get_overlap_moe_expert_parallel_comm_order([1, 2, -2, 1, -1, -1], [1, 2], wgrad)
    if wgrad:
        assert order == [1, 2, 3, 1, -3, -3.5, -2, -2.5, -1, -1.5, -1, -1.5]
        assert owners == [[0, 0], [1, 0], [1, 1], [0, 0]] + [None] * 8
    else:
        assert order == [1, 2, 3, 1, -3, -2, -1, -1]
        assert owners == [[0, 0], [1, 0], [1, 1], [0, 0]] + [None] * 4


def _check_valid(order) -> None:
    """Every backward of k comes after a forward of k, and all are matched at the end."""
    seen, running = {}, 0
    for entry in order:
        seen[entry] = seen.get(entry, 0) + 1
        if entry < 0:
            assert seen.get(-entry, 0) >= seen[entry], f"backward {entry} before its forward"
        running += entry
        assert running >= 0
    assert running == 0 and all(seen.get(-k) == v for k, v in seen.items())


@pytest.mark.world(1)
@pytest.mark.parametrize("pp, vp, group", [(2, None, 2), (4, 2, 4), (4, 4, 5), (8, 2, 9)])
def test_orders_of_every_rank_are_valid(pp, vp, group):
    chunks = vp or 1

    class Comm:  # the pipeline sizes get_pp_rank_microbatches reads
        virtual_pipeline_model_parallel_size = vp

        def __init__(self, rank):
            self.pp_group = type("G", (), {"size": lambda s: pp, "rank": lambda s: rank})()

    for microbatches in (8, 32):
        for rank in range(pp):
            _, _, warmup, _ = get_pp_rank_microbatches(
                microbatches, chunks, group, p2p_communicator=Comm(rank)
            )
            table = get_schedule_table(microbatches, chunks, group)
            order = convert_schedule_table_to_order(warmup, chunks, table)
            assert len(order) == 2 * microbatches * chunks and max(order) == chunks
            _check_valid(order)
            layered, owners = get_overlap_moe_expert_parallel_comm_order(order, [2] * chunks, False)
            assert len(layered) == 2 * len(order) == len(owners)
            _check_valid(layered)


@pytest.mark.world(1)
def test_transformer_engine_extension_imports_and_refuses_when_used():
    from megatron.core.extensions import transformer_engine as te_ext

    assert te_ext.HAVE_TE is False
    with pytest.raises(ImportError, match=r"transformer_engine\.TENorm: .*local"):
        te_ext.TENorm(config=None, hidden_size=8)
    with pytest.raises(ImportError, match=r"TEColumnParallelLinear"):
        te_ext.TEColumnParallelLinear(8, 8, config=None, init_method=None)
    with pytest.raises(ImportError, match=r"te_checkpoint"):
        te_ext.te_checkpoint(lambda x: x, False, None, None, torch.ones(1))


@pytest.mark.world(1)
def test_param_is_not_shared_lives_in_transformer_module():
    from megatron.core.optimizer import clip_grads
    from megatron.core.transformer.module import param_is_not_shared

    assert clip_grads.param_is_not_shared is param_is_not_shared
    shared = torch.nn.Parameter(torch.ones(1))
    shared.shared = True
    assert param_is_not_shared(torch.nn.Parameter(torch.ones(1)))
    assert not param_is_not_shared(shared)


@pytest.mark.world(1)
def test_group_helpers_without_torch_distributed():
    assert get_tensor_model_parallel_group_if_none(None) is None
    assert get_pg_src_rank(None) == 0


@pytest.mark.world(2)
def test_get_tensor_model_parallel_group_if_none():
    explicit = dist.new_group([0, 1])
    with fresh_layout():
        assert get_tensor_model_parallel_group_if_none(None) is None  # before initialization
        assert get_tensor_model_parallel_group_if_none(explicit) is explicit
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        with pytest.warns(DeprecationWarning) if dist.get_rank() == 0 else _no_check():
            found = get_tensor_model_parallel_group_if_none(None)
        assert found is parallel_state.get_tensor_model_parallel_group()
        expert = get_tensor_model_parallel_group_if_none(None, is_expert=True)
        assert expert is parallel_state.get_expert_tensor_parallel_group()
        assert get_tensor_model_parallel_group_if_none(explicit) is explicit
        assert get_pg_src_rank(found) == 0


class _no_check:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
