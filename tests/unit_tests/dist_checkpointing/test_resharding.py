"""A global tensor saved as one set of boxes loads as any other set, bitwise.

Toy shards, no model: each rank cuts its boxes out of known global tensors (fp32, bf16, a
layer stack with a prepended axis, uneven row blocks) according to a *save grid*, saves, and
loads the boxes of a different *load grid*. Every loaded box must equal the same box cut from
the global tensor, bit for bit; the replicas of a box are written once. A negative control
loads with the offsets dropped and must fail the same comparison.
"""

from dataclasses import dataclass
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing import storage as ckpt_storage
from tests.unit_tests.dist_utils import assert_no_failures

SHAPE = (8, 12)
LAYERS = 4
UNEVEN_ROWS = {2: (3, 5), 4: (3, 1, 4), 8: (3, 1, 4)}  # row blocks of the uneven tensor


@dataclass(frozen=True)
class Grid:
    """Rank r holds row block ``i`` of ``rows`` and column block ``j`` of ``cols`` as replica
    ``k`` of ``replicas`` (r = (k * rows + i) * cols + j: columns fastest)."""

    rows: int
    cols: int
    replicas: int

    @property
    def id(self) -> str:
        return f"r{self.rows}c{self.cols}x{self.replicas}"

    def coords(self, rank: int) -> Tuple[int, int, int]:
        j = rank % self.cols
        i = (rank // self.cols) % self.rows
        return i, j, rank // (self.rows * self.cols)


def global_tensors() -> Dict[str, torch.Tensor]:
    """The reference: fixed global tensors, built without the code under test."""
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(SHAPE, generator=g, dtype=torch.float64)
    return {
        "dense.fp32": base.float(),
        "dense.bf16": (base * 3).bfloat16(),
        "stack.weight": torch.randn((LAYERS,) + SHAPE, generator=g).float(),
        "uneven": torch.randn(8, 5, generator=g).float(),
    }


def sharded_dict(grid: Grid, rank: int, world: int, fill: bool) -> Dict[str, object]:
    """This rank's pieces under ``grid``; with ``fill`` the data are the reference boxes,
    otherwise zeros of the right shape (to load into)."""
    ref = global_tensors()
    i, j, k = grid.coords(rank)
    pieces: Dict[str, object] = {}

    def data(block: torch.Tensor) -> torch.Tensor:
        return block.clone() if fill else torch.zeros_like(block)

    for key in ("dense.fp32", "dense.bf16"):
        block = ref[key].chunk(grid.rows, 0)[i].chunk(grid.cols, 1)[j]
        pieces[key] = ShardedTensor.from_rank_offsets(
            key, data(block), (0, i, grid.rows), (1, j, grid.cols), replica_id=k
        )
    # a layer stack: layers are spread over row blocks (like pipeline stages), one key
    per_stage = LAYERS // grid.rows
    for local in range(per_stage):
        layer = i * per_stage + local
        block = ref["stack.weight"][layer].chunk(grid.cols, 1)[j]
        pieces[f"layers.{local}.weight"] = ShardedTensor.from_rank_offsets(
            "stack.weight",
            data(block),
            (0, layer, LAYERS),
            (2, j, grid.cols),
            replica_id=k,
            prepend_axis_num=1,
        )
    # uneven row blocks, cycled over the ranks; the first holder of each block writes it
    rows = UNEVEN_ROWS[world]
    block_id = rank % len(rows)
    start = sum(rows[:block_id])
    block = ref["uneven"][start : start + rows[block_id]]
    pieces["uneven"] = ShardedTensor(
        "uneven",
        data(block),
        block.dtype,
        tuple(block.shape),
        tuple(ref["uneven"].shape),
        (start, 0),
        None,
        replica_id=rank // len(rows),
    )
    pieces["rank_note"] = ShardedObject(
        "rank_note", {"saved_by": torch.tensor([rank])} if fill else None, (world,), (rank,)
    )
    pieces["iteration"] = 7
    return pieces


def expected_boxes(grid: Grid, rank: int, world: int) -> Dict[str, torch.Tensor]:
    reference = sharded_dict(grid, rank, world, fill=True)
    return {k: v.data for k, v in reference.items() if isinstance(v, ShardedTensor)}


def compare(loaded: Dict[str, object], grid: Grid, rank: int, world: int) -> List[str]:
    failures = []
    for key, want in expected_boxes(grid, rank, world).items():
        got = loaded[key]
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            failures.append(f"{grid.id} {key}: loaded box differs from the saved global tensor")
    if loaded["iteration"] != 7:
        failures.append(f"common state: iteration {loaded['iteration']}")
    if not torch.equal(loaded["rank_note"]["saved_by"], torch.tensor([rank])):
        failures.append(f"rank_note: {loaded['rank_note']}")
    return failures


PAIRS = {
    2: [
        (Grid(2, 1, 1), Grid(1, 2, 1)),
        (Grid(1, 2, 1), Grid(1, 1, 2)),
        (Grid(1, 1, 2), Grid(2, 1, 1)),
    ],
    4: [
        (Grid(4, 1, 1), Grid(1, 2, 2)),
        (Grid(2, 2, 1), Grid(1, 1, 4)),
        (Grid(1, 4, 1), Grid(2, 2, 1)),
        (Grid(1, 1, 4), Grid(4, 1, 1)),
        (Grid(2, 1, 2), Grid(1, 4, 1)),
    ],
    8: [
        (Grid(2, 4, 1), Grid(4, 1, 2)),
        (Grid(1, 2, 4), Grid(2, 2, 2)),
        (Grid(4, 2, 1), Grid(1, 1, 8)),
    ],
}


def _pairs(world: int):
    return [
        pytest.param(save, load, id=f"{save.id}-to-{load.id}", marks=pytest.mark.world(world))
        for save, load in PAIRS[world]
    ]


@pytest.mark.parametrize("save_grid,load_grid", _pairs(2) + _pairs(4) + _pairs(8))
def test_boxes_saved_on_one_grid_load_bitwise_on_another(save_grid, load_grid, shared_dir):
    rank, world = dist.get_rank(), dist.get_world_size()
    dist_checkpointing.save(sharded_dict(save_grid, rank, world, fill=True), str(shared_dir))
    loaded = dist_checkpointing.load(sharded_dict(load_grid, rank, world, fill=False), shared_dir)
    failures = compare(loaded, load_grid, rank, world)
    # replicas are written once: one stored chunk per box of the save grid
    metadata = ckpt_storage.read_metadata(shared_dir)
    chunks = len(metadata.state_dict_metadata["dense.fp32"].chunks)
    if chunks != save_grid.rows * save_grid.cols:
        failures.append(f"dense.fp32 stored as {chunks} chunks, expected one per box")
    assert_no_failures(failures)


@pytest.mark.world(4)
def test_negative_control_loading_without_offsets_is_caught(shared_dir, monkeypatch):
    """With every requested box moved to offset 0 the comparison above fails."""
    rank, world = dist.get_rank(), dist.get_world_size()
    save_grid, load_grid = Grid(4, 1, 1), Grid(1, 2, 2)
    dist_checkpointing.save(sharded_dict(save_grid, rank, world, fill=True), str(shared_dir))

    def at_origin(boxes, object_keys):
        boxes = [
            ckpt_storage.TensorBox(b.fqn, b.tensor, b.global_shape, (0,) * len(b.offset))
            for b in boxes
        ]
        return read_pieces(boxes, object_keys)

    read_pieces = ckpt_storage._BoxLoadPlanner
    monkeypatch.setattr(ckpt_storage, "_BoxLoadPlanner", at_origin)
    loaded = dist_checkpointing.load(sharded_dict(load_grid, rank, world, fill=False), shared_dir)
    failures = compare(loaded, load_grid, rank, world)
    everyone = [None] * world
    dist.all_gather_object(everyone, len(failures))
    # ranks holding column block 1 or row blocks of other layers read the wrong data
    assert sum(everyone) > 0, "dropping the offsets went unnoticed"
