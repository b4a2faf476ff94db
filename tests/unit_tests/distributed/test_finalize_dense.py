"""``finalize_model_grads`` on a dense model pays nothing for MoE (issue 43): the walk over
every module looking for routers with an expert bias runs only where a chunk's config enables
``moe_router_enable_expert_bias`` (or a chunk has no config to ask)."""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed import finalize_model_grads

pytestmark = pytest.mark.world(1)


class _Chunk(torch.nn.Module):
    """A chunk whose gradients are already reduced; counts the walks over its modules."""

    def __init__(self, config) -> None:
        super().__init__()
        if config is not None:
            self.config = config
        self.linear = torch.nn.Linear(2, 2)
        self.walks = 0

    def finish_grad_sync(self, force_all_reduce=False) -> None:
        pass

    def modules(self):
        self.walks += 1
        return super().modules()


@pytest.mark.parametrize(
    "config, walks",
    [
        (SimpleNamespace(moe_router_enable_expert_bias=False), 0),
        (SimpleNamespace(moe_router_enable_expert_bias=True), 1),
        (None, 1),
    ],
    ids=["dense", "expert-bias", "no-config"],
)
def test_finalize_walks_the_modules_only_where_routers_may_have_an_expert_bias(config, walks):
    chunk = _Chunk(config)
    finalize_model_grads([chunk])
    assert chunk.walks == walks
