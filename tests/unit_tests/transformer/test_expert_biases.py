"""Experts with biases (``add_bias_linear``, GPT-OSS) and the clamped, offset gated unit in
``SequentialMLP`` and ``GroupedMLP`` (its loop and its grouped GEMM path) against an explicit
float64 formula: y = p (act(clamp(gate, max=L)) (clamp(up, -L, L) + 1) W2^T + b2) with
[gate | up] = x W1^T + b1, act = quick_gelu."""

import pytest
import torch

import megatron.core.transformer.moe.experts as experts
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer import TransformerConfig

pytestmark = pytest.mark.world(1)
COUNTS = [3, 0, 9, 8]


def _config(dtype) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
        moe_ffn_hidden_size=16, add_bias_linear=True, gated_linear_unit=True,
        activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=0.5,
        params_dtype=dtype,
    )  # fmt: skip


def _filled(module):
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return module


def _reference(module, x, probs) -> torch.Tensor:
    rows, start = [], 0
    for i, count in enumerate(COUNTS):
        xi, pi = x[start : start + count].double(), probs[start : start + count].double()
        w1, w2 = (module.local_expert_weight(i, p).double() for p in ("linear_fc1", "linear_fc2"))
        b1, b2 = (module.local_expert_bias(i, p).double() for p in ("linear_fc1", "linear_fc2"))
        gate, up = (xi @ w1.t() + b1).chunk(2, dim=-1)
        unit = quick_gelu(gate.clamp(max=0.5)) * (up.clamp(-0.5, 0.5) + 1.0)
        rows.append(pi[:, None] * (unit @ w2.t() + b2))
        start += count
    return torch.cat(rows)


@pytest.mark.parametrize("kind", ["sequential", "grouped-loop", "grouped-gemm"])
def test_expert_biases_and_the_clamped_unit_match_the_formula(kind, monkeypatch):
    dtype = torch.bfloat16 if kind == "grouped-gemm" else torch.float32
    config = _config(dtype)
    module = (
        experts.SequentialMLP(4, config) if kind == "sequential" else experts.GroupedMLP(4, config)
    )
    _filled(module)
    if kind == "grouped-gemm":  # torch._grouped_mm runs on the CPU for these shapes
        monkeypatch.setattr(experts, "use_grouped_mm", lambda x, w: True)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(sum(COUNTS), 16, generator=generator).to(dtype)
    probs = torch.rand(sum(COUNTS), generator=generator)
    out, _ = module(x, torch.tensor(COUNTS), probs)
    expected = _reference(module, x, probs)
    error = ((out.double() - expected).norm() / expected.norm()).item()
    assert error <= (2e-2 if dtype == torch.bfloat16 else 1e-6), error
    without = _reference(module, x, probs) - probs.double()[:, None] * torch.cat(
        [module.local_expert_bias(i, "linear_fc2").double().expand(n, -1) for i, n in
         enumerate(COUNTS)]
    )  # fmt: skip
    assert ((out.double() - without).norm() / expected.norm()).item() > 0.05  # b2 matters


@pytest.mark.parametrize("kind", ["sequential", "grouped-loop"])
def test_the_lora_adapted_forward_keeps_the_expert_biases(kind):
    """The forward of experts with LoRA adapters (``adapted_forward``, expert LoRA) adds the
    expert biases too: with adapters contributing zero it equals the formula (it dropped
    b1 and b2 when expert LoRA met GPT-OSS's biased experts)."""
    config = _config(torch.float64)
    module = (
        experts.SequentialMLP(4, config) if kind == "sequential" else experts.GroupedMLP(4, config)
    )
    _filled(module)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(sum(COUNTS), 16, generator=generator, dtype=torch.float64)
    probs = torch.rand(sum(COUNTS), generator=generator, dtype=torch.float64)
    adapters = {
        "linear_fc1": lambda rows, sizes: rows.new_zeros(rows.shape[0], 32),
        "linear_fc2": lambda rows, sizes: rows.new_zeros(rows.shape[0], 16),
    }
    expected = _reference(module, x, probs)
    for chosen in ({}, adapters):
        out, _ = module.adapted_forward(x, torch.tensor(COUNTS), probs, chosen)
        assert ((out - expected).norm() / expected.norm()).item() <= 1e-12
