"""Mixed precision the megatron-core way: ``Float16Module`` (half-precision weights, fp32
outputs on the last stage), fp32 ``main_grad`` accumulation in DDP, fp32 main parameters in
the optimizer, and dynamic loss scaling.

References: the float64 dense GPT of the parity tests, SGD and megatron's loss-scale rule
written out by hand.
"""

import dataclasses

import pytest
import torch

from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.grad_scaler import DynamicGradScaler
from megatron.core.optimizer.main_params import (
    copy_main_params_to_model_params,
    copy_model_grads_to_main_grads,
    make_main_param,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module, MegatronModule
from tests.unit_tests.dist_utils import Layout, rel_error, reset_layout
from tests.unit_tests.models import test_gpt_parity as parity
from tests.unit_tests.models.naming import reference_names

pytestmark = [pytest.mark.world(1), pytest.mark.timeout(120)]


class Probe(MegatronModule):
    """Records the dtypes it is called with; returns (x * w, an integer tensor)."""

    def __init__(self, pre_process: bool, post_process: bool) -> None:
        super().__init__(TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1))
        self.pre_process, self.post_process = pre_process, post_process
        self.weight = torch.nn.Parameter(torch.full((3,), 1.5))
        self.register_buffer("scale", torch.ones(3))
        self.seen = None

    def forward(self, x, ids, *, extra=None):
        self.seen = (x.dtype, ids.dtype, None if extra is None else extra.dtype)
        return x * self.weight, ids


def _config(**kwargs) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("pre, post", [(True, True), (True, False), (False, True)])
def test_float16_module_casts_weights_inputs_and_outputs(dtype, pre, post):
    config = _config(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    module = Float16Module(config, Probe(pre, post))
    probe = module.module
    assert probe.weight.dtype == dtype and probe.scale.dtype == dtype
    x, ids = torch.full((3,), 2.0), torch.arange(3)
    out, out_ids = module(x if pre else x.to(dtype), ids, extra=torch.ones(3))
    assert probe.seen == (
        (dtype, torch.int64, dtype) if pre else (dtype, torch.int64, torch.float32)
    )
    assert out.dtype == (torch.float32 if post else dtype) and out_ids.dtype == torch.int64
    assert torch.equal(out.float(), torch.full((3,), 3.0))
    kept, _ = module(x.to(dtype), ids, fp32_output=False)
    assert kept.dtype == dtype
    assert set(module.state_dict()) == {"weight", "scale"}  # the wrapped module's keys


def test_float16_module_and_config_refuse_ambiguous_precision():
    with pytest.raises(ValueError, match="exactly one"):
        Float16Module(_config(), Probe(True, True))
    with pytest.raises(ValueError, match="fp16=True and bf16=True"):
        _config(fp16=True, bf16=True)


def _one_process_step(arch_name: str, bf16: bool, groups=None, **config_changes):
    """One step of the parity tests' GPT on one process (schedule, DDP with fp32 main_grad,
    finalize_model_grads): {reference name: main_grad}, plus the model. ``groups``: a
    collection of one-rank groups (inside a larger world); default: none."""
    arch = parity.ARCHS[arch_name]
    reset_layout()
    config = dataclasses.replace(parity.make_config(Layout(), "averaged", arch), **config_changes)
    if bf16:
        config.bf16, config.pipeline_dtype = True, torch.bfloat16
    gpt = parity.build_gpt(config, arch, groups or ProcessGroupCollection(), 0)
    names = dict(reference_names(gpt))
    model = Float16Module(config, gpt) if bf16 else gpt
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model, pg_collection=groups
    )
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    batch = parity.global_batch(arch.vocab)
    device = next(gpt.parameters()).device  # the GPU under TEST_BACKEND=nccl
    microbatches = [
        {k: v[g].to(device) for k, v in batch.items()} for g in range(parity.GLOBAL_MICROBATCHES)
    ]
    ddp.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=parity.forward_step,
        data_iterator=iter(microbatches),
        model=ddp,
        num_microbatches=len(microbatches),
        seq_length=parity.SEQ,
        micro_batch_size=parity.MICRO_BATCH,
        pg_collection=groups,
    )
    return {n: p.main_grad for n, p in names.items()}, gpt


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_bf16_gpt_gradients_are_fp32_main_grads_within_bf16_rounding(arch):
    """bf16 weights and activations, fp32 main_grad: every gradient within bf16's rounding
    of the float64 reference (a few percent for this model's std-0.3 weights), while the
    fp32 run of the same code is exact to 1e-5, so the difference is bf16's alone."""
    reference = parity.dense_reference("averaged", arch)[0][0]
    fp32_grads, _ = _one_process_step(arch, bf16=False)
    bf16_grads, gpt = _one_process_step(arch, bf16=True)
    assert all(p.dtype == torch.bfloat16 for p in gpt.parameters())
    assert all(g.dtype == torch.float32 for g in bf16_grads.values())
    fp32_errors = [rel_error(fp32_grads[n], reference[n]) for n in reference]
    bf16_errors = [rel_error(bf16_grads[n], reference[n]) for n in reference]
    assert max(fp32_errors) <= 1e-5
    assert 2**-9 < max(bf16_errors) <= 0.2, max(bf16_errors)  # it is bf16, and only bf16


