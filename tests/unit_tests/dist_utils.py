"""Helpers for distributed tests: layouts, shared failure reports, relative errors."""

import contextlib
import os
from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class Layout:
    """A parallel layout: context, pipeline, virtual-pipeline and data-parallel sizes, and
    tensor parallelism (``tp``) with or without sequence parallelism (``sp``)."""

    cp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    dp: int = 1
    tp: int = 1
    sp: bool = False
    ep: int = 1  # expert parallelism (experts split over ep ranks of tp x dp x cp)
    etp: Optional[int] = None  # expert tensor parallelism (None: tp)

    def __post_init__(self) -> None:
        if self.etp == self.tp:  # one spelling of "expert TP = TP", as current_layout reads it
            object.__setattr__(self, "etp", None)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def id(self) -> str:
        vpp = f"-vpp{self.vpp}" if self.vpp else ""
        tp = f"tp{self.tp}{'-sp' if self.sp else ''}-" if self.tp > 1 else ""
        ep = f"-ep{self.ep}" if self.ep > 1 else ""
        etp = f"-etp{self.etp}" if self.etp is not None else ""
        return f"{tp}cp{self.cp}-pp{self.pp}{vpp}-dp{self.dp}{ep}{etp}"


def use_layout(layout: Layout) -> None:
    """Make ``layout`` the parallel_state layout (no-op when parallel_state already has it)."""
    if layout.world != WORLD_SIZE:
        raise ValueError(f"layout {layout.id} needs {layout.world} ranks, world is {WORLD_SIZE}")
    if current_layout() == replace(layout, sp=False):
        return
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
        )


def current_layout() -> Optional[Layout]:
    """The layout parallel_state holds now (None when not initialized; ``sp`` is not part
    of parallel_state and reads False)."""
    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return None
    tp = parallel_state.get_tensor_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    return Layout(
        tp=tp,
        cp=parallel_state.get_context_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        vpp=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        dp=parallel_state.get_data_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size(),
        etp=None if etp == tp else etp,
    )


def reset_layout() -> None:
    """Forget the parallel_state layout (for tests that need none)."""
    parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def fresh_layout() -> Iterator[None]:
    """No parallel_state layout on entering the block, none left after it (even on error):
    for runs such as ``pretrain`` that build their own."""
    reset_layout()
    try:
        yield
    finally:
        reset_layout()


class StubChunk(torch.nn.Module):
    """The least a schedule needs of a model chunk: ``config`` and ``set_input_tensor``."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def set_input_tensor(self, tensor) -> None:
        pass


def gather_failures(failures: List[str]) -> List[str]:
    """Every rank's failure messages, on every rank (prefixed with the rank)."""
    if not dist.is_initialized():
        return list(failures)
    everyone: List[Optional[List[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(failures))
    return [f"rank {r}: {msg}" for r, msgs in enumerate(everyone) for msg in msgs]


def assert_no_failures(failures: List[str]) -> None:
    """Fail on every rank if any rank found a failure (keeps ranks in step)."""
    everyone = gather_failures(failures)
    assert not everyone, "\n".join(everyone[:40])


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (absolute norm when expected is 0)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def compare_tensors(
    actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], tol: float, what: str
) -> List[str]:
    """Failure messages for entries of ``actual`` farther than ``tol`` from ``expected``."""
    failures = []
    for name, value in actual.items():
        err = rel_error(value, expected[name])
        if not err <= tol:
            failures.append(f"{what} {name}: relative error {err:.3e} > {tol:.0e}")
    return failures
