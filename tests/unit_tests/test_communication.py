"""``megatron.core.communication`` and the one group resolver / size-rank convention.

Each collective runs on the whole world (and on a sub-group at world 4) with rank-dependent
inputs; the expected result is computed locally from the same formula, without
communication. The resolver tests check the order explicit group > ``pg_collection`` >
``parallel_state`` > None, including a collection whose field is unset (no fallback).
"""

import os

import pytest
import torch
import torch.distributed as dist

from megatron.core import communication as comm
from megatron.core import parallel_state
from megatron.core.process_groups_config import (
    ProcessGroupCollection,
    get_pg_rank,
    get_pg_size,
    resolve_group,
    resolve_pg_collection,
)
from tests.unit_tests.dist_utils import fresh_layout

WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def _x(rank: int, rows: int = 4, dtype=torch.float64) -> torch.Tensor:
    """Rank r's input: [rows, 3] holding 100 r + (0, 1, 2, ...)."""
    return (torch.arange(rows * 3, dtype=dtype) + 100 * rank).reshape(rows, 3)


def _groups():
    """(group, its global ranks) to test on: the world, and at world 4 the pair holding
    this rank ({0, 1} or {2, 3})."""
    out = [(dist.group.WORLD, list(range(WORLD)))]
    if WORLD == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        me = dist.get_rank() // 2
        out.append((pairs[me], [2 * me, 2 * me + 1]))
    return out


@pytest.mark.world(2, 4)
def test_all_reduce_sums_and_leaves_the_input_alone():
    for group, ranks in _groups():
        mine = _x(dist.get_rank())
        before = mine.clone()
        out = comm.all_reduce(mine, group)
        torch.testing.assert_close(out, sum(_x(r) for r in ranks), rtol=0, atol=0)
        assert torch.equal(mine, before), "all_reduce modified its input"
        biggest = comm.all_reduce(mine, group, dist.ReduceOp.MAX)
        torch.testing.assert_close(biggest, _x(max(ranks)), rtol=0, atol=0)


@pytest.mark.world(2, 4)
def test_start_all_reduce_overwrite_input_reduces_in_place():
    mine = _x(dist.get_rank())
    pending = comm.start_all_reduce(mine, dist.group.WORLD, overwrite_input=True)
    out = pending.wait()
    assert out.data_ptr() == mine.data_ptr()
    torch.testing.assert_close(mine, sum(_x(r) for r in range(WORLD)), rtol=0, atol=0)


@pytest.mark.world(2, 4)
def test_all_gather_along_first_dim_is_cat_in_rank_order():
    for group, ranks in _groups():
        expected = torch.cat([_x(r) for r in ranks])
        torch.testing.assert_close(
            comm.all_gather_along_first_dim(_x(dist.get_rank()), group), expected, rtol=0, atol=0
        )
        pending = comm.start_all_gather_along_first_dim(_x(dist.get_rank()), group)
        torch.testing.assert_close(pending.wait(), expected, rtol=0, atol=0)


@pytest.mark.world(2, 4)
@pytest.mark.parametrize("overwrite_input", [False, True])
def test_reduce_scatter_keeps_this_ranks_block_of_the_sum(overwrite_input):
    for group, ranks in _groups():
        size, rank = len(ranks), ranks.index(dist.get_rank())
        full = _x(dist.get_rank(), rows=2 * size)
        before = full.clone()
        total = sum(_x(r, rows=2 * size) for r in ranks)
        out = comm.reduce_scatter_along_first_dim(full, group, overwrite_input=overwrite_input)
        torch.testing.assert_close(out, total[2 * rank : 2 * rank + 2], rtol=0, atol=0)
        if not overwrite_input:
            assert torch.equal(full, before), "reduce_scatter modified its input"
        pending = comm.start_reduce_scatter_along_first_dim(_x(dist.get_rank(), 2 * size), group)
        torch.testing.assert_close(pending.wait(), total[2 * rank : 2 * rank + 2])


