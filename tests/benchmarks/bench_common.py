"""Shared helpers of the benchmarks: which ``megatron`` is running, process setup, timing
statistics, tables, and a CPU peak-memory probe.

The benchmarks import whichever ``megatron`` is first on the path: this repository's (the
main ``python3``, editable install) or the real megatron-core 0.16.1 (``/opt/mcore/bin/python``,
whose site-packages hold it; run the script by path so the repository root is not on
``sys.path``). ``framework()`` says which one was imported.
"""

import json
import os
import random
import statistics
import subprocess
import sys
import warnings
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")


def framework() -> Dict[str, str]:
    """``{"name", "version", "path"}`` of the imported ``megatron.core``.

    megatron-core ships ``megatron.core.package_info``; this repository does not.
    """
    import megatron.core

    path = os.path.dirname(megatron.core.__file__)
    try:
        from megatron.core import package_info  # megatron-core only
    except ImportError:
        return {"name": "ours", "version": "repo", "path": path}
    return {"name": "megatron-core", "version": package_info.__version__, "path": path}


def install_mcore_cpu_shim() -> List[str]:
    """Let megatron-core 0.16.1's schedules, p2p and DDP run on CPU with gloo.

    megatron-core hard-codes CUDA in these places (0.16.1 line numbers):

    - ``pipeline_parallel/schedules.py`` 596, 983, 2138: ``total_num_tokens =
      torch.zeros([], dtype=torch.int, device="cuda")`` at the top of each of the three
      schedules. Shim: the module's ``torch`` name is replaced by a copy of the torch
      namespace whose ``zeros`` maps ``device="cuda"`` to the CPU (every other attribute is
      the real one; a plain module-dict lookup, so no per-access cost).
    - ``pipeline_parallel/p2p_communication.py`` 313, 321 (receive buffers) and 190-202
      (shape exchange): ``device=torch.cuda.current_device()``; 242, 398:
      ``torch.cuda.synchronize()`` after batched p2p (``batch_p2p_sync``).
      ``distributed/param_and_grad_buffer.py`` 783-806: gradient buffers on
      ``torch.cuda.current_device()``. Shim: ``torch.cuda.current_device`` returns the CPU
      device and ``torch.cuda.synchronize`` does nothing (there is no device to wait for).
    - ``schedules.py`` 418: ``torch.autocast("cuda")`` with ``enable_autocast`` (not used
      by the benchmarks; not shimmed).

    Only for the process running megatron-core; returns a description of what was patched.
    """
    import types

    from megatron.core.pipeline_parallel import schedules

    torch_copy = types.ModuleType("torch")
    torch_copy.__dict__.update(torch.__dict__)
    real_zeros = torch.zeros

    def zeros(*args, device=None, **kwargs):
        return real_zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    torch_copy.zeros = zeros
    schedules.torch = torch_copy
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    return [
        "schedules.torch.zeros: device='cuda' -> cpu",
        "torch.cuda.current_device() -> cpu",
        "torch.cuda.synchronize() -> no-op",
    ]


def init_distributed(backend: str = "gloo") -> None:
    """Initialize the default group from torchrun's environment (single process if unset)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group(backend, timeout=timedelta(seconds=600))


def rank0() -> bool:
    """True on global rank 0 (or without torch.distributed)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def say(*args) -> None:
    """Print on rank 0 only, flushed."""
    if rank0():
        print(*args, flush=True)


def all_max(values: Sequence[float]) -> List[float]:
    """Element-wise maximum of ``values`` over all ranks."""
    return _all_reduce(values, dist.ReduceOp.MAX)


def all_sum(value: float) -> float:
    """``value`` summed over all ranks."""
    return _all_reduce([value], dist.ReduceOp.SUM)[0]


def synchronize() -> None:
    """Wait for this process's GPU work (no-op without CUDA)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _all_reduce(values: Sequence[float], op) -> List[float]:
    """``values`` reduced with ``op`` over all ranks (float64; on the GPU under nccl)."""
    tensor = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            tensor = tensor.cuda()
        dist.all_reduce(tensor, op=op)
    return tensor.cpu().tolist()


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return statistics.median(values)


def quartiles(values: Sequence[float]) -> tuple:
    """(25th, 75th) percentiles (inclusive method)."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def ratio_interval(
    a: Sequence[float], b: Sequence[float], resamples: int = 2000, seed: int = 0
) -> tuple:
    """Bootstrap 95% interval of ``median(a) / median(b)`` (a and b resampled apart).

    Percentiles 2.5 and 97.5 of the ratio over ``resamples`` draws with replacement.
    """
    gen = random.Random(seed)
    ratios = sorted(
        median(gen.choices(a, k=len(a))) / median(gen.choices(b, k=len(b)))
        for _ in range(resamples)
    )
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def git_commit() -> str:
    """The repository's HEAD commit (short), or "unknown" outside a git checkout."""
    root = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def table(headers: Sequence[str], rows: Sequence[Sequence], align: Optional[str] = None) -> str:
    """A GitHub-markdown table; ``align`` is one 'l' or 'r' per column (default: l, then r)."""
    align = align or "l" + "r" * (len(headers) - 1)
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(values):
        parts = [v.ljust(w) if a == "l" else v.rjust(w) for v, w, a in zip(values, widths, align)]
        return "| " + " | ".join(parts) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if a == "r" else (":" + "-" * (w + 1))
            for w, a in zip(widths, align)
        )
        + "|"
    )
    return "\n".join([line(headers), rule] + [line(r) for r in cells])


def machine() -> str:
    """One line describing this machine and the software."""
    cpus = os.cpu_count()
    model = ""
    try:
        with open("/proc/cpuinfo") as handle:
            for entry in handle:
                if entry.startswith("model name"):
                    model = entry.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = ""
    if torch.cuda.is_available():
        gpu = f", GPU {torch.cuda.get_device_name()}"
    fw = framework()
    return (
        f"{cpus} CPU cores ({model}){gpu}; python {sys.version.split()[0]}, torch "
        f"{torch.__version__}; megatron: {fw['name']} {fw['version']} ({fw['path']})"
    )


def peak_cpu_bytes(fn: Callable[[], None]) -> int:
    """Peak growth of live CPU bytes allocated by torch while ``fn`` runs.

    Measured from the profiler's memory events (every allocation and free of torch's CPU
    allocator, all threads, with sizes): the running sum of allocated minus freed bytes,
    in time order, relative to the start of ``fn``. Timing is not measured here (the
    profiler slows everything down).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort()
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def append_json(path: Optional[str], record: dict) -> None:
    """Append ``record`` as one JSON line to ``path`` (rank 0; nothing when path is None)."""
    if path and rank0():
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


def gpt_forward_step(data_iterator, model):
    """GPT training callback of the benchmarks: three values (S_c, N_c, reported)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["positions"], labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"]
        loss_sum = (output_tensor * mask).sum()
        num_tokens = mask.sum().to(torch.int)
        return loss_sum, num_tokens, {"lm loss": [loss_sum.detach(), num_tokens]}

    return output, loss_func
