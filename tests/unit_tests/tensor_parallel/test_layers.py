"""Tensor-parallel layers against the dense float64 computation, at TP = 2 and 4 (the whole
world is the TP group), with sequence parallelism on and off.

* Column -> GeLU -> Row (an MLP): outputs, input gradient, and every weight gradient is the
  slice of the dense weight gradient (and, with gradient_accumulation_fusion, main_grad is).
* VocabParallelEmbedding: the dense lookup (reduced, or reduce-scattered to [s/T, b, h]).
* Rule 5: layers handed an explicit TP group that differs from parallel_state's (TP = 1
  there) compute the dense result; a layer whose collectives read parallel_state instead
  gets a wrong answer (negative control).
* Layout-independent initialization: the shard is the slice of the same full weight.
* Bad input: sizes not divisible by T, sequence not divisible by T under SP.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    layers,
    mappings,
    scatter_to_sequence_parallel_region,
)
from tests.unit_tests.dist_utils import WORLD_SIZE, assert_no_failures, rel_error, reset_layout
from tests.unit_tests.tensor_parallel.tp_reference import (
    TOL,
    block,
    full_weight,
    on_device,
    seeded,
    world_group,
)

pytestmark = [pytest.mark.world(2, 4), pytest.mark.timeout(120)]

S, B, H, F_ = 8, 2, 6, 8  # sequence, batch, hidden, ffn (all divisible by 2 and 4)


def _config(sp: bool, fused: bool = False, tp: int = WORLD_SIZE) -> ModelParallelConfig:
    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        params_dtype=torch.float64,
        gradient_accumulation_fusion=fused,
    )


def _mlp(config, group, seed=0):
    """Column(H -> F_, bias) and Row(F_ -> H, bias), weights from seeds seed and seed+1."""
    torch.manual_seed(seed)
    fc1 = ColumnParallelLinear(
        H, F_, config=config, init_method=torch.nn.init.normal_, bias=True, tp_group=group
    )
    torch.manual_seed(seed + 1)
    fc2 = RowParallelLinear(
        F_,
        H,
        config=config,
        init_method=torch.nn.init.normal_,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        tp_group=group,
    )
    with torch.no_grad():  # non-zero biases, the same on every rank
        fc1.bias.copy_(block(seeded(F_, 10), 0, _rank(group), _size(group)))
        fc2.bias.copy_(seeded(H, 11))
    return fc1, fc2


def _dense_mlp(x, seed=0):
    """Reference: gelu(x W1^T + b1) W2^T + b2 on full float64 tensors; returns the output
    and the leaves (x, W1, b1, W2, b2) with gradients enabled."""
    w1 = full_weight((F_, H), seed).requires_grad_()
    w2 = full_weight((H, F_), seed + 1).requires_grad_()
    b1, b2 = seeded(F_, 10).requires_grad_(), seeded(H, 11).requires_grad_()
    x = x.clone().requires_grad_()
    out = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    return out, (x, w1, b1, w2, b2)


def _rank(group):
    return dist.get_rank(group=group)


def _size(group):
    return dist.get_world_size(group=group)


def _run_mlp(config, group, fused=False):
    """Ours vs dense; returns failure messages."""
    tp, rank = _size(group), _rank(group)
    sp = config.sequence_parallel
    x_full, g_full = seeded((S, B, H), 1), seeded((S, B, H), 2)
    fc1, fc2 = _mlp(config, group)
    if fused:
        for layer in (fc1, fc2):
            layer.weight.main_grad = torch.zeros_like(layer.weight)
    x = on_device(block(x_full, 0, rank, tp) if sp else x_full).requires_grad_()
    hidden, _ = fc1(x)
    out, _ = fc2(F.gelu(hidden))
    out.backward(on_device(block(g_full, 0, rank, tp) if sp else g_full))

    ref_out, (rx, w1, b1, w2, b2) = _dense_mlp(x_full)
    ref_out.backward(g_full)
    wgrad1 = fc1.weight.main_grad if fused else fc1.weight.grad
    wgrad2 = fc2.weight.main_grad if fused else fc2.weight.grad
    bias2_grad = fc2.bias.grad.clone()
    if sp:  # replicated bias fed sequence shards: the TP sum is the dense gradient (rule 3)
        dist.all_reduce(bias2_grad, group=group)
    checks = {
        "output": (out, block(ref_out, 0, rank, tp) if sp else ref_out),
        "input grad": (x.grad, block(rx.grad, 0, rank, tp) if sp else rx.grad),
        "fc1 weight grad": (wgrad1, block(w1.grad, 0, rank, tp)),
        "fc1 bias grad": (fc1.bias.grad, block(b1.grad, 0, rank, tp)),
        "fc2 weight grad": (wgrad2, block(w2.grad, 1, rank, tp)),
        "fc2 bias grad (summed over TP)": (bias2_grad, b2.grad),
    }
    failures = [
        f"{name}: rel error {rel_error(a, e):.2e}"
        for name, (a, e) in checks.items()
        if not rel_error(a, e) <= TOL
    ]
    if fc2.bias.sequence_parallel != sp:
        failures.append(f"fc2.bias.sequence_parallel={fc2.bias.sequence_parallel}, expected {sp}")
    return failures


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_column_row_mlp_equals_dense(sp, fused):
    group = world_group()[0]
    assert_no_failures(_run_mlp(_config(sp, fused), group, fused))


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_frozen_weight_gets_no_gradient_and_input_grad_is_dense(sp):
    """A weight with requires_grad=False: no weight gradient, input gradient unchanged."""
    group, tp, rank = world_group()
    fc1, fc2 = _mlp(_config(sp), group)
    fc1.weight.requires_grad_(False)
    x_full, g_full = seeded((S, B, H), 1), seeded((S, B, H), 2)
    local = (lambda t: block(t, 0, rank, tp)) if sp else (lambda t: t)
    x = on_device(local(x_full)).requires_grad_()
    out, _ = fc2(F.gelu(fc1(x)[0]))
    out.backward(on_device(local(g_full)))
    ref_out, (rx, *_) = _dense_mlp(x_full)
    ref_out.backward(g_full)
    failures = [] if fc1.weight.grad is None else ["frozen weight got a gradient"]
    if not rel_error(x.grad, local(rx.grad)) <= TOL:
        failures.append(f"input grad rel error {rel_error(x.grad, local(rx.grad)):.2e}")
    assert_no_failures(failures)


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_mpu_fallback_uses_parallel_state_tp_group(sp):
    """tp_group=None: the layers take parallel_state's TP group (here the whole world)."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD_SIZE)
    try:
        fc1, _ = _mlp(_config(sp), None)
        assert fc1.tp_group is parallel_state.get_tensor_model_parallel_group()
        assert_no_failures(_run_mlp(_config(sp), None))
    finally:
        reset_layout()


