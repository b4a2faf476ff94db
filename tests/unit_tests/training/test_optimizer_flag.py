"""megatron's ``--optimizer adam|sgd`` and ``--sgd-momentum`` in the trainer (SPEC section 21):
SGD's update is p - lr * buf with buf = momentum * buf + grad (torch's SGD, checked here on
two steps against the formula), Adam's flags refused with SGD and the momentum with Adam, the
recorded ``lr`` is ``--lr``; (slow) SGD with the distributed optimizer at dp2 follows the
one-process run."""

import pytest
import torch

from megatron.training import TrainingConfig
from megatron.training.arguments import validate_config
from megatron.training.errors import UsageError
from megatron.training.model import build_model
from megatron.training.training import build_optimizer, pretrain
from tests.unit_tests.dist_utils import fresh_layout

SMALL = dict(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=16,
             global_batch_size=4, progress=False)  # fmt: skip


@pytest.mark.world(1)
def test_sgd_with_momentum_steps_by_the_formula():
    config = TrainingConfig(**SMALL, optimizer="sgd", sgd_momentum=0.5, lr=0.1, clip_grad=0.0)
    with fresh_layout():
        model = build_model(config, validate_config(config, 1), None)
        optimizer, _ = build_optimizer(config, model, None)
        params = [p for p in model[0].parameters() if p.requires_grad]
        buffers = [torch.zeros_like(p) for p in params]
        tokens = torch.arange(16).remainder(7).view(1, 16) + 4
        for step in range(2):
            before = [p.detach().clone() for p in params]
            model[0].zero_grad_buffer()
            loss = model[0](tokens, torch.arange(16).view(1, 16), labels=tokens).sum() * (step + 1)
            loss.backward()
            for chunk in model:
                chunk.finish_grad_sync()
            grads = [p.main_grad.detach().clone() for p in params]
            optimizer.step()
            for p, b, g, old in zip(params, buffers, grads, before):
                b.mul_(0.5).add_(g)
                assert torch.allclose(p, old - 0.1 * b, rtol=1e-6, atol=1e-7)


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(optimizer="sgd", adam_beta1=0.8), "--adam-beta1 0.8 with --optimizer sgd"),
        (dict(sgd_momentum=0.0), "--sgd-momentum 0.0 with --optimizer adam"),
        (dict(optimizer="lion"), "--optimizer"),
        (dict(optimizer="sgd", sgd_momentum=1.0), "--sgd-momentum"),
    ],
)
def test_optimizer_flags_are_refused_by_name(changes, message):
    with pytest.raises(UsageError, match=message):
        validate_config(TrainingConfig(**SMALL, **changes), 1)


@pytest.mark.world(2)
@pytest.mark.slow
def test_sgd_with_the_distributed_optimizer_follows_the_one_process_run():
    with fresh_layout():
        result = pretrain(TrainingConfig(**SMALL, optimizer="sgd", lr=0.05, train_iters=3,
                                         use_distributed_optimizer=True,
                                         compare_single_process=True))  # fmt: skip
    assert result.passed
    assert [r["lr"] for r in result.records] == [0.05] * 3
