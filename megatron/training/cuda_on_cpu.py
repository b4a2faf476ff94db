"""Run a CUDA training script unchanged on the CPU (gloo), for scripts written against
megatron-core such as its ``examples/run_simple_mcore_train_loop.py``::

    torchrun --nproc-per-node 2 -m megatron.training.cuda_on_cpu SCRIPT [ARGS ...]

Nothing else is changed: the package itself already runs on CPU with gloo. The mapping
(applied in this process before the script runs, listed in docs/checkpoints.md):

=============================================  =============================================
script calls                                   runs as
=============================================  =============================================
``torch.cuda.set_device(i)``                   nothing
``torch.cuda.synchronize(...)``                nothing
``init_process_group(backend=None|"nccl")``    ``init_process_group(backend="gloo")``
``torch.device("cuda")``, ``("cuda:i")``,       ``torch.device("cpu")``
``("cuda", i)``
``tensor.to("cuda...")``, ``module.to(...)``   the same call with ``"cpu"``
``tensor.cuda(...)``, ``module.cuda(...)``     ``tensor.cpu()`` / the module on the CPU
=============================================  =============================================

``torch.cuda.is_available()`` still says False, so code that asks gets the truth.
"""

import runpy
import sys
from typing import Any, List

import torch
import torch.distributed as dist

_RealDevice = torch.device


_ORIGINALS = {}


def install() -> None:
    """Apply the mapping above to this process (idempotent; ``uninstall`` undoes it)."""
    if _ORIGINALS:
        return
    _ORIGINALS.update(
        set_device=torch.cuda.set_device,
        synchronize=torch.cuda.synchronize,
        device=torch.device,
        init_process_group=dist.init_process_group,
        tensor_to=torch.Tensor.to,
        module_to=torch.nn.Module.to,
        tensor_cuda=torch.Tensor.cuda,
        module_cuda=torch.nn.Module.cuda,
    )
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.device = _CpuDevice
    dist.init_process_group = _gloo_init(_ORIGINALS["init_process_group"])
    torch.Tensor.to = _cpu_to(_ORIGINALS["tensor_to"])
    torch.nn.Module.to = _cpu_to(_ORIGINALS["module_to"])
    torch.Tensor.cuda = lambda self, *args, **kwargs: self.cpu()
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self.cpu()


def uninstall() -> None:
    """Restore what ``install`` replaced."""
    if not _ORIGINALS:
        return
    torch.cuda.set_device = _ORIGINALS["set_device"]
    torch.cuda.synchronize = _ORIGINALS["synchronize"]
    torch.device = _ORIGINALS["device"]
    dist.init_process_group = _ORIGINALS["init_process_group"]
    torch.Tensor.to = _ORIGINALS["tensor_to"]
    torch.nn.Module.to = _ORIGINALS["module_to"]
    torch.Tensor.cuda = _ORIGINALS["tensor_cuda"]
    torch.nn.Module.cuda = _ORIGINALS["module_cuda"]
    _ORIGINALS.clear()


def main(argv: List[str] = None) -> None:
    """``python -m megatron.training.cuda_on_cpu SCRIPT [ARGS ...]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    install()
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


class _DeviceType(type):
    """``torch.device`` stand-in: calls build real devices with CUDA mapped to the CPU;
    ``isinstance(x, torch.device)`` still means a real device."""

    def __call__(cls, *args: Any, **kwargs: Any) -> "torch.device":
        if args and _is_cuda(args[0]):
            return _RealDevice("cpu")
        if kwargs.get("type") is not None and _is_cuda(kwargs["type"]):
            return _RealDevice("cpu")
        return _RealDevice(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _RealDevice)


class _CpuDevice(metaclass=_DeviceType):
    """See ``_DeviceType``."""


def _is_cuda(value: Any) -> bool:
    if isinstance(value, str):
        return value.split(":")[0].strip() == "cuda"
    return isinstance(value, _RealDevice) and value.type == "cuda"


def _map(value: Any) -> Any:
    return "cpu" if _is_cuda(value) else value


def _cpu_to(real_to):
    """``.to`` with CUDA device arguments mapped to the CPU."""

    def to(self, *args, **kwargs):
        args = tuple(_map(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = _map(kwargs["device"])
        return real_to(self, *args, **kwargs)

    return to


def _gloo_init(real):
    """``init_process_group`` with no backend or nccl mapped to gloo."""

    def init_process_group(backend=None, *args, **kwargs):
        if backend is None or "nccl" in str(backend):
            backend = "gloo"
        return real(backend, *args, **kwargs)

    return init_process_group


if __name__ == "__main__":
    main()