def test_gather_output_and_skip_bias_add():
    """gather_output returns the full [s, b, F_] output; skip_bias_add returns the bias."""
    group, tp, rank = world_group()
    torch.manual_seed(0)
    fc = ColumnParallelLinear(
        H,
        F_,
        config=_config(False),
        init_method=torch.nn.init.normal_,
        gather_output=True,
        skip_bias_add=True,
        tp_group=group,
    )
    x = seeded((S, B, H), 1)
    out, bias = fc(on_device(x))
    expected = F.linear(x, full_weight((F_, H), 0))
    failures = [] if rel_error(out, expected) <= TOL else ["gathered output differs"]
    if bias is not fc.bias:
        failures.append("skip_bias_add did not return the bias")
    assert_no_failures(failures)


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_vocab_parallel_embedding_equals_dense(sp):
    group, tp, rank = world_group()
    vocab = 4 * tp
    torch.manual_seed(3)
    emb = VocabParallelEmbedding(
        vocab,
        H,
        init_method=torch.nn.init.normal_,
        reduce_scatter_embeddings=sp,
        config=_config(sp),
        tp_group=group,
    )
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(4))
    g_full = seeded((S, B, H), 5)
    out = emb(on_device(ids))
    out.backward(on_device(block(g_full, 0, rank, tp) if sp else g_full.transpose(0, 1)))

    weight = full_weight((vocab, H), 3).requires_grad_()
    ref = F.embedding(ids, weight).transpose(0, 1)  # [s, b, h]
    ref.backward(g_full)
    expected_out = block(ref, 0, rank, tp) if sp else ref.transpose(0, 1)
    failures = []
    if not rel_error(out, expected_out) <= TOL:
        failures.append(f"output rel error {rel_error(out, expected_out):.2e}")
    if not rel_error(emb.weight.grad, block(weight.grad, 0, rank, tp)) <= TOL:
        failures.append("weight grad differs from the slice of the dense gradient")
    assert_no_failures(failures)


