"""RNG streams and activation recomputation (``tensor_parallel.random``), on CPU where the
tracker forks the CPU generator.

Reference draws come from fresh ``torch.Generator``s seeded as documented (default stream:
seed; model-parallel stream: seed + 2718 + tp_rank).
"""

import importlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    checkpoint,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    model_parallel_cuda_manual_seed,
)
from tests.unit_tests.dist_utils import WORLD_SIZE, assert_no_failures, rel_error, reset_layout
from tests.unit_tests.tensor_parallel.test_layers import _config, _mlp
from tests.unit_tests.tensor_parallel.tp_reference import (
    TOL,
    block,
    device,
    on_device,
    seeded,
    world_group,
)

random_module = importlib.import_module("megatron.core.tensor_parallel.random")

SEED = 123


def _draws(seed: int, n: int, count: int = 1, on: str = "cpu"):
    """The first ``count`` draws of torch.rand(n) from a generator seeded with ``seed``."""
    gen = torch.Generator(device=on).manual_seed(seed)
    return [torch.rand(n, generator=gen, device=on) for _ in range(count)]


@pytest.mark.world(1)
def test_fork_uses_the_tracked_stream_and_restores_the_default():
    model_parallel_cuda_manual_seed(SEED, tp_rank=0)
    tracker = get_cuda_rng_tracker()
    default = _draws(SEED, 3, 2)
    model = _draws(SEED + 2718, 3, 2)
    first = torch.rand(3)
    with tracker.fork():
        in_fork = torch.rand(3)
    second = torch.rand(3)
    with tracker.fork():
        in_fork_again = torch.rand(3)
    with tracker.fork(get_data_parallel_rng_tracker_name()):
        data_parallel = torch.rand(3)
    assert torch.equal(first, default[0]) and torch.equal(second, default[1])
    assert torch.equal(in_fork, model[0]) and torch.equal(in_fork_again, model[1])
    assert torch.equal(data_parallel, _draws(SEED, 3)[0])


@pytest.mark.world(1)
def test_nested_forks_continue_each_stream():
    """fork(a) inside fork(a), and fork(data) inside fork(model): every stream continues
    where it left off; the default stream is untouched."""
    model_parallel_cuda_manual_seed(SEED, tp_rank=0)
    tracker = get_cuda_rng_tracker()
    model = _draws(SEED + 2718, 2, 3)
    with tracker.fork():
        first = torch.rand(2)
        with tracker.fork():
            second = torch.rand(2)
        with tracker.fork(get_data_parallel_rng_tracker_name()):
            data_parallel = torch.rand(2)
        third = torch.rand(2)
    assert all(torch.equal(a, b) for a, b in zip([first, second, third], model))
    assert torch.equal(data_parallel, _draws(SEED, 2)[0])
    assert torch.equal(torch.rand(2), _draws(SEED, 2)[0])


@pytest.mark.world(1)
def test_tracker_bad_input():
    model_parallel_cuda_manual_seed(SEED, tp_rank=0)
    tracker = get_cuda_rng_tracker()
    with pytest.raises(KeyError, match="'nope' is not added"):
        with tracker.fork("nope"):
            pass
    with pytest.raises(ValueError, match=f"seed {SEED} already exists"):
        tracker.add("another", SEED)
    with pytest.raises(NotImplementedError, match="distribute_saved_activations=True"):
        checkpoint(lambda x: x, True, torch.ones(1))


def _dropout_block(x, w):
    """Dropout in the model-parallel stream, dropout in the default stream, a matmul."""
    with get_cuda_rng_tracker().fork():
        x = F.dropout(x, p=0.5)
    return F.dropout(x @ w, p=0.3).tanh()


def _grads(use_checkpoint: bool):
    model_parallel_cuda_manual_seed(SEED, tp_rank=0)
    x = seeded((6, 4), 1).requires_grad_()
    w = seeded((4, 5), 2).requires_grad_()
    out = checkpoint(_dropout_block, False, x, w) if use_checkpoint else _dropout_block(x, w)
    torch.rand(7)  # the RNG moves on between the forward and the backward
    out.backward(seeded((6, 5), 3))
    return out.detach(), x.grad, w.grad


@pytest.mark.world(1)
def test_checkpoint_recomputes_with_the_forward_rng_states():
    plain, recomputed = _grads(False), _grads(True)
    for a, b in zip(plain, recomputed):
        assert torch.equal(a, b)
    assert (plain[1] == 0).any(), "dropout did not drop anything: the test would be vacuous"


@pytest.mark.world(1)
def test_negative_control_checkpoint_without_rng_restore(monkeypatch):
    plain = _grads(False)
    monkeypatch.setattr(random_module, "_set_all_rng_states", lambda states: None)
    recomputed = _grads(True)
    assert not torch.equal(plain[1], recomputed[1])


@pytest.mark.world(2, 4)
def test_tp_ranks_fork_different_streams_share_the_default():
    """tp_rank from parallel_state (MPU fallback): stream seed + 2718 + tp_rank."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD_SIZE)
    try:
        model_parallel_cuda_manual_seed(SEED)
        rank = parallel_state.get_tensor_model_parallel_rank()
    finally:
        reset_layout()
    on = device()  # the tracker's streams live on the default group's device
    with get_cuda_rng_tracker().fork():
        mine = torch.rand(4, device=on)
    default = torch.rand(4, device=on)
    failures = []
    if not torch.equal(mine, _draws(SEED + 2718 + rank, 4, on=on)[0]):
        failures.append("model-parallel stream is not seed + 2718 + tp_rank")
    if not torch.equal(default, _draws(SEED, 4, on=on)[0]):
        failures.append("default stream is not the seed")
    assert_no_failures(failures)


@pytest.mark.world(2, 4)
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_checkpointed_tp_mlp_gradients_equal_plain(sp):
    group, T, rank = world_group()
    fc1, fc2 = _mlp(_config(sp), group)

    def mlp(x):
        return fc2(F.gelu(fc1(x)[0]))[0]

    x_full, g_full = seeded((8, 2, 6), 1), seeded((8, 2, 6), 2)
    local = (lambda t: block(t, 0, rank, T)) if sp else (lambda t: t)
    results = []
    for use_checkpoint in (False, True):
        x = on_device(local(x_full)).requires_grad_()
        out = checkpoint(mlp, False, x) if use_checkpoint else mlp(x)
        out.backward(on_device(local(g_full)))
        results.append([x.grad, fc1.weight.grad.clone(), fc2.weight.grad.clone()])
        fc1.weight.grad = fc2.weight.grad = fc1.bias.grad = fc2.bias.grad = None
    failures = [
        f"gradient {i} differs with checkpoint"
        for i, (a, b) in enumerate(zip(*results))
        if not rel_error(b, a) <= TOL
    ]
    assert_no_failures(failures)
    dist.barrier()
