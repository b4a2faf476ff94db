"""Checksums across ranks: each rank's items are checked against the CRC-32 it recorded at
save (gathered into rank 0's ``checksums.json``); one flipped bit in rank 1's shard file is
an error naming that file on every rank, with no rank left waiting."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import CheckpointingException, ShardedTensor

pytestmark = [pytest.mark.world(2), pytest.mark.timeout(120)]


def _piece(rank: int, world: int, data: torch.Tensor) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", data, (0, rank, world))}


def test_a_flipped_bit_in_another_ranks_shard_is_named_on_every_rank(shared_dir):
    rank, world = dist.get_rank(), dist.get_world_size()
    whole = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(3))
    mine = whole.chunk(world)[rank].clone()
    dist_checkpointing.save(_piece(rank, world, mine), str(shared_dir))
    sums = (shared_dir / "checksums.json").read_text()
    assert all(f"__{r}_0.distcp" in sums for r in range(world)), sums

    everything = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(whole))}
    assert torch.equal(dist_checkpointing.load(everything, str(shared_dir))["w"], whole)
    dist.barrier()
    shard = shared_dir / "__1_0.distcp"
    if rank == 0:
        data = bytearray(shard.read_bytes())
        at = data.find(whole.chunk(world)[1].numpy().tobytes())
        assert at >= 0
        data[at + 5] ^= 0x01
        shard.write_bytes(bytes(data))
    dist.barrier()
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(whole))}
    with pytest.raises(CheckpointingException, match=f"{shard}: item 'w'.*checksum mismatch"):
        dist_checkpointing.load(request, str(shared_dir))
    # only rank 1 reads the damaged file here; rank 0 hears of it too
    with pytest.raises(CheckpointingException, match="__1_0.distcp: item 'w'.*checksum mismatch"):
        dist_checkpointing.load(_piece(rank, world, torch.zeros_like(mine)), str(shared_dir))
