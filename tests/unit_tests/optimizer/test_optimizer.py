"""get_megatron_optimizer and OptimizerParamScheduler against independent references.

References: AdamW written out in float64 from its definition (Loshchilov & Hutter), the
gradient norm as sqrt(sum g^2) over the whole gradient, and the scheduler's closed forms.
"""

import copy
import math

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

pytestmark = [pytest.mark.world(1), pytest.mark.timeout(60)]


class Toy(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.linear = torch.nn.Linear(5, 3).to(dtype)
        self.norm = torch.nn.LayerNorm(3).to(dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype))


def _grads(model, step):
    """Deterministic gradients for ``step``, put where DDP would (``main_grad``, fp32)."""
    out = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        gen = torch.Generator().manual_seed(100 * step + i)
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64) * (3.0 if step == 0 else 0.1)
        p.main_grad = g.float()
        out[name] = g.float().double()
    return out


def _adamw_reference(params, grads_per_step, lr, wd, b1, b2, eps, clip, no_wd):
    """Dense float64 AdamW with global-norm clipping; megatron's wd_mult=0 for ``no_wd``."""
    p = {k: v.double().clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    norms = []
    for t, grads in enumerate(grads_per_step, start=1):
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
        norms.append(norm)
        coeff = min(1.0, clip / (norm + 1e-6))
        for k in p:
            g = grads[k].double() * coeff
            decay = 0.0 if k in no_wd else wd
            p[k] = p[k] * (1 - lr * decay)
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            mhat, vhat = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            p[k] = p[k] - lr * mhat / (vhat.sqrt() + eps)
    return p, norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-fp32main"])
def test_adamw_step_matches_dense_reference(dtype):
    model = Toy(dtype)
    start = {k: p.detach().float().clone() for k, p in model.named_parameters()}
    config = OptimizerConfig(
        lr=0.01, weight_decay=0.1, clip_grad=1.0, bf16=dtype == torch.bfloat16, params_dtype=dtype
    )
    opt = get_megatron_optimizer(config, [model])
    sched = OptimizerParamScheduler(
        opt, 0.0, 0.01, 0.0, 0, 10, "constant", 0.1, 0.1, 10, "constant"
    )
    grads, norms = [], []
    for step in range(3):
        grads.append(_grads(model, step))
        ok, norm, zeros = opt.step()
        assert ok and zeros is None  # log_num_zeros_in_grad=False
        norms.append(norm)
        opt.zero_grad()
        sched.step(1)
    no_wd = {"linear.bias", "norm.weight", "norm.bias"}
    want, want_norms = _adamw_reference(start, grads, 0.01, 0.1, 0.9, 0.999, 1e-8, 1.0, no_wd)
    assert norms == pytest.approx(want_norms, rel=1e-6)
    assert want_norms[0] > 1.0  # the first step really clips
    for name, p in model.named_parameters():
        main_value = p.main_param if dtype != torch.float32 else p
        assert torch.allclose(main_value.double(), want[name], rtol=1e-5, atol=1e-6), name
        if dtype != torch.float32:
            assert p.dtype == dtype and torch.equal(p.data, p.main_param.data.to(dtype))


def test_clip_helpers_dense_reference():
    grads = [torch.randn(4, 3), torch.zeros(2), torch.randn(5)]
    want = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    assert get_grad_norm_fp32(grads) == pytest.approx(want, rel=1e-12)
    assert get_grad_norm_fp32(grads, norm_type=math.inf) == pytest.approx(
        max(float(g.abs().max()) for g in grads)
    )
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    clip_grad_by_total_norm_fp32(params, 0.5, want)
    for p, g in zip(params, grads):
        assert torch.allclose(p.grad, g * 0.5 / (want + 1e-6))
    assert count_zeros_fp32(params, None) == 2.0


def test_fp16_loss_scale_skips_overflow_and_backs_off():
    model = Toy(torch.float16)
    config = OptimizerConfig(lr=0.1, fp16=True, initial_loss_scale=1024.0, hysteresis=1)
    opt = get_megatron_optimizer(config, [model])
    before = [p.detach().clone() for p in model.parameters()]
    assert float(opt.get_loss_scale()) == 1024.0
    for p in model.parameters():
        p.main_grad = torch.full(p.shape, float("inf"))
    assert opt.step() == (False, None, None)
    assert float(opt.get_loss_scale()) == 512.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for p in model.parameters():
        p.main_grad = torch.full(p.shape, 512.0 * 1e-3)  # scaled grads
    ok, norm, _ = opt.step()
    n = sum(p.numel() for p in model.parameters())
    assert ok and norm == pytest.approx(1e-3 * math.sqrt(n), rel=1e-6)


def test_state_dict_round_trip_continues_identically():
    def make():
        model = Toy()
        opt = get_megatron_optimizer(OptimizerConfig(lr=0.05, weight_decay=0.0), [model])
        return model, opt

    a, opt_a = make()
    for step in range(2):
        _grads(a, step)
        opt_a.step()
    b, opt_b = make()
    b.load_state_dict(a.state_dict())
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # torch's state aliases
    for model, opt in ((a, opt_a), (b, opt_b)):
        _grads(model, 5)
        opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_unsupported_settings_raise():
    with pytest.raises(TypeError, match="not wrapped in DistributedDataParallel"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0, use_distributed_optimizer=True), [Toy()])
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        OptimizerConfig(lr=1.0, optimizer="lamb")
    with pytest.raises(TypeError, match="bfloat16"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0), [Toy(torch.bfloat16)])
    sgd = get_megatron_optimizer(OptimizerConfig(lr=1.0, optimizer="sgd"), [Toy()])
    assert isinstance(sgd.optimizer, torch.optim.SGD)


class _Groups:
    def __init__(self):
        self.param_groups = [{"wd_mult": 1.0}, {"wd_mult": 0.0, "max_lr": 2.0, "min_lr": 0.5}]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_scheduler_closed_form(style):
    init, peak, low, warm, decay = 0.1, 1.0, 0.2, 4, 14
    opt = _Groups()
    sched = OptimizerParamScheduler(
        opt, init, peak, low, warm, decay, style, 0.0, 0.3, 10, "linear"
    )

    def closed(n, peak_, low_):
        if n <= warm:
            return init + (peak_ - init) * n / warm
        if style == "constant":
            return peak_
        if n > decay:
            return low_
        r = (n - warm) / (decay - warm)
        if style == "linear":
            return low_ + (peak_ - low_) * (1 - r)
        return low_ + (peak_ - low_) * 0.5 * (1 + math.cos(math.pi * r))

    for n in range(0, 18):
        assert opt.param_groups[0]["lr"] == pytest.approx(closed(n, peak, low), abs=1e-12), n
        assert opt.param_groups[1]["lr"] == pytest.approx(closed(n, 2.0, 0.5), abs=1e-12), n
        assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.3 * min(n, 10) / 10)
        assert opt.param_groups[1]["weight_decay"] == 0.0
        sched.step(1)
    state = sched.state_dict()
    fresh = OptimizerParamScheduler(
        _Groups(), init, peak, low, warm, decay, style, 0.0, 0.3, 10, "linear"
    )
    fresh.load_state_dict(state)
    assert fresh.num_steps == 18 and fresh.optimizer.param_groups[0]["lr"] == pytest.approx(
        closed(18, peak, low)
    )
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        OptimizerParamScheduler(opt, 0.0, 1.0, 0.0, 5, 5, style, 0.0, 0.0, 1, "constant")
