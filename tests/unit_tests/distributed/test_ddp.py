"""DistributedDataParallel and finalize_model_grads: buffers, hooks, buckets, overlap,
no_sync, averaging, broadcast; whole steps against the dense reference."""

from typing import List

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.dist_utils import (
    WORLD_SIZE,
    Layout,
    assert_no_failures,
    rel_error,
    reset_layout,
    use_layout,
)
from tests.unit_tests.parity import Case, check_step, run_step


def _option_cases() -> List[Case]:
    """Overlap on/off x bucket sizes x averaging, on a data-parallel and a CP layout."""
    layouts = {4: [Layout(pp=2, dp=2), Layout(cp=2, dp=2)], 8: [Layout(cp=2, pp=2, dp=2)]}
    cases = []
    for lay in layouts.get(WORLD_SIZE, []):
        base = Case(cp=lay.cp, pp=lay.pp, dp=lay.dp, microbatches=3, mask="uneven")
        cases += [
            base,
            base.with_(overlap=True),
            base.with_(overlap=True, bucket_size=1),
            base.with_(overlap=True, bucket_size=40),
            base.with_(overlap=True, bucket_size=1000),
            base.with_(average_in_collective=True),
            base.with_(overlap=True, bucket_size=40, average_in_collective=True),
            base.with_(overlap=True, bucket_size=40, mode="per-token"),
        ]
    return cases


OPTIONS = _option_cases()


@pytest.mark.world(4, 8)
@pytest.mark.parametrize("case", OPTIONS, ids=[c.id for c in OPTIONS])
def test_ddp_options_give_the_reference_gradients(case: Case):
    use_layout(Layout(case.cp, case.pp, case.vpp, case.dp))
    assert_no_failures(check_step(case, run_step(case)))


def _linear_ddp(overlap: bool, average: bool = False, bucket_size=None):
    """A two-layer linear model in DDP over parallel_state's dp x cp group."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, average_in_collective=average, bucket_size=bucket_size
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)


def _local_grads(model, inputs) -> List[torch.Tensor]:
    """Independent per-rank gradients of sum(model(x)^2) (autograd.grad on the module)."""
    params = list(model.module.parameters())
    total = [torch.zeros_like(p) for p in params]
    for x in inputs:
        grads = torch.autograd.grad(model.module(x).pow(2).sum(), params)
        total = [t + g for t, g in zip(total, grads)]
    return total


@pytest.mark.world(4, 8)
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("average", [False, True], ids=["prescale", "avg-in-collective"])
def test_no_sync_accumulates_then_last_microbatch_reduces(overlap, average):
    use_layout(Layout(dp=WORLD_SIZE))
    model = _linear_ddp(overlap, average, bucket_size=10)
    gen = torch.Generator().manual_seed(dist.get_rank())
    inputs = [torch.randn(5, 4, generator=gen) for _ in range(3)]
    expected_local = _local_grads(model, inputs)
    with model.no_sync():
        for x in inputs[:2]:
            model(x).pow(2).sum().backward()
    partial = _local_grads(model, inputs[:2])
    failures = [
        f"no_sync main_grad {i}: {rel_error(p.main_grad, g):.2e}"
        for i, (p, g) in enumerate(zip(model.module.parameters(), partial))
        if rel_error(p.main_grad, g) > 1e-6
    ]
    model(inputs[2]).pow(2).sum().backward()
    model.finish_grad_sync()
    for i, (param, local) in enumerate(zip(model.module.parameters(), expected_local)):
        everyone = [torch.zeros_like(local) for _ in range(WORLD_SIZE)]
        dist.all_gather(everyone, local)
        mean = torch.stack(everyone).mean(0)
        if param.grad is not None:
            failures.append(f"param {i}: .grad not freed")
        if rel_error(param.main_grad, mean) > 1e-6:
            failures.append(
                f"param {i}: reduced main_grad off by {rel_error(param.main_grad, mean):.2e}"
            )
    assert_no_failures(failures)


@pytest.mark.world(4, 8)
def test_broadcast_zero_and_scale():
    use_layout(Layout(cp=2, dp=WORLD_SIZE // 2))
    model = _linear_ddp(overlap=False)
    with torch.no_grad():
        for p in model.module.parameters():
            p.fill_(float(dist.get_rank()))
    model.broadcast_params()
    src = dist.get_process_group_ranks(parallel_state.get_data_parallel_group(True))[0]
    failures = [
        f"param not broadcast: {p.flatten()[0].item()}"
        for p in model.module.parameters()
        if not torch.all(p == float(src))
    ]
    model(torch.ones(2, 4)).sum().backward()
    before = [p.main_grad.clone() for p in model.module.parameters()]
    model.scale_gradients(0.5)
    failures += [
        "scale_gradients(0.5) did not halve main_grad"
        for p, b in zip(model.module.parameters(), before)
        if not torch.allclose(p.main_grad, 0.5 * b)
    ]
    model.zero_grad_buffer()
    failures += ["main_grad not zeroed" for p in model.module.parameters() if p.main_grad.any()]
    assert_no_failures(failures)


def test_single_process_ddp_moves_grads_into_contiguous_buffer():
    """No groups at all: hooks add .grad into main_grad (views of one buffer) and free it."""
    reset_layout()
    model = _linear_ddp(overlap=True, bucket_size=1)
    x = torch.randn(3, 4)
    expected = _local_grads(model, [x, x])
    for _ in range(2):
        model(x).pow(2).sum().backward()
    model.finish_grad_sync()
    buffer = model.buffers[0].data
    for param, grad in zip(model.module.parameters(), expected):
        assert param.grad is None
        assert param.main_grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert rel_error(param.main_grad, grad) < 1e-6
    assert len(model.buffers[0].buckets) == 4  # bucket_size=1: one bucket per parameter


test_single_process_ddp_moves_grads_into_contiguous_buffer = pytest.mark.world(1)(
    test_single_process_ddp_moves_grads_into_contiguous_buffer
)


def test_grad_reduce_in_fp32_keeps_bf16_params_with_fp32_main_grad():
    reset_layout()
    module = torch.nn.Linear(4, 2).to(torch.bfloat16)
    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module
    )
    assert all(p.main_grad.dtype == torch.float32 for p in module.parameters())
    assert len(ddp.buffers) == 1


test_grad_reduce_in_fp32_keeps_bf16_params_with_fp32_main_grad = pytest.mark.world(1)(
    test_grad_reduce_in_fp32_keeps_bf16_params_with_fp32_main_grad
)


@pytest.mark.world(1)
@pytest.mark.parametrize("hook", ["weak", "strong-control"])
def test_an_unreachable_ddp_wrapper_is_freed_with_its_module(monkeypatch, hook):
    """Once nothing refers to it, the wrapper, its module and its buffers are freed (after a
    backward too): its gradient hooks do not keep it alive (they would keep its process
    groups alive until the interpreter exits). Control: hooks holding the wrapper itself,
    the way torch 2.13 leaks it, must be caught."""
    import gc
    import weakref

    from megatron.core.distributed import distributed_data_parallel as ddp_module

    if hook == "strong-control":
        monkeypatch.setattr(ddp_module, "_weak_method", lambda method: method)
    reset_layout()
    model = _linear_ddp(overlap=True, bucket_size=1)
    model(torch.randn(3, 4)).sum().backward()
    model.finish_grad_sync()
    refs = [weakref.ref(model), weakref.ref(model.module), weakref.ref(model.buffers[0])]
    del model
    gc.collect()
    alive = [ref() is not None for ref in refs]
    assert alive == ([True] * 3 if hook == "strong-control" else [False] * 3)
