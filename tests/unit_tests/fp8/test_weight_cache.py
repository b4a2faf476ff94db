"""A step's FP8 weights kept across its microbatches (``megatron.core.fp8.cache``): a step with
the cache gives bitwise the gradients of a step without it, at a GPT (dense FP8 linears) and a
model with FP8 experts (``SequentialMLP``, ``GroupedMLP``), over several optimizer steps; each
weight's amax is taken once per step, not once per microbatch; every refresh (the schedule's
``set_is_first_microbatch``, the optimizer-step hook, the eager version check) alone keeps the
steps bitwise, and without any the second step differs (negative control)."""

from typing import NamedTuple, Optional, Tuple

import pytest
import torch
from torch.nn import Parameter

import megatron.core.fp8.cache as cache
from megatron.core.fp8 import scaling
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe import experts
from tests.unit_tests.transformer.test_mixed_precision import _one_process_step

pytestmark = pytest.mark.world(1)

FP8 = dict(fp8="hybrid", fp8_recipe="tensorwise")
COUNTS = (5, 0, 7)  # tokens per expert (one expert gets none)
MICROBATCHES = 4


def _uncached(monkeypatch) -> None:
    """The schedules never set ``is_first_microbatch``: every call casts its weights."""
    monkeypatch.setattr(schedules, "_set_is_first_microbatch", lambda model: None)


def _count_weight_amaxes(monkeypatch) -> list:
    """Patch ``scaling.local_amax``: the list gets an entry per amax of a weight (a parameter
    or a view of one, as the grouped experts' weights are)."""
    calls, amax = [], scaling.local_amax

    def counting(tensor):
        if isinstance(tensor, Parameter) or isinstance(tensor._base, Parameter):
            calls.append(tuple(tensor.shape))
        return amax(tensor)

    monkeypatch.setattr(scaling, "local_amax", counting)
    return calls


def _gpt_step(**changes):
    grads, gpt = _one_process_step("llama", bf16=False, **FP8, **changes)
    return {name: grad.clone() for name, grad in grads.items()}, gpt


def test_a_cached_gpt_step_is_bitwise_the_uncached_step(monkeypatch):
    cached, gpt = _gpt_step()
    fp8_linears = [m for m in gpt.modules() if getattr(m, "fp8_gemm", None) is not None]
    assert len(fp8_linears) == 16 and all(m.fp8_weight_cache is not None for m in fp8_linears)
    _uncached(monkeypatch)
    plain, gpt = _gpt_step()
    assert all(getattr(m, "fp8_weight_cache", None) is None for m in gpt.modules())
    assert all(torch.equal(cached[name], plain[name]) for name in plain), "cache changed a grad"


@pytest.mark.parametrize("cached", [True, False])
def test_each_weight_amax_once_per_step_with_the_cache(cached, monkeypatch):
    """16 FP8 weights (4 layers x qkv, proj, fc1, fc2), 4 microbatches: 16 weight amaxes
    per step with the cache, 64 without (the original code)."""
    if not cached:
        _uncached(monkeypatch)
    calls = _count_weight_amaxes(monkeypatch)
    _gpt_step()
    assert len(calls) == (16 if cached else 16 * MICROBATCHES), calls


# ----------------------------------------------------------------------------- experts


class Shape(NamedTuple):
    """The experts model's sizes: hidden, the linears' width, the experts' width, tokens per
    expert."""

    hidden: int = 16
    ffn: int = 24
    expert_ffn: int = 8
    counts: Tuple[int, ...] = COUNTS


SHAPE = Shape()


