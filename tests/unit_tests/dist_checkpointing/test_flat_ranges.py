"""``ShardedTensor.flattened_range``: a flat range of a box stored as the rectangular boxes it
is made of, so flat pieces (the distributed optimizer's shards) and whole boxes read each
other back bitwise.

The reference is the global tensor itself: ``torch.arange`` over its elements, so every loaded
element names the position it came from. Negative controls: a flat range shifted by one
element is refused by the save's coverage check, and ``flat_range_boxes`` is checked against
slicing a tensor directly.
"""

import random

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedTensor, flat_range_boxes

pytestmark = pytest.mark.world(1)

SHAPE = (5, 6)  # the global tensor: two boxes of 5 x 3 along axis 1


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def test_flat_range_boxes_are_the_range_in_order():
    rng = random.Random(0)
    for _ in range(400):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 4)))
        n = _numel(shape)
        start = rng.randrange(n)
        stop = rng.randint(start + 1, n)
        full = torch.arange(n).view(shape)
        parts, position = [], start
        for offset, box, a, b in flat_range_boxes(shape, start, stop):
            assert a == position and b - a == _numel(box)
            parts.append(full[tuple(slice(o, o + s) for o, s in zip(offset, box))].reshape(-1))
            position = b
        assert position == stop
        assert torch.equal(torch.cat(parts), torch.arange(start, stop)), (shape, start, stop)
        assert len(flat_range_boxes(shape, start, stop)) <= 2 * len(shape) + 1


def _global():
    return torch.arange(_numel(SHAPE), dtype=torch.float32).view(SHAPE)


def _flat_pieces(cuts, key="t"):
    """Each box (columns [3 j, 3 j + 3)) cut into flat ranges at ``cuts``."""
    pieces = []
    for j in range(2):
        box = _global()[:, 3 * j : 3 * j + 3].reshape(-1)
        bounds = [0] + [c for c in cuts if 0 < c < box.numel()] + [box.numel()]
        for a, b in zip(bounds, bounds[1:]):
            pieces.append(
                ShardedTensor.from_rank_offsets_flat(
                    key, box[a:b].clone(), (5, 3), (1, j, 2), flattened_range=slice(a, b)
                )
            )
    return pieces


def test_flat_pieces_and_whole_boxes_read_each_other(tmp_path):
    flat_dir, whole_dir = tmp_path / "flat", tmp_path / "whole"
    flat_dir.mkdir()
    whole_dir.mkdir()
    dist_checkpointing.save({"p": _flat_pieces([4, 7, 11])}, str(flat_dir))
    whole = ShardedTensor.from_rank_offsets("t", torch.zeros(SHAPE), replica_id=0)
    loaded = dist_checkpointing.load({"t": whole}, str(flat_dir))
    assert torch.equal(loaded["t"], _global())

    dist_checkpointing.save({"t": ShardedTensor.from_rank_offsets("t", _global())}, str(whole_dir))
    request = _flat_pieces([2, 9, 13])
    for piece in request:
        piece.data.zero_()
    loaded = dist_checkpointing.load({"p": request}, str(whole_dir))
    for piece, value in zip(request, loaded["p"]):
        rng, j = piece.flattened_range, piece.global_offset[1] // 3
        expected = _global()[:, 3 * j : 3 * j + 3].reshape(-1)[rng]
        assert torch.equal(value, expected)
        assert value.data_ptr() == piece.data.data_ptr(), "a flat piece is read in place"


def test_a_flat_range_one_element_off_is_refused(tmp_path):
    pieces = _flat_pieces([4])
    shifted = pieces[1]
    pieces[1] = ShardedTensor.from_rank_offsets_flat(
        "t",
        shifted.data[1:].clone(),
        (5, 3),
        (1, 0, 2),
        flattened_range=slice(shifted.flattened_range.start + 1, shifted.flattened_range.stop),
    )
    with pytest.raises(CheckpointingException, match="cover"):
        dist_checkpointing.save({"p": pieces}, str(tmp_path))


@pytest.mark.parametrize(
    "rng, length, message",
    [
        (slice(3, 3), 0, "0 <= start < stop"),
        (slice(0, 16), 16, "0 <= start < stop <= 15"),
        (slice(0, 4, 2), 2, "step 1"),
        (slice(2, 6), 5, r"expected \(4,\)"),
    ],
    ids=["empty", "past-the-box", "strided", "data-length"],
)
def test_bad_flattened_range_is_refused_naming_it(rng, length, message):
    with pytest.raises(CheckpointingException, match=message):
        ShardedTensor.from_rank_offsets_flat(
            "t", torch.zeros(length), (5, 3), (1, 0, 2), flattened_range=rng
        )
