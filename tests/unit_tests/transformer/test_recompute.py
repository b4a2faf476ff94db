"""Activation recomputation gives bitwise the gradients of the run without it (CPU), with
dropout on (one exception, stated and measured: "layernorm" recomputation of torch's RMSNorm,
equal up to the order of one floating-point sum): full ("uniform" / "block", several
``recompute_num_layers``) and selective ("core_attn", "mlp", "layernorm" and all three),
in one process and on 2/4 gloo ranks with tensor (sequence) / context / pipeline /
virtual-pipeline / data parallelism.

The dropout masks of the recomputation come from the RNG states the forward had (default
generator and the tracker's streams). Controls: with dropout on, a different seed changes the
gradients (the masks matter), and a recomputation that does not restore the RNG states
(monkeypatched) changes them too; "layernorm" recomputation really frees the norm's output
after the forward.
"""

import dataclasses
from typing import Dict

import pytest
import torch
import torch.distributed as dist

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.dist_utils import (
    Layout,
    assert_no_failures,
    rel_error,
    reset_layout,
    use_layout,
)

pytestmark = pytest.mark.timeout(300)

SETTINGS = {
    "full-uniform-1": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
    "full-uniform-2": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2
    ),
    "full-uniform-3": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3
    ),
    "full-block-1": dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=1
    ),
    "full-block-3": dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=3
    ),
    "selective-default": dict(recompute_granularity="selective"),
    "selective-mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
    "selective-layernorm": dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
    "selective-all": dict(
        recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"]
    ),
}
LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 4, 16, 4, 32, 16, 2


def _config(**overrides) -> TransformerConfig:
    base = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=32,
        hidden_dropout=0.2,
        attention_dropout=0.0,
        init_method_std=0.3,
    )
    base.update(overrides)
    return TransformerConfig(**base)


def _one_process_grads(config: TransformerConfig, seed: int = 3) -> Dict[str, torch.Tensor]:
    """Gradients of one forward/backward of a GPT (layer norm, learned positions) in train
    mode, the RNG streams seeded with ``seed``."""
    model = GPTModel(
        config, get_gpt_layer_local_spec(), VOCAB, SEQ, pg_collection=ProcessGroupCollection()
    )
    model.train()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    loss = model(tokens, positions, None, labels=labels).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["loss"] = loss.detach()
    return grads


def _differences(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]):
    return [n for n in want if not torch.equal(got[n], want[n])]


@pytest.mark.world(1)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_recompute_gradients_bitwise_equal_one_process(setting):
    reset_layout()
    baseline = _one_process_grads(_config())
    recomputed = _one_process_grads(_config(**SETTINGS[setting]))
    assert _differences(recomputed, baseline) == []


@pytest.mark.world(1)
def test_rmsnorm_layernorm_recompute_equal_up_to_the_order_of_one_sum():
    """torch's RMSNorm is decomposed by autograd (its input feeds two ops), so the norm's
    input gradient is a sum of three terms (residual, and the two inside the norm); with the
    norm recomputed the two inner ones are summed first. Floating-point addition is not
    associative: the result differs in the last bits (measured ~5e-7 relative), nothing
    more. LayerNorm is one autograd node, hence bitwise (the tests above)."""
    reset_layout()
    baseline = _one_process_grads(_config(normalization="RMSNorm"))
    setting = dict(SETTINGS["selective-layernorm"], normalization="RMSNorm")
    recomputed = _one_process_grads(_config(**setting))
    errors = {n: rel_error(recomputed[n], baseline[n]) for n in baseline}
    assert max(errors.values()) < 2e-6, errors
    full = _one_process_grads(_config(normalization="RMSNorm", **SETTINGS["full-uniform-2"]))
    assert _differences(full, baseline) == []  # whole layers: the same sums in the same order


@pytest.mark.world(1)
def test_controls_dropout_matters_and_rng_restore_is_needed(monkeypatch):
    reset_layout()
    baseline = _one_process_grads(_config())
    assert _differences(_one_process_grads(_config(), seed=4), baseline), "dropout inactive"
    monkeypatch.setattr(tp_random, "_set_all_rng_states", lambda states: None)
    for setting in ("full-uniform-2", "full-block-1"):
        broken = _one_process_grads(_config(**SETTINGS[setting]))
        assert _differences(broken, baseline), f"{setting}: RNG not restored went unnoticed"


