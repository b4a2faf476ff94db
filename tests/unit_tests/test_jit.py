"""``megatron.core.jit.jit_fuser`` inside a compiled graph: the fused function is traced
into the graph, and an eager call that later creates its own compiled function does not
make the graph compile again."""

import functools

import pytest
import torch

from megatron.core.jit import jit_fuser

pytestmark = pytest.mark.world(1)


def _scale_shift(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_a_graph_calling_a_fused_function_is_not_compiled_again_after_an_eager_call(
    monkeypatch,
):
    import torch._dynamo.testing

    torch._dynamo.reset()
    fused = jit_fuser(_scale_shift)
    counter = torch._dynamo.testing.CompileCounter()
    graph = torch.compile(lambda x: fused(x).sin(), backend=counter)
    x = torch.randn(4)
    assert torch.equal(graph(x), _scale_shift(x).sin())
    eager_compile = functools.partial(torch.compile, backend="eager")
    monkeypatch.setattr(torch, "compile", eager_compile)  # the fused function's own compile
    assert torch.equal(fused(x), _scale_shift(x))  # an eager call: creates it
    assert torch.equal(graph(x), _scale_shift(x).sin())
    assert counter.frame_count == 1
    torch._dynamo.reset()