class _Model(MegatronModule):
    """An FP8 column- and row-parallel linear, then FP8 experts (sequential or grouped), in
    ``dtype`` on ``device``; ``bias``: fc1's (a compiled bias-gradient sum may add in another
    order: none where inductor compiles)."""

    def __init__(
        self,
        grouped: bool,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        shape: Shape = SHAPE,
        bias: bool = True,
    ) -> None:
        config = TransformerConfig(
            num_layers=1, hidden_size=shape.hidden, num_attention_heads=2, num_moe_experts=3,
            moe_ffn_hidden_size=shape.expert_ffn, add_bias_linear=False, gated_linear_unit=True,
            params_dtype=dtype, use_cpu_initialization=True, **FP8,
        )  # fmt: skip
        super().__init__(config)
        self.shape = shape
        torch.manual_seed(0)
        init = lambda weight: torch.nn.init.normal_(weight, std=0.3)  # noqa: E731
        hidden, ffn = shape.hidden, shape.ffn
        self.fc1 = ColumnParallelLinear(hidden, ffn, config=config, init_method=init, bias=bias)
        self.fc2 = RowParallelLinear(
            ffn, hidden, config=config, init_method=init, bias=False, input_is_parallel=True,
            skip_bias_add=False,
        )  # fmt: skip
        kind = experts.GroupedMLP if grouped else experts.SequentialMLP
        self.experts = kind(3, config)
        with torch.no_grad():
            for param in self.experts.parameters():
                param.copy_(torch.randn(param.shape) * 0.3)
        self.to(device)

    def set_input_tensor(self, tensor) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)
        h, _ = self.fc2(torch.tanh(h))
        probs = torch.sigmoid(h[:, 0])
        out, _ = self.experts(h, torch.tensor(self.shape.counts), probs)
        return out


def _microbatches(step: int, model: Optional[_Model] = None) -> list:
    """The step's microbatches, [tokens, hidden] in ``model``'s dtype, on its device."""
    shape = SHAPE if model is None else model.shape
    like = torch.empty(()) if model is None else model.fc2.weight
    generator = torch.Generator().manual_seed(step)
    rows = sum(shape.counts)
    return [
        torch.randn(rows, shape.hidden, generator=generator).to(like) for _ in range(MICROBATCHES)
    ]


def _forward_step(data_iterator, model):
    out = model(next(data_iterator))
    return out, lambda output: (output.float().square().mean(), {})


def _train(grouped: bool, steps: int = 2, **options) -> list:
    """Per step: every parameter's gradient, and the parameters after the SGD step;
    ``options``: ``_Model``'s."""
    model = _Model(grouped, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace = []
    for step in range(steps):
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=iter(_microbatches(step, model)),
            model=model,
            num_microbatches=MICROBATCHES,
            seq_length=sum(model.shape.counts),
            micro_batch_size=1,
        )
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        trace.append((grads, [p.detach().clone() for p in model.parameters()]))
    return trace


def _equal(a: list, b: list) -> bool:
    return all(
        torch.equal(x, y) for (ga, pa), (gb, pb) in zip(a, b) for x, y in zip(ga + pa, gb + pb)
    )


REFRESHES = ["all", "schedule", "optimizer hook", "version", "none"]


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
@pytest.mark.parametrize("refresh", REFRESHES)
def test_cached_steps_are_bitwise_the_uncached_ones(refresh, grouped, monkeypatch):
    """Two SGD steps of 4 microbatches. ``refresh``: the one way the cache is refilled after
    the optimizer step (all of them; "none": the negative control, a stale second step)."""
    with monkeypatch.context() as patch:
        _uncached(patch)
        plain = _train(grouped)
    if refresh not in ("all", "schedule"):  # caching turned on once, at the first step
        monkeypatch.setattr(schedules, "_set_is_first_microbatch", _only_once())
    if refresh not in ("all", "optimizer hook"):
        monkeypatch.setattr(cache, "mark_stale", lambda module: None)
    if refresh not in ("all", "version"):
        monkeypatch.setattr(cache, "_moved", lambda module, weights: False)
    cached = _train(grouped)
    assert _equal(cached[:1], plain[:1]), "the first step changed"
    if refresh == "none":
        assert not _equal(cached, plain), "a stale cache left the second step unchanged"
    else:
        assert _equal(cached, plain), f"refreshing by {refresh} changed the second step"


