"""comm_device: the backend of a group decides where its tensors live (SPEC section 3)."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import device as device_module
from megatron.core.device import comm_device

pytestmark = pytest.mark.world(1)


@pytest.fixture
def fake_backend(monkeypatch):
    """Pretend torch.distributed is initialized with a given backend and CUDA state."""

    def install(backend: str, cuda: bool) -> None:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    return install


@pytest.mark.parametrize(
    "backend, cuda, expected",
    [
        ("gloo", True, "cpu"),
        ("nccl", True, "cuda"),
        ("cpu:gloo,cuda:nccl", True, "cuda"),
        # init_process_group() without a backend: torch's lazy "undefined" backend creates
        # nccl for CUDA tensors (megatron-core's simple example initializes this way).
        ("undefined", True, "cuda"),
        ("undefined", False, "cpu"),
    ],
)
def test_comm_device_follows_the_backend(fake_backend, backend, cuda, expected):
    fake_backend(backend, cuda)
    assert comm_device().type == expected
    assert device_module.supports_avg() == (expected == "cuda")


def test_no_distributed_init_is_cpu():
    assert comm_device() == torch.device("cpu")


@pytest.mark.parametrize(
    "requested, cuda, gpus, local, expected",
    [
        ("auto", True, 1, 1, "nccl"),
        ("auto", True, 1, 2, "gloo"),  # fewer GPUs than local processes
        ("auto", False, 0, 1, "gloo"),
        ("gloo", True, 8, 1, "gloo"),
        ("nccl", False, 0, 1, "nccl"),  # as asked; initialize_single_gpu refuses it by name
    ],
)
def test_choose_backend(monkeypatch, requested, cuda, gpus, local, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert device_module.choose_backend(requested, local) == expected


def test_choose_backend_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="backend 'mpi': expected 'auto', 'gloo' or 'nccl'"):
        device_module.choose_backend("mpi")
