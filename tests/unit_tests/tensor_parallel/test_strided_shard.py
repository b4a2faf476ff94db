"""One strided split (``tensor_parallel.utils.strided_shard``): a parameter's TP shard is
blocks r, r + T, ... of T * ``partition_stride`` blocks along ``partition_dim``, the same
for the layers' initialization, GPTModel's seeded weights, the HF PEFT import and the
experts."""

import pytest
import torch

from megatron.core.tensor_parallel import layers
from megatron.core.tensor_parallel.utils import strided_shard

pytestmark = pytest.mark.world(1)


def test_strided_shard_keeps_every_size_th_block():
    full = torch.arange(24).reshape(12, 2)
    assert torch.equal(strided_shard(full, 0, 2, 3, 1), full[[2, 3, 8, 9]])
    assert torch.equal(strided_shard(full, 1, 1, 2, 0), full[:, :1])
    assert strided_shard(full, 0, 2, 1, 0) is full


def test_every_tp_split_is_the_one_strided_shard():
    from megatron.core.models.gpt.gpt_model import tp_shard
    from megatron.core.transformer.moe import expert_lora, experts
    from megatron.training.hf import peft

    full = torch.arange(48, dtype=torch.float32).reshape(12, 4)
    param = torch.empty(4, 4)
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 2
    group = type("Group", (), {"size": lambda self: 3, "rank": lambda self: 2})()
    layer = type("Layer", (), {"tp_group": group})()
    expected = full[[4, 5, 10, 11]]
    assert torch.equal(tp_shard(full, param, 3, 2), expected)
    assert torch.equal(peft._tp_slice(full, param, layer), expected)
    master = layers._initialize_from_full_weight(
        param, (12, 4), 0, lambda w: w.copy_(full), stride=2, rank=2, world_size=3
    )
    assert torch.equal(param, expected) and torch.equal(master, full)
    assert experts.strided_shard is expert_lora.strided_shard is strided_shard