def _only_once():
    """``schedules._set_is_first_microbatch`` that acts on its first call only."""
    first, done = schedules._set_is_first_microbatch, []

    def once(model) -> None:
        if not done:
            done.append(first(model))

    return once


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
def test_expert_weight_amaxes_once_per_step(grouped, monkeypatch):
    model = _Model(grouped)
    calls = _count_weight_amaxes(monkeypatch)
    model.set_is_first_microbatch()
    for x in _microbatches(0):
        model(x).sum().backward()
    weights = 2 + 2 * 3  # fc1, fc2, then W1 and W2 of 3 experts
    assert len(calls) == weights, calls


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
def test_the_experts_cache_fill_reduces_its_amaxes_in_one_collective(grouped, monkeypatch):
    """Filling the experts' cache MAX-reduces fc1's and fc2's weight amaxes together: one
    ``reduce_amax`` more than a microbatch that reads the cache (the experts' alone)."""
    model = _Model(grouped)
    x = _microbatches(0)[0]
    with torch.no_grad():
        model(x)  # fc1, fc2 of the model (dense FP8 linears) cast once, uncached
    calls, reduce = [], scaling.reduce_amax
    monkeypatch.setattr(scaling, "reduce_amax", lambda *a: calls.append(a) or reduce(*a))
    counts = []
    for first in (True, False):
        model.experts.is_first_microbatch = first
        calls.clear()
        with torch.no_grad():
            model.experts(x, torch.tensor(COUNTS), torch.ones(sum(COUNTS)))
        counts.append(len(calls))
    assert counts[0] - counts[1] == 1, counts


def test_set_is_first_microbatch_only_with_fp8():
    model = _Model(grouped=True)
    model.config.fp8 = None
    model.set_is_first_microbatch()
    assert model.fc1.is_first_microbatch is None and model.experts.is_first_microbatch is None
    model.config.fp8 = "hybrid"
    model.set_is_first_microbatch()
    assert model.fc1.is_first_microbatch is True and model.experts.is_first_microbatch is True
    model(_microbatches(0)[0])
    assert model.fc1.is_first_microbatch is False and model.experts.is_first_microbatch is False