@pytest.mark.world(1)
def test_layernorm_recompute_frees_the_norm_output():
    freed = []
    original = tensor_parallel.CheckpointWithoutOutput.discard_output_and_register_recompute

    def spy(self, hook_tensor):
        outputs = self.outputs
        original(self, hook_tensor)
        freed.extend(o.untyped_storage().size() for o in outputs)

    tensor_parallel.CheckpointWithoutOutput.discard_output_and_register_recompute = spy
    try:
        reset_layout()
        _one_process_grads(_config(**SETTINGS["selective-layernorm"]))
    finally:
        tensor_parallel.CheckpointWithoutOutput.discard_output_and_register_recompute = original
    assert len(freed) == 2 * LAYERS and all(size == 0 for size in freed)


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(recompute_method="uniform"), ValueError, "recompute_method='uniform' needs"),
        (dict(recompute_num_layers=2), ValueError, "recompute_num_layers=2 needs"),
        (dict(recompute_granularity="full"), ValueError, "recompute_method=None; with"),
        (
            dict(recompute_granularity="full", recompute_method="block"),
            ValueError,
            "recompute_num_layers=None; with recompute_granularity='full'",
        ),
        (
            dict(recompute_granularity="selective", recompute_method="block"),
            ValueError,
            "recompute_method='block' is only used with recompute_granularity='full'",
        ),
        (
            dict(recompute_granularity="selective", recompute_num_layers=1),
            ValueError,
            "recompute_num_layers must be None",
        ),
        (
            dict(recompute_granularity="selective", recompute_modules=["moe"]),
            ValueError,
            "entry 'moe' needs MoE",
        ),
        (
            dict(recompute_granularity="selective", recompute_modules=["attn"]),
            ValueError,
            "entry 'attn'; expected some of",
        ),
        (dict(recompute_granularity="partial"), ValueError, "expected 'full' or 'selective'"),
        (dict(distribute_saved_activations=True), NotImplementedError, "distribute_saved"),
    ],
)
def test_recompute_settings_checked(overrides, error, match):
    with pytest.raises(error, match=match):
        _config(**overrides)


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "method, step, count, spans",
    [
        ("uniform", 1, 3, [(0, 1, True), (1, 2, True), (2, 3, True)]),
        ("uniform", 3, 4, [(0, 3, True), (3, 4, True)]),
        ("uniform", 2, 1, [(0, 1, True)]),
        ("block", 2, 4, [(0, 1, True), (1, 2, True), (2, 4, False)]),
        ("block", 3, 2, [(0, 1, True), (1, 2, True)]),
        ("block", 1, 1, [(0, 1, True)]),
    ],
)
def test_full_recompute_spans(method, step, count, spans):
    """The runs of layers and which are checkpoints, written once for the decoder and the MTP
    depths; one plain run outside training, without autograd, or without "full"."""
    from megatron.core.transformer.transformer_block import full_recompute_spans

    full = dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=step)
    config = _config(**full)
    assert full_recompute_spans(config, True, count) == spans
    assert full_recompute_spans(config, False, count) == [(0, count, False)]
    with torch.no_grad():
        assert full_recompute_spans(config, True, count) == [(0, count, False)]
    selective = _config(recompute_granularity="selective")
    assert full_recompute_spans(selective, True, count) == [(0, count, False)]


@pytest.mark.world(1)
@pytest.mark.parametrize("method", ["uniform", "block"])
def test_full_recompute_checkpoints_the_decoder_and_each_mtp_depth(method, monkeypatch):
    """Two decoder layers and two MTP depths, ``recompute_num_layers=1``: one checkpoint per
    decoder layer ("uniform") or the first one ("block"), and one per MTP depth either way;
    none in eval mode."""
    from tests.unit_tests.models import test_multi_token_prediction as mtp_test

    calls = []
    original = tensor_parallel.checkpoint

    def spy(function, distribute, *args):
        calls.append(len(args))  # 1: a decoder run (hidden), 2: an MTP depth (hidden, embedded)
        return original(function, distribute, *args)

    monkeypatch.setattr(tensor_parallel, "checkpoint", spy)
    full = dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=1)
    config = mtp_test._config(**full)
    model = mtp_test._model(config, ProcessGroupCollection())
    rows = mtp_test.batch()
    model(rows["tokens"], None, labels=rows["labels"], loss_mask=rows["loss_mask"]).sum()
    assert sorted(calls) == ([1, 1] if method == "uniform" else [1]) + [2, 2]
    calls.clear()
    model.eval()
    model(rows["tokens"], None, labels=rows["labels"], loss_mask=rows["loss_mask"])
    assert calls == []