@pytest.mark.world(2, 4)
def test_reduce_scatter_refuses_rows_not_divisible_by_the_group():
    with pytest.raises(ValueError, match=r"size 3 .* divisible by the group size"):
        comm.reduce_scatter_along_first_dim(_x(0, rows=3 * WORLD + 1)[:3], dist.group.WORLD)


@pytest.mark.world(2, 4)
def test_ring_exchange_receives_the_previous_ranks_tensor():
    for group, ranks in _groups():
        size, rank = len(ranks), ranks.index(dist.get_rank())
        received = comm.ring_exchange(_x(dist.get_rank()), group, tag=3).wait()
        torch.testing.assert_close(received, _x(ranks[(rank - 1) % size]), rtol=0, atol=0)


@pytest.mark.world(2, 4)
def test_all_to_all_single_transposes_blocks_with_uneven_splits():
    me = dist.get_rank()
    # rank i sends (i + j + 1) rows of value 10 i + j to rank j
    splits_in = [me + j + 1 for j in range(WORLD)]
    send = torch.cat([torch.full((n, 2), 10.0 * me + j) for j, n in enumerate(splits_in)])
    splits_out = [i + me + 1 for i in range(WORLD)]
    out = comm.all_to_all_single(send, dist.group.WORLD, splits_out, splits_in)
    expected = torch.cat([torch.full((n, 2), 10.0 * i + me) for i, n in enumerate(splits_out)])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.world(1, 2)
def test_no_group_or_one_rank_is_the_identity():
    x = _x(0)
    for fn in (comm.all_reduce, comm.all_gather_along_first_dim):
        assert fn(x, None) is x
    assert comm.reduce_scatter_along_first_dim(x, None) is x
    assert comm.ring_exchange(x, None).wait() is x
    assert comm.all_to_all_single(x, None) is x


# ----------------------------------------------------------------------------- groups


@pytest.mark.world(1)
def test_size_and_rank_without_torch_distributed_are_one_and_zero():
    assert not dist.is_initialized()
    assert (get_pg_size(None), get_pg_rank(None)) == (1, 0)
    assert (get_pg_size(object()), get_pg_rank(object())) == (1, 0)  # megatron-core's rule
    assert resolve_group("tp") is None and resolve_pg_collection() is None


@pytest.mark.world(1)
def test_resolve_group_refuses_an_unknown_name():
    with pytest.raises(ValueError, match=r"unknown group name 'tensor'; expected one of tp, pp"):
        resolve_group("tensor")


@pytest.mark.world(2)
def test_resolve_group_order_explicit_then_collection_then_parallel_state():
    with fresh_layout():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        mpu_tp = parallel_state.get_tensor_model_parallel_group()
        explicit = dist.new_group([0, 1])
        assert resolve_group("tp", explicit) is explicit
        assert resolve_group("tp", explicit, ProcessGroupCollection(tp=mpu_tp)) is explicit
        collection = ProcessGroupCollection(tp=explicit)
        assert resolve_group("tp", pg_collection=collection) is explicit
        # a collection without the group is not topped up from parallel_state
        assert resolve_group("cp", pg_collection=collection) is None
        assert resolve_group("tp") is mpu_tp
        assert resolve_group("dp_cp") is parallel_state.get_data_parallel_group(
            with_context_parallel=True
        )
        assert resolve_pg_collection(collection) is collection
        assert resolve_pg_collection(None, ["tp"]).tp is mpu_tp
        assert (get_pg_size(mpu_tp), get_pg_rank(mpu_tp)) == (2, dist.get_rank())
    assert resolve_group("tp") is None