def test_load_state_dict_refills_the_cache():
    model = _Model(grouped=False)
    model.set_is_first_microbatch()
    x = _microbatches(0)[0]
    model(x)
    state = {k: v * 2 if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert model.fc1.is_first_microbatch is True and model.experts.is_first_microbatch is True


def _compiled_against_uncached(
    monkeypatch, steps: int, backend: str = "aot_eager", **options
) -> int:
    """Train with the FP8 linears traced whole (``fullgraph=True``; ``backend`` "aot_eager",
    or inductor on a GPU: the trainer's ``--compile`` traces them into the layer graphs), the
    grouped experts eager; assert the steps are bitwise the eager uncached ones; return how
    many graphs were compiled. ``options``: ``_Model``'s."""
    import torch._dynamo.testing

    with monkeypatch.context() as patch:
        _uncached(patch)
        plain = _train(True, steps, **options)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    build = _Model.__init__

    def compiled(self, grouped, **kwargs):
        build(self, grouped, **kwargs)
        for linear in (self.fc1, self.fc2):
            linear.compile(backend=counter, fullgraph=True)

    monkeypatch.setattr(_Model, "__init__", compiled)
    try:
        traced = _train(True, steps, **options)
    finally:
        torch._dynamo.reset()
    assert _equal(traced, plain), "the compiled steps differ from the eager uncached ones"
    return counter.frame_count


@pytest.mark.slow
def test_compiled_cached_steps_are_bitwise_the_eager_uncached_ones(monkeypatch):
    """The cache under compile (``CACHE_WHEN_COMPILED``, the default): no graph break, 2
    graphs per linear (fill, reuse) over 3 steps, the steps bitwise the eager uncached ones."""
    assert cache.CACHE_WHEN_COMPILED
    assert _compiled_against_uncached(monkeypatch, steps=3) == 4


@pytest.mark.slow
def test_a_compiled_linear_without_the_cache_casts_its_weight_at_every_call(monkeypatch):
    """``CACHE_WHEN_COMPILED`` False: traced, the linears do not use the cache (one graph
    per linear, no fill/reuse variants); the steps bitwise the eager uncached ones."""
    monkeypatch.setattr(cache, "CACHE_WHEN_COMPILED", False)
    assert _compiled_against_uncached(monkeypatch, steps=2) == 2  # 4 with the cache


@pytest.mark.parametrize("write", ["in place", "new storage"])
def test_an_eager_call_refills_after_a_weight_write(write):
    """No optimizer, no flag: a weight written in place (its ``_version``) or given new
    storage (``.data =``, which no version counter records) is cast again."""
    model = _Model(grouped=True)
    model.set_is_first_microbatch()
    x = _microbatches(0)[0]
    model(x)
    with torch.no_grad():
        if write == "in place":
            model.fc2.weight.mul_(3)
            model.experts.weight1.mul_(3)
        else:
            model.fc2.weight.data = model.fc2.weight.data * 3
            model.experts.weight1.data = model.experts.weight1.data * 3
    got = model(x)
    for module in (model.fc1, model.fc2, model.experts):
        module.is_first_microbatch = None
    assert torch.equal(got, model(x))


@pytest.mark.parametrize(
    "first_val_step, forward_only", [(False, True), (True, True), (False, False)]
)
def test_first_val_step_decides_in_forward_only_runs(first_val_step, forward_only):
    """megatron-core's ``check_first_val_step``: a forward-only run with ``first_val_step``
    False does not set ``is_first_microbatch`` (a training run always does)."""
    model = _Model(grouped=False)
    get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(_microbatches(0)),
        model=model,
        num_microbatches=MICROBATCHES,
        seq_length=sum(COUNTS),
        micro_batch_size=1,
        forward_only=forward_only,
        first_val_step=first_val_step,
    )
    set_once = first_val_step or not forward_only
    assert model.fc1.is_first_microbatch is (False if set_once else None)


# ----------------------------------------------------------------------------- compiled casts


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "shape-specialized"])
def test_the_compiled_casts_of_a_training_run_fit_dynamos_recompile_limit(dynamic, monkeypatch):
    """The casts compiled on CUDA (``scaling.operands``), run here on the CPU through dynamo
    (its eager backend, counting graphs): two iterations of the trainer's FP8 GPT compile 4
    graphs of the cast function (the structural variants), under dynamo's limit of 8 per
    function past which every new signature would run eagerly. Shape-specialized first
    graphs (``jit_fuser``'s default, the negative control) take 7 of the 8."""
    import torch._dynamo.testing

    from megatron.core import jit
    from megatron.training.cli import main

    counter = torch._dynamo.testing.CompileCounter()
    compile_ = torch.compile

    def counting(fn, dynamic=None):
        return compile_(fn, backend=counter, dynamic=dynamic)

    monkeypatch.setattr(torch, "compile", counting)
    monkeypatch.setattr(scaling, "_compiled_here", lambda t: not torch.compiler.is_compiling())
    fused = jit.jit_fuser(scaling._operands, dynamic=dynamic)
    monkeypatch.setattr(scaling, "_fused_operands", fused)
    torch._dynamo.reset()
    try:
        assert main(["--train-iters", "2", "--fp8-format", "hybrid", "--fp8-recipe",
                     "tensorwise", "--num-layers", "2", "--hidden-size", "64",
                     "--num-attention-heads", "4"]) == 0  # fmt: skip
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == (4 if dynamic else 7), counter.frame_count
