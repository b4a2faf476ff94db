"""P2PCommunicator: messages arrive where and as they were sent, on gloo."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.device import comm_device
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.dist_utils import WORLD_SIZE, Layout, assert_no_failures, use_layout

SHAPE = [3, 2, 4]


def _p2p(pp: int, batch: bool = True, variable: bool = False) -> P2PCommunicator:
    use_layout(Layout(pp=pp, dp=WORLD_SIZE // pp))
    config = TransformerConfig(
        num_layers=pp,
        hidden_size=4,
        num_attention_heads=1,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=batch,
        variable_seq_lengths=variable,
    )
    return P2PCommunicator(ps.get_pipeline_model_parallel_group(), config)


def _tag(stage: int, kind: float, shape=SHAPE) -> torch.Tensor:
    """A tensor whose values say who sent it and what it is."""
    value = 100.0 * dist.get_rank() + 10.0 * stage + kind
    return torch.full(shape, value, device=comm_device())


def _expected(rank: int, stage: int, kind: float) -> float:
    return 100.0 * rank + 10.0 * stage + kind


@pytest.mark.world(4, 8)
@pytest.mark.parametrize("batch", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("pp", [2, 4])
def test_forward_and_backward_chains(pp, batch):
    p2p = _p2p(pp, batch)
    stage, first, last = p2p.pp_rank, p2p.pp_rank == 0, p2p.pp_rank == pp - 1
    failures = []
    received = p2p.recv_forward(SHAPE, first)
    p2p.send_forward(_tag(stage, 1), last)
    if not first and received[0, 0, 0].item() != _expected(p2p.prev_rank, stage - 1, 1):
        failures.append(f"recv_forward got {received[0, 0, 0].item()}")
    grad = p2p.recv_backward(SHAPE, last)
    p2p.send_backward(_tag(stage, 2), first)
    if not last and grad[0, 0, 0].item() != _expected(p2p.next_rank, stage + 1, 2):
        failures.append(f"recv_backward got {grad[0, 0, 0].item()}")
    assert_no_failures(failures)


@pytest.mark.world(4, 8)
@pytest.mark.parametrize("batch", [True, False], ids=["batched", "unbatched"])
def test_both_directions_between_one_pair_are_not_swapped(batch):
    """PP = 2: the next and previous stage are one rank; activations and gradients in flight
    between the same pair at once must not be confused (interleaved steady state)."""
    p2p = _p2p(2, batch)
    stage = p2p.pp_rank
    act, grad = p2p.send_forward_backward_recv_forward_backward(
        _tag(stage, 1), _tag(stage, 2), recv_prev=True, recv_next=True, tensor_shape=SHAPE
    )
    other = p2p.next_rank
    failures = []
    if act[0, 0, 0].item() != _expected(other, 1 - stage, 1):
        failures.append(f"activation slot got {act[0, 0, 0].item()}")
    if grad[0, 0, 0].item() != _expected(other, 1 - stage, 2):
        failures.append(f"gradient slot got {grad[0, 0, 0].item()}")
    assert_no_failures(failures)


@pytest.mark.world(4, 8)
def test_combined_send_and_receive_operations():
    p2p = _p2p(4 if WORLD_SIZE >= 4 else 2)
    stage, pp = p2p.pp_rank, p2p.pp_size
    first, last = stage == 0, stage == pp - 1
    failures = []
    received = p2p.recv_forward(SHAPE, first)
    grad = p2p.send_forward_recv_backward(_tag(stage, 1), SHAPE, last)
    nxt = p2p.send_backward_recv_forward(_tag(stage, 2), SHAPE, first)
    p2p.send_forward(_tag(stage, 3), last)
    if not last and grad[0, 0, 0].item() != _expected(p2p.next_rank, stage + 1, 2):
        failures.append(f"send_forward_recv_backward got {grad[0, 0, 0].item()}")
    if not first and received[0, 0, 0].item() != _expected(p2p.prev_rank, stage - 1, 1):
        failures.append(f"recv_forward got {received[0, 0, 0].item()}")
    if not first and nxt[0, 0, 0].item() != _expected(p2p.prev_rank, stage - 1, 3):
        failures.append(f"send_backward_recv_forward got {nxt[0, 0, 0].item()}")
    ring = p2p.send_forward_recv_forward(_tag(stage, 4), True, SHAPE)
    back = p2p.send_backward_recv_backward(_tag(stage, 5), True, SHAPE)
    if ring[0, 0, 0].item() != _expected(p2p.prev_rank, (stage - 1) % pp, 4):
        failures.append(f"send_forward_recv_forward got {ring[0, 0, 0].item()}")
    if back[0, 0, 0].item() != _expected(p2p.next_rank, (stage + 1) % pp, 5):
        failures.append(f"send_backward_recv_backward got {back[0, 0, 0].item()}")
    assert_no_failures(failures)


@pytest.mark.world(4, 8)
@pytest.mark.parametrize("batch", [True, False], ids=["batched", "unbatched"])
def test_variable_seq_lengths_exchange_shapes_first(batch):
    p2p = _p2p(2, batch, variable=True)
    stage = p2p.pp_rank
    mine = [5 + stage + dist.get_rank(), 2, 4]
    act, grad = p2p.send_forward_backward_recv_forward_backward(
        _tag(stage, 1, mine), _tag(stage, 2, mine), True, True, tensor_shape=None
    )
    other = p2p.next_rank
    theirs = [5 + (1 - stage) + other, 2, 4]
    failures = []
    for name, got, kind in (("activation", act, 1), ("gradient", grad, 2)):
        if list(got.shape) != theirs or got.flatten()[0].item() != _expected(
            other, 1 - stage, kind
        ):
            failures.append(f"{name}: shape {list(got.shape)} (want {theirs})")
    assert_no_failures(failures)


@pytest.mark.world(4, 8)
def test_variable_seq_lengths_bare_send_and_receive():
    """A send that receives nothing still sends its shape: the next stage's receive waits
    for it (1F1B's warm-up ``send_forward`` / ``recv_forward``)."""
    p2p = _p2p(2, variable=True)
    stage = p2p.pp_rank
    shape = [7, 1, 4]
    got = p2p.recv_forward(None, stage == 0)
    p2p.send_forward(_tag(stage, 1, shape), stage == 1)
    grad = p2p.recv_backward(None, stage == 1)
    p2p.send_backward(_tag(stage, 2, [5, 1, 4]), stage == 0)
    failures = []
    if stage == 1 and list(got.shape) != shape:
        failures.append(f"recv_forward got shape {list(got.shape)}, want {shape}")
    if stage == 0 and list(grad.shape) != [5, 1, 4]:
        failures.append(f"recv_backward got shape {list(grad.shape)}, want [5, 1, 4]")
    assert_no_failures(failures)


@pytest.mark.world(4, 8)
def test_list_of_shapes_gives_list_of_tensors():
    p2p = _p2p(2)
    stage = p2p.pp_rank
    got = p2p.recv_forward([SHAPE], stage == 0)
    p2p.send_forward([_tag(stage, 1)], stage == 1)
    assert isinstance(got, list) and len(got) == 1