@pytest.mark.parametrize("stride", [1, 2], ids=["stride1", "stride2"])
def test_initialization_is_the_slice_of_one_full_weight(stride):
    """The shard equals blocks r, r+T, ... of the full weight init_method builds, for every
    T (a 1-rank layer's weight is the full weight itself)."""
    group, tp, rank = world_group()
    torch.manual_seed(7)
    one = ColumnParallelLinear(
        H, F_, config=_config(False, tp=1), init_method=torch.nn.init.normal_, stride=stride
    )
    torch.manual_seed(7)
    sharded = ColumnParallelLinear(
        H,
        F_,
        config=_config(False),
        init_method=torch.nn.init.normal_,
        stride=stride,
        tp_group=group,
    )
    pieces = one.weight.detach().chunk(tp * stride, dim=0)[rank::tp]
    expected = torch.cat(pieces, dim=0)
    assert_no_failures([] if torch.equal(sharded.weight.detach(), expected) else ["shard"])
    assert (sharded.weight.partition_dim, sharded.weight.partition_stride) == (0, stride)


# ---------------------------------------------------------------------------------------------
# Rule 5: the group handed to the module is the one every collective uses.
# ---------------------------------------------------------------------------------------------

_PAIR_GROUPS = {}


def _pair_group():
    """2-rank groups [0,1], [2,3], ... (created once; every rank creates every group)."""
    if WORLD_SIZE not in _PAIR_GROUPS:
        groups = [dist.new_group([r, r + 1]) for r in range(0, WORLD_SIZE, 2)]
        _PAIR_GROUPS[WORLD_SIZE] = groups[dist.get_rank() // 2]
    return _PAIR_GROUPS[WORLD_SIZE]


def _with_tp1_parallel_state(body):
    """Run ``body`` with parallel_state initialized at TP = 1 (its TP group differs from the
    explicit 2-rank group)."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        assert parallel_state.get_tensor_model_parallel_world_size() == 1
        return body()
    finally:
        reset_layout()


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_explicit_group_wins_over_parallel_state(sp):
    failures = _with_tp1_parallel_state(lambda: _run_mlp(_config(sp, tp=2), _pair_group()))
    assert_no_failures(failures)


def test_negative_control_layer_reading_parallel_state_is_wrong(monkeypatch):
    """A RowParallelLinear whose reduction drops its group (reads parallel_state at call
    time, TP = 1 there) no longer matches the dense result."""

    def reduce_ignoring_group(input_, group=None):
        return mappings.reduce_from_tensor_model_parallel_region(input_)

    monkeypatch.setattr(layers, "reduce_from_tensor_model_parallel_region", reduce_ignoring_group)
    failures = _with_tp1_parallel_state(lambda: _run_mlp(_config(False, tp=2), _pair_group()))
    everyone = [None] * WORLD_SIZE
    dist.all_gather_object(everyone, failures)
    assert all(any("output" in f for f in fails) for fails in everyone), everyone


# ---------------------------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------------------------


def test_sizes_not_divisible_by_tp_raise_clear_errors():
    group, tp, _ = world_group()
    config = _config(False)
    init = torch.nn.init.normal_
    with pytest.raises(ValueError, match=rf"output_size={F_ + 1} must be divisible .*\({tp}\)"):
        ColumnParallelLinear(H, F_ + 1, config=config, init_method=init, tp_group=group)
    with pytest.raises(ValueError, match=rf"input_size={F_ + 1} must be divisible"):
        RowParallelLinear(
            F_ + 1,
            H,
            config=config,
            init_method=init,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=group,
        )
    with pytest.raises(ValueError, match=rf"num_embeddings={4 * tp + 1} must be divisible"):
        VocabParallelEmbedding(4 * tp + 1, H, init_method=init, config=config, tp_group=group)
    with pytest.raises(RuntimeError, match="input_is_parallel must be True"):
        RowParallelLinear(
            F_,
            H,
            config=_config(True),
            init_method=init,
            bias=False,
            input_is_parallel=False,
            skip_bias_add=False,
            tp_group=group,
        )


def test_sequence_not_divisible_under_sp_raises_before_any_collective():
    group, tp, _ = world_group()
    torch.manual_seed(0)
    fc2 = RowParallelLinear(
        F_,
        H,
        config=_config(True),
        init_method=torch.nn.init.normal_,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=False,
        tp_group=group,
    )
    odd = S + 1
    with pytest.raises(ValueError, match=rf"size {odd}.*not divisible by the tensor-parallel"):
        fc2(on_device(torch.ones(odd, B, F_ // tp, dtype=torch.float64)))
    with pytest.raises(ValueError, match=rf"size {odd}.*not divisible by the tensor-parallel"):
        scatter_to_sequence_parallel_region(on_device(torch.ones(odd, B, H)), group=group)
    dist.barrier()  # every rank is still in step
