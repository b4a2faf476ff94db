"""The routed experts under ``torch.compile`` (the trainer's ``--compile``): one compilation
whatever the split of the tokens over the experts, and the eager results.

The per-expert paths read the token counts on the host; traced, every new split (an expert
with 0 or 1 tokens in particular) recompiled the experts' forward until dynamo's recompile
limit. They now run eagerly inside the compiled layer (``_eager_if_counts_on_host``); the
grouped GEMM path (``torch._grouped_mm``, which runs on the CPU for these shapes) stays in the
graph."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import megatron.core.transformer.moe.experts as experts
from megatron.core.transformer import TransformerConfig

pytestmark = pytest.mark.world(1)
# 20 rows over 4 experts, split 8 ways (empty and one-row experts included)
SPLITS = [[3, 0, 9, 8], [1, 5, 7, 7], [0, 0, 10, 10], [6, 6, 4, 4], [1, 1, 1, 17],
          [20, 0, 0, 0], [0, 1, 0, 19], [5, 5, 5, 5]]  # fmt: skip


def _experts(kind: str, monkeypatch):
    dtype = torch.bfloat16 if kind == "grouped-gemm" else torch.float32
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4,
        moe_ffn_hidden_size=8, add_bias_linear=True, gated_linear_unit=True, params_dtype=dtype,
    )  # fmt: skip
    module = (experts.SequentialMLP if kind == "sequential" else experts.GroupedMLP)(4, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    if kind == "grouped-gemm":
        monkeypatch.setattr(experts, "use_grouped_mm", lambda x, w: True)
    return module, dtype


def _step(module, x, counts, probs):
    """Outputs and the gradients of the inputs and parameters of sum(out * weights)."""
    x, probs = x.detach().requires_grad_(), probs.detach().requires_grad_()
    module.zero_grad()
    out, _ = module(x, torch.tensor(counts), probs)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype))
    return [out.detach(), x.grad, probs.grad] + [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("kind", ["sequential", "grouped-loop", "grouped-gemm"])
def test_the_experts_compile_once_for_every_split_with_the_eager_results(kind, monkeypatch):
    module, dtype = _experts(kind, monkeypatch)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=counter)
    generator = torch.Generator().manual_seed(1)
    torch._dynamo.reset()
    try:
        for counts in SPLITS:
            x = torch.randn(20, 8, generator=generator).to(dtype)
            probs = torch.rand(20, generator=generator)
            eager, traced = _step(module, x, counts, probs), _step(compiled, x, counts, probs)
            for a, b in zip(eager, traced):
                assert torch.equal(a, b), counts
    finally:
        torch._dynamo.reset()
    assert counter.frame_count <= 1, f"{counter.frame_count} compilations for 8 splits"
    grouped_mm = [n for g in counter.graphs for n in g.graph.nodes if "grouped_mm" in str(n.target)]
    if kind == "grouped-gemm":  # the fast path is compiled (its activation fused), not eager
        assert counter.frame_count == 1 and len(grouped_mm) == 2
