"""Fixtures for the checkpoint tests: one directory that every rank of the launch sees."""

import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A fresh directory made by rank 0 and named to every rank; removed after the test."""
    name = [tempfile.mkdtemp(prefix="ckpt-test-")] if _rank() == 0 else [None]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    path = Path(name[0])
    yield path
    if dist.is_initialized():
        dist.barrier()
    if _rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