@pytest.mark.world(2, 4)
def test_in_place_collectives_match_a_local_reference():
    """all_reduce_ (SUM, AVG emulated on gloo, MAX), broadcast_ from a non-zero source, the
    shard reduce-scatter and the shard all-gather, each against the formula computed here."""
    for group, ranks in _groups():
        size, me = len(ranks), ranks.index(dist.get_rank())
        mine = _x(dist.get_rank())
        assert comm.all_reduce_(mine, group) is mine
        torch.testing.assert_close(mine, sum(_x(r) for r in ranks), rtol=0, atol=0)
        mine = _x(dist.get_rank())
        comm.all_reduce_(mine, group, dist.ReduceOp.AVG)
        torch.testing.assert_close(mine, sum(_x(r) for r in ranks) / size, rtol=0, atol=0)
        mine = _x(dist.get_rank())
        comm.broadcast_(mine, group, src=size - 1)
        torch.testing.assert_close(mine, _x(ranks[-1]), rtol=0, atol=0)
        flat = _x(dist.get_rank(), rows=2 * size).reshape(-1)
        shard = comm.start_reduce_scatter_shard_(flat, group).wait()
        whole = sum(_x(r, rows=2 * size) for r in ranks).reshape(-1)
        torch.testing.assert_close(shard, whole.view(size, -1)[me], rtol=0, atol=0)
        assert shard.data_ptr() == flat.view(size, -1)[me].data_ptr(), "not the shard in place"
        flat = torch.zeros(size * 5, dtype=torch.float64)
        flat.view(size, -1)[me] = dist.get_rank() + 1.0
        assert comm.start_all_gather_shards_(flat, group).wait() is flat
        expected = torch.tensor([r + 1.0 for r in ranks], dtype=torch.float64).repeat_interleave(5)
        torch.testing.assert_close(flat, expected, rtol=0, atol=0)


@pytest.mark.world(2, 4)
def test_object_collectives_and_p2p():
    for group, ranks in _groups():
        me = ranks.index(dist.get_rank())
        assert comm.all_gather_object(("r", dist.get_rank()), group) == [("r", r) for r in ranks]
        gathered = comm.gather_object(dist.get_rank(), group, dst=0)
        assert gathered == (ranks if me == 0 else None)
        assert comm.broadcast_object({"from": dist.get_rank()}, group, src=1) == {"from": ranks[1]}
        comm.barrier(group)
        # a ring through p2p_op / run_p2p, unbatched (even ranks send first) and batched
        nxt, prv = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
        for batched in (False, True):
            got = torch.empty(3, dtype=torch.float64)
            ops = [
                comm.p2p_op(_x(dist.get_rank(), rows=1)[0], nxt, group, 7, is_send=True),
                comm.p2p_op(got, prv, group, 7, is_send=False),
            ]
            comm.run_p2p(ops, batched=batched, sends_first=me % 2 == 0)
            torch.testing.assert_close(got, _x(prv, rows=1)[0], rtol=0, atol=0)
    assert comm.all_gather_object(1, None) == [1] and comm.broadcast_object(2, None) == 2


def test_one_rank_in_place_collectives_are_the_identity():
    t = torch.arange(6.0)
    assert comm.all_reduce_(t, None, dist.ReduceOp.AVG) is t
    assert torch.equal(t, torch.arange(6.0))
    assert torch.equal(comm.start_reduce_scatter_shard_(t, None).wait(), t)
    assert comm.start_all_gather_shards_(t, None).wait() is t
    assert comm.broadcast_(t, None) is t


@pytest.mark.world(1, 2, 4)
def test_broadcast_from_last_gives_every_rank_the_last_ranks_tensor():
    """The one "from the last pipeline stage" broadcast (loss, validation totals, generated
    token): in place, from the group's last rank (the pair's second rank at world 4)."""
    groups = _groups() if dist.is_initialized() else [(None, [0])]
    for group, ranks in groups:
        mine = _x(dist.get_rank() if dist.is_initialized() else 0)
        assert comm.broadcast_from_last_(mine, group) is mine
        torch.testing.assert_close(mine, _x(ranks[-1]), rtol=0, atol=0)