@pytest.mark.world(1)
def test_checkpoint_without_output_is_importable_with_megatron_semantics():
    """A norm checkpointed without output: the output's storage is freed after the discard and
    refilled when the hook tensor's gradient is computed; gradients equal the plain run."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(4)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    (lin(norm(x)) ** 2).sum().backward()
    want = [x.grad.clone(), norm.weight.grad.clone(), lin.weight.grad.clone()]
    for t in (x, norm.weight, lin.weight, norm.bias, lin.bias):
        t.grad = None
    ckpt = tensor_parallel.CheckpointWithoutOutput()
    out = ckpt.checkpoint(norm, x)
    y = lin(out)
    ckpt.discard_output_and_register_recompute(y)
    assert out.untyped_storage().size() == 0
    (y**2).sum().backward()
    got = [x.grad, norm.weight.grad, lin.weight.grad]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ----------------------------------------------------------------------------- distributed


def _layout_case(layout: Layout, setting: str, slow: bool = False):
    marks = [pytest.mark.world(layout.world)] + ([pytest.mark.slow] if slow else [])
    return pytest.param(layout, setting, marks=marks, id=f"{layout.id}-{setting}")


LAYOUT_CASES = [
    _layout_case(Layout(tp=2, sp=True), "full-uniform-2"),
    _layout_case(Layout(cp=2), "selective-all"),
    _layout_case(Layout(pp=2, vpp=2), "full-block-1"),
    _layout_case(Layout(tp=2, sp=True, cp=2), "selective-all", slow=True),
    _layout_case(Layout(tp=2, sp=True, pp=2), "full-uniform-1", slow=True),
    _layout_case(Layout(cp=2, pp=2, vpp=2), "full-block-1"),
    _layout_case(Layout(cp=2, dp=2), "selective-layernorm", slow=True),
    _layout_case(Layout(tp=2, pp=2), "full-block-3", slow=True),
    _layout_case(Layout(tp=2, sp=True, dp=2), "selective-mlp", slow=True),
]


def _arch_for(layout: Layout, setting: str) -> str:
    """llama-style (RMSNorm, SwiGLU, RoPE) with TP, except for "layernorm" recomputation,
    which is bitwise with LayerNorm only (see the RMSNorm test); gpt2-style otherwise."""
    norm_recompute = "layernorm" in SETTINGS[setting].get("recompute_modules", ())
    return "llama" if layout.tp > 1 and not norm_recompute else "gpt2"


def _parity_run(layout: Layout, overrides: dict, seed: int, monkeypatch, arch_name: str):
    """The GPT parity bucket's training (schedules, DDP, finalize; 3 SGD steps) with dropout
    0.2 and ``overrides``, the RNG streams seeded with ``seed``."""
    from tests.unit_tests.models import test_gpt_parity as parity

    original = parity.make_config

    def with_dropout(*args, **kwargs):
        config = original(*args, **kwargs)
        return dataclasses.replace(config, hidden_dropout=0.2, **overrides)

    monkeypatch.setattr(parity, "make_config", with_dropout)
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    steps = parity.distributed_training(layout, "averaged", parity.ARCHS[arch_name], groups)
    monkeypatch.setattr(parity, "make_config", original)
    return steps


def _step_differences(got, want, what: str):
    failures = []
    for step, ((grads, logged), (ref_grads, ref_logged)) in enumerate(zip(got, want)):
        for name, (grad, _) in grads.items():
            if not torch.equal(grad, ref_grads[name][0]):
                failures.append(f"step {step}: {name} differs with {what}")
        if logged != ref_logged:
            failures.append(f"step {step}: logged loss {logged} != {ref_logged}")
    return failures


@pytest.mark.parametrize("layout, setting", LAYOUT_CASES)
def test_recompute_bitwise_equal_at_the_same_layout(layout, setting, monkeypatch):
    """With and without ``setting``: every main_grad of every step bitwise equal."""
    arch = _arch_for(layout, setting)
    baseline = _parity_run(layout, {}, 5, monkeypatch, arch)
    recomputed = _parity_run(layout, SETTINGS[setting], 5, monkeypatch, arch)
    failures = _step_differences(recomputed, baseline, setting)
    reset_layout()
    assert_no_failures(failures)


@pytest.mark.world(2)
def test_control_dropout_is_active_in_the_distributed_runs(monkeypatch):
    """Another seed changes the gradients of the same run (the masks matter there)."""
    layout = Layout(tp=2, sp=True)
    baseline = _parity_run(layout, SETTINGS["full-uniform-2"], 5, monkeypatch, "llama")
    other = _parity_run(layout, SETTINGS["full-uniform-2"], 6, monkeypatch, "llama")
    differences = _step_differences(other, baseline, "another seed")
    reset_layout()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, len(differences))
    assert sum(everyone) > 0, "dropout had no effect: the bitwise comparison proves nothing"