def test_fp32_main_params_keep_updates_below_bf16_resolution():
    """SGD steps of 1e-3 on a bf16 weight of 1.0 (bf16's spacing just below 1 is 2^-8, so
    1 - 1e-3 rounds back to 1): the fp32
    main parameter takes every step and the model weight follows it, rounded. Negative
    control: the same steps applied to the bf16 weight itself are all lost."""
    model = torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    torch.nn.init.ones_(model.weight)
    config = OptimizerConfig(optimizer="sgd", lr=1e-3, sgd_momentum=0.0, weight_decay=0.0,
                             bf16=True, clip_grad=0.0)  # fmt: skip
    optimizer = get_megatron_optimizer(config, [model])
    plain = torch.ones(4, dtype=torch.bfloat16)
    for _ in range(10):
        model.weight.main_grad = torch.ones(1, 4)
        ok, _, _ = optimizer.step()
        assert ok
        plain -= torch.tensor(1e-3, dtype=torch.bfloat16)
    main = model.weight.main_param
    assert main.dtype == torch.float32
    torch.testing.assert_close(main.data, torch.full((1, 4), 0.99), rtol=0, atol=1e-6)
    assert torch.equal(model.weight.data, main.data.to(torch.bfloat16))
    assert model.weight.data[0, 0].item() == 0.98828125  # bf16's nearest to 0.99
    assert torch.equal(plain, torch.ones(4, dtype=torch.bfloat16))  # bf16 alone: no progress


def test_main_param_helpers():
    param = torch.nn.Parameter(torch.randn(3, 2).to(torch.bfloat16))
    param.tensor_model_parallel, param.partition_dim, param.shared = True, 0, True
    main = make_main_param(param)
    assert param.main_param is main and main.dtype == torch.float32
    assert (main.tensor_model_parallel, main.partition_dim, main.shared) == (True, 0, True)
    param.main_grad = torch.randn(3, 2)
    param.grad = torch.ones(3, 2, dtype=torch.bfloat16)
    copy_model_grads_to_main_grads([param], [main])
    assert main.grad.data_ptr() == param.main_grad.data_ptr() and param.grad is None
    main.data.fill_(0.3)
    copy_main_params_to_model_params([param], [main])
    assert torch.equal(param.data, torch.full((3, 2), 0.3).to(torch.bfloat16))


def test_dynamic_loss_scale_follows_megatrons_rule():
    """Halve after ``hysteresis`` overflowing steps (not below the minimum), double after
    ``loss_scale_window`` clean steps; a clean window restores the hysteresis."""
    scaler = DynamicGradScaler(
        initial_scale=16.0, min_scale=2.0, growth_factor=2.0, backoff_factor=0.5,
        growth_interval=3, hysteresis=2,
    )  # fmt: skip
    found = [True, True, False, True, True, True, True, True, False, False, False, True]
    # overflow 1 keeps 16 (hysteresis), 2 halves; clean; then every overflow halves, to 2;
    # three clean steps double to 4 and reset hysteresis; one overflow keeps 4
    expected = [16, 8, 8, 4, 2, 2, 2, 2, 2, 2, 4, 4]
    seen = []
    for overflow in found:
        scaler.update(overflow)
        seen.append(float(scaler.scale))
    assert seen == expected


def test_fp16_training_uses_dynamic_loss_scaling():
    """``OptimizerConfig(fp16=True)`` builds megatron's dynamic scaler from the config's
    ``initial_loss_scale``, ``min_loss_scale``, ``loss_scale_window`` and ``hysteresis``;
    ``loss_scale`` fixes it instead; the step unscales the gradients."""
    model = torch.nn.Linear(2, 2).to(torch.float16)
    config = OptimizerConfig(lr=0.0, fp16=True, initial_loss_scale=64.0, min_loss_scale=4.0,
                             loss_scale_window=5, hysteresis=3)  # fmt: skip
    optimizer = get_megatron_optimizer(config, [model])
    scaler = optimizer.chained_optimizers[0].grad_scaler
    assert isinstance(scaler, DynamicGradScaler)
    assert (float(scaler.scale), float(scaler.min_scale)) == (64.0, 4.0)
    assert (scaler.growth_interval, scaler.hysteresis) == (5, 3)
    loss = optimizer.scale_loss(torch.tensor(1.5))
    assert float(loss) == 96.0
    for p in model.parameters():
        p.main_grad = torch.full(p.shape, 64.0 * 0.25)
    ok, norm, _ = optimizer.step()
    assert ok and norm == pytest.approx(0.25 * 6**0.5)
    fixed = get_megatron_optimizer(OptimizerConfig(lr=0.0, fp16=True, loss_scale=8.0), [model])
    assert float(fixed.get_loss_scale()) == 8.0
