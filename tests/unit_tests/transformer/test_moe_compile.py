"""The routed experts under ``torch.compile`` (the trainer's ``--compile``): one compilation
whatever the split of the tokens over the experts, and the eager results.

The per-expert paths read the token counts on the host; traced, every new split (an expert
with 0 or 1 tokens in particular) recompiled the experts' forward until dynamo's recompile
limit. They now run eagerly inside the compiled layer (``_eager_if_counts_on_host``); the
grouped GEMM path (``torch._grouped_mm``, which runs on the CPU for these shapes) stays in the
graph. The routers of all layers share one compilation (their tracker filing is eager)."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import megatron.core.transformer.moe.experts as experts
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.lora import LoRAConfig, apply_lora

pytestmark = pytest.mark.world(1)
# 20 rows over 4 experts, split 8 ways (empty and one-row experts included)
SPLITS = [[3, 0, 9, 8], [1, 5, 7, 7], [0, 0, 10, 10], [6, 6, 4, 4], [1, 1, 1, 17],
          [20, 0, 0, 0], [0, 1, 0, 19], [5, 5, 5, 5]]  # fmt: skip


def _experts(kind: str, monkeypatch):
    """``kind``: sequential, grouped-loop or grouped-gemm, the latter with FP8 experts
    (``-fp8``) or LoRA adapters (``-lora``), both of which read the counts on the host."""
    dtype = torch.bfloat16 if kind.startswith("grouped-gemm") else torch.float32
    fp8 = dict(fp8="hybrid", fp8_recipe="tensorwise") if kind.endswith("-fp8") else {}
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4,
        moe_ffn_hidden_size=8, add_bias_linear=not fp8, gated_linear_unit=True, params_dtype=dtype,
        **fp8,
    )  # fmt: skip
    module = (experts.SequentialMLP if kind == "sequential" else experts.GroupedMLP)(4, config)
    assert (module.fp8_experts is not None) == bool(fp8)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    if kind.endswith("-lora"):
        holder = torch.nn.Module()
        holder.mlp = torch.nn.Module()
        holder.mlp.experts = module
        lora = LoRAConfig(dim=4, alpha=8.0, lora_B_init_method="xavier", seed=5, params_dtype=dtype)
        assert len(apply_lora(holder, lora)) == 8
    if kind.startswith("grouped-gemm"):
        monkeypatch.setattr(experts, "use_grouped_mm", lambda x, w: True)
    return module, dtype


def _step(module, x, counts, probs):
    """Outputs and the gradients of the inputs and parameters of sum(out * weights)."""
    x, probs = x.detach().requires_grad_(), probs.detach().requires_grad_()
    module.zero_grad()
    out, _ = module(x, torch.tensor(counts), probs)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype))
    grads = [p.grad.clone() for p in module.parameters() if p.requires_grad]
    return [out.detach(), x.grad, probs.grad] + grads


_SLOW = pytest.mark.slow  # the file cost ~3 s of the default run (measured): one case stays


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("sequential", marks=_SLOW),
        "grouped-loop",
        pytest.param("grouped-gemm", marks=_SLOW),
        pytest.param("grouped-gemm-fp8", marks=_SLOW),
        pytest.param("grouped-gemm-lora", marks=_SLOW),
    ],
)
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


def _moe_layer(kind: str, monkeypatch):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    dtype = torch.bfloat16 if kind == "grouped-gemm" else torch.float32
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4,
        moe_ffn_hidden_size=8, add_bias_linear=False, gated_linear_unit=True, params_dtype=dtype,
        moe_router_topk=2, moe_aux_loss_coeff=0.1,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=kind != "sequential")
    layer = build_module(spec.submodules.mlp, config=config, pg_collection=ProcessGroupCollection())
    layer.set_layer_number(1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        layer.router.weight.copy_(torch.eye(4, 8) * 4)  # token t goes where its x is largest
    if kind == "grouped-gemm":
        monkeypatch.setattr(experts, "use_grouped_mm", lambda x, w: True)
    return layer, dtype


def _routed_input(counts, dtype) -> torch.Tensor:
    """[5, 2, 8] hidden states whose top-2 experts give the tokens per expert ``counts``."""
    routes = [e for e, n in enumerate(counts) for _ in range(n)]
    generator = torch.Generator().manual_seed(sum(i * n for i, n in enumerate(counts)))
    x = torch.rand(10, 8, generator=generator) * 0.1
    for t in range(10):  # token t: routes t and t + 10 of the expert-sorted list (distinct)
        x[t, routes[t]] += 1.0 + torch.rand((), generator=generator)
        x[t, routes[t + 10]] += 1.0 + torch.rand((), generator=generator)
    return x.view(5, 2, 8).to(dtype)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sequential", "grouped-loop", "grouped-gemm"])
def test_the_moe_layer_compiles_once_whatever_the_routing(kind, monkeypatch):
    """The whole MoE layer (router, dispatcher, experts) under ``torch.compile``: splits with
    empty and one-token experts add no compilation after the first step, and every output
    and gradient equals the eager layer's."""
    from megatron.core.transformer.moe import moe_utils

    layer, dtype = _moe_layer(kind, monkeypatch)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter)

    def step(module, x):
        x = x.detach().requires_grad_()
        layer.zero_grad()
        out, _ = module(x)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype))
        moe_utils.clear_aux_losses_tracker()
        return [out.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]

    splits = [[5, 5, 5, 5], [10, 9, 1, 0], [0, 10, 10, 0], [1, 1, 9, 9], [10, 0, 1, 9]]
    frames = []
    torch._dynamo.reset()
    try:
        for counts in splits:
            x = _routed_input(counts, dtype)
            assert layer.router(x)[1].sum(0).tolist() == counts  # the routing asked for
            for a, b in zip(step(layer, x), step(compiled, x)):
                assert torch.equal(a, b), counts
            frames.append(counter.frame_count)
    finally:
        torch._dynamo.reset()
        moe_utils.clear_aux_losses_tracker()
    assert frames[-1] <= frames[0] + 1, f"compilations after each split: {frames}"


