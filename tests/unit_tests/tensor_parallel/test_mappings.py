"""Each TP mapping's forward and backward against what it means on the full tensor, at
TP = 2 and 4; ``broadcast_data``.

Every rank holds a seeded "full" tensor X (the same on all ranks, or a per-rank part of it)
and an upstream gradient G; the expected forward and backward are written with plain torch
(cat/chunk/sum over the per-rank tensors every rank can rebuild).
"""

import pytest
import torch

from megatron.core import tensor_parallel as tp
from tests.unit_tests.dist_utils import WORLD_SIZE, assert_no_failures, rel_error
from tests.unit_tests.tensor_parallel.tp_reference import (
    TOL,
    block,
    on_device,
    seeded,
    world_group,
)

pytestmark = [pytest.mark.world(2, 4), pytest.mark.timeout(120)]

S, B, H = 8, 2, 4 * 3


def _per_rank(seed, shape):
    """[rank-0 tensor, rank-1 tensor, ...]: the tensors every rank feeds in."""
    return [seeded(shape, seed + 100 * r) for r in range(WORLD_SIZE)]


def _cases():
    """name -> (apply(x, group), input per rank, expected output on rank r from inputs,
    expected input grad on rank r from upstream grads)."""
    T = WORLD_SIZE
    full = (S, B, H)
    same = lambda xs: xs[0]  # noqa: E731  (inputs identical over ranks)
    total = lambda xs: sum(xs)  # noqa: E731
    return {
        "copy_to": (
            tp.copy_to_tensor_model_parallel_region,
            full,
            True,
            lambda xs, r: same(xs),
            lambda gs, r: total(gs),
        ),
        "reduce_from": (
            tp.reduce_from_tensor_model_parallel_region,
            full,
            False,
            lambda xs, r: total(xs),
            lambda gs, r: gs[r],
        ),
        "scatter_to_tp": (
            tp.scatter_to_tensor_model_parallel_region,
            full,
            True,
            lambda xs, r: block(same(xs), -1, r, T),
            lambda gs, r: torch.cat(gs, dim=-1),
        ),
        "gather_from_tp": (
            tp.gather_from_tensor_model_parallel_region,
            (S, B, H // T),
            False,
            lambda xs, r: torch.cat(xs, dim=-1),
            lambda gs, r: block(gs[r], -1, r, T),
        ),
        "scatter_to_sp": (
            tp.scatter_to_sequence_parallel_region,
            full,
            True,
            lambda xs, r: block(same(xs), 0, r, T),
            lambda gs, r: torch.cat(gs, dim=0),
        ),
        "gather_from_sp": (
            tp.gather_from_sequence_parallel_region,
            (S // T, B, H),
            False,
            lambda xs, r: torch.cat(xs, dim=0),
            lambda gs, r: block(total(gs), 0, r, T),
        ),
        "gather_from_sp-no-tp-grad": (
            lambda x, group: tp.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=False, group=group
            ),
            (S // T, B, H),
            False,
            lambda xs, r: torch.cat(xs, dim=0),
            lambda gs, r: block(gs[r], 0, r, T),
        ),
        "reduce_scatter_to_sp": (
            tp.reduce_scatter_to_sequence_parallel_region,
            full,
            False,
            lambda xs, r: block(total(xs), 0, r, T),
            lambda gs, r: torch.cat(gs, dim=0),
        ),
        "all_gather_last_dim": (
            tp.all_gather_last_dim_from_tensor_parallel_region,
            (S, B, H // T),
            False,
            lambda xs, r: torch.cat(xs, dim=-1),
            lambda gs, r: block(total(gs), -1, r, T),
        ),
        "reduce_scatter_last_dim": (
            tp.reduce_scatter_last_dim_to_tensor_parallel_region,
            full,
            False,
            lambda xs, r: block(total(xs), -1, r, T),
            lambda gs, r: torch.cat(gs, dim=-1),
        ),
        "all_to_all": (
            lambda x, group: tp.all_to_all(group, x),
            (T * 2, B, H),
            False,
            lambda xs, r: torch.cat([block(x, 0, r, T) for x in xs], dim=0),
            lambda gs, r: torch.cat([block(g, 0, r, T) for g in gs], dim=0),
        ),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_mapping_forward_and_backward(name):
    group, T, rank = world_group()
    apply, shape, identical, expected_out, expected_grad = _cases()[name]
    xs = [seeded(shape, 1)] * T if identical else _per_rank(1, shape)
    x = on_device(xs[rank]).requires_grad_()
    out = apply(x, group=group)
    gs = _per_rank(2, tuple(out.shape))
    out.backward(on_device(gs[rank]))
    failures = []
    if not rel_error(out, expected_out(xs, rank)) <= TOL:
        failures.append(f"{name} forward: rel error {rel_error(out, expected_out(xs, rank)):.2e}")
    if not rel_error(x.grad, expected_grad(gs, rank)) <= TOL:
        failures.append(f"{name} backward: rel error {rel_error(x.grad, expected_grad(gs, rank))}")
    if not torch.equal(x.detach().cpu(), xs[rank]):
        failures.append(f"{name} modified its input")
    assert_no_failures(failures)


def test_sp2hp_and_hp2sp_are_inverse_layout_changes():
    """[s/T*b, h] -> [s*b, h/T] is the hidden block of the gathered sequence, and back."""
    group, T, rank = world_group()
    full = seeded((S * B, H), 3)
    local = block(full, 0, rank, T)
    hp = tp.all_to_all_sp2hp(on_device(local), group=group)
    back = tp.all_to_all_hp2sp(hp, group=group)
    failures = []
    if not torch.equal(hp.cpu(), block(full, -1, rank, T)):
        failures.append("sp2hp is not the hidden block of the full tensor")
    if not torch.equal(back.cpu(), local):
        failures.append("hp2sp(sp2hp(x)) != x")
    assert_no_failures(failures)


def test_broadcast_data_from_tp_rank_0():
    group, T, rank = world_group()
    keys = ["tokens", "labels"]
    data = {"tokens": torch.arange(12).view(3, 4), "labels": torch.arange(5) * 7}
    out = tp.broadcast_data(keys, data if rank == 0 else None, torch.int64, tp_group=group)
    failures = [f"{k} differs" for k in keys if not torch.equal(out[k].cpu(), data[k])]
    assert_no_failures(failures)


def test_broadcast_data_wrong_dtype_names_key():
    """No TP group (one rank: every process is its own source): checked before any
    collective."""
    with pytest.raises(TypeError, match=r"data\['tokens'\] has dtype torch.int32"):
        tp.broadcast_data(["tokens"], {"tokens": torch.ones(2, dtype=torch.int32)}, torch.int64)


def test_1d_split_and_gather_round_trip():
    """split_tensor_into_1d_equal_chunks keeps this rank's 1/T of the flat tensor;
    gather_split_1d_tensor puts the flat tensor back together."""
    group, T, rank = world_group()
    full = seeded((4, T * 3), 4)
    mine = tp.split_tensor_into_1d_equal_chunks(on_device(full), tp_group=group)
    gathered = tp.gather_split_1d_tensor(mine, tp_group=group)
    failures = []
    if not torch.equal(mine.cpu(), full.reshape(-1).chunk(T)[rank]):
        failures.append("1-d chunk is not this rank's block of the flat tensor")
    if not torch.equal(gathered.cpu(), full.reshape(-1)):
        failures.append("gather_split_1d_tensor did not rebuild the flat tensor")
    assert_no_failures(failures)


@pytest.mark.world(1, 2, 4)
def test_split_along_last_dim_and_vocab_ranges():
    x = torch.arange(24.0).view(2, 12)
    parts = tp.split_tensor_along_last_dim(x, 3, contiguous_split_chunks=True)
    assert [p.tolist() for p in parts] == [p.tolist() for p in x.chunk(3, dim=-1)]
    assert all(p.is_contiguous() for p in parts)
    from megatron.core.tensor_parallel.utils import VocabUtility, divide

    assert VocabUtility.vocab_range_from_global_vocab_size(12, 2, 4) == (6, 9)
    assert VocabUtility.vocab_range_from_per_partition_vocab_size(5, 1, 2) == (5, 10)
    with pytest.raises(ValueError, match=r"vocabulary size \(10\) must be divisible .*\(4\)"):
        VocabUtility.vocab_range_from_global_vocab_size(10, 0, 4)
    with pytest.raises(ValueError, match="7 is not divisible by 2"):
        divide(7, 2)
