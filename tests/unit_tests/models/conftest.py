"""Fixtures for the model tests: a gloo world when launched by torchrun, and model-parallel
layouts that are torn down after each test.

Single-process tests need none of this; tests that need several ranks skip, saying how to run
them, when pytest is not launched by torchrun (no WORLD_SIZE in the environment).
"""

import os
from datetime import timedelta
from typing import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state

RUN_HINT = "torchrun --nproc-per-node 4 -m pytest tests/unit_tests/models"


@pytest.fixture(scope="session")
def dist_world() -> int:
    """World size of the gloo process group, initialized once per session under torchrun.

    Without WORLD_SIZE (plain pytest) the requesting test is skipped with a hint.
    """
    if "WORLD_SIZE" not in os.environ:
        pytest.skip(f"needs several ranks (torch.distributed, gloo); run: {RUN_HINT}")
    if not dist.is_initialized():
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    return dist.get_world_size()


@pytest.fixture
def model_parallel(dist_world: int) -> Iterator[Callable[..., None]]:
    """Factory ``model_parallel(**layout)`` calling ``initialize_model_parallel(**layout)``.

    Skips (with the reason) when the world size is not a multiple of TP x CP x PP; the
    state is destroyed after the test, passed or failed.
    """

    def initialize(**layout) -> None:
        needed = 1
        for key in (
            "tensor_model_parallel_size",
            "context_parallel_size",
            "pipeline_model_parallel_size",
        ):
            needed *= layout.get(key, 1)
        if dist_world % needed != 0:
            pytest.skip(
                f"layout {layout} needs a multiple of {needed} ranks, the world has "
                f"{dist_world}; run: {RUN_HINT}"
            )
        parallel_state.initialize_model_parallel(**layout)

    yield initialize
    parallel_state.destroy_model_parallel()