class _Routed(torch.nn.Module):
    """A router and its deferred losses attached to the probabilities (as ``MoELayer``)."""

    def __init__(self, router):
        super().__init__()
        self.router = router

    def forward(self, x):
        probs, _ = self.router(x)
        return self.router.attach_deferred_losses(probs)


@pytest.mark.parametrize(
    "deferred, kinds, coeffs",
    [
        (True, "aux_loss", 0.1),  # the MoE layer's path
        pytest.param(
            False, ["aux_loss", "seq_aux_loss"], [0.1, 0.01], marks=pytest.mark.slow
        ),  # the router's own (``routing``)
    ],
)
def test_the_routers_of_all_layers_share_one_compilation_with_the_eager_metrics(
    deferred, kinds, coeffs
):
    """Routers of layers 1-3 (load-balancing and z losses), each compiled as the trainer
    compiles its layers: the first layer's compilations serve the others (dynamo guarded on
    the layer number and on the tracker's entries: each layer recompiled), and the tracked
    losses and counts and every gradient equal the eager routers' bit for bit."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    config = TransformerConfig(
        num_layers=3, hidden_size=8, num_attention_heads=2, num_moe_experts=4,
        moe_router_topk=2, moe_router_load_balancing_type=kinds, moe_aux_loss_coeff=coeffs,
        moe_z_loss_coeff=0.001, add_bias_linear=False,
    )  # fmt: skip
    layers = []
    for number in (1, 2, 3):
        torch.manual_seed(number)
        router = TopKRouter(config)
        router.set_layer_number(number)
        router.defer_router_losses = deferred
        layers.append(_Routed(router))
    x = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(0))

    counter = CompileCounterWithBackend("aot_eager")

    def step(modules):
        moe_utils.reset_aux_losses_tracker()
        results, frames = [], []
        for module in modules:
            xi = x.detach().requires_grad_()
            module.zero_grad()
            out = module(xi)
            out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
            results += [out.detach(), xi.grad, module.router.weight.grad.clone()]
            frames.append(counter.frame_count)
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        return results + [tracker[name]["values"].clone() for name in sorted(tracker)], frames

    compiled = [torch.compile(layer, backend=counter) for layer in layers]
    torch._dynamo.reset()
    try:
        eager, _ = step(layers)
        losses = 2 + isinstance(kinds, list)  # load balancing, z (and sequence load balancing)
        assert len(eager) == 9 + 1 + losses  # and tokens_per_expert
        traced, frames = step(compiled)
        assert frames[0] == frames[-1], f"compilations after each layer: {frames}"
        for i, (a, b) in enumerate(zip(eager, traced)):
            assert torch.equal(a, b), i
    finally:
        torch._dynamo.reset()
        moe_utils.reset_aux_losses_tracker()
