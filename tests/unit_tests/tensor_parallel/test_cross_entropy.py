"""Vocab-parallel cross entropy at TP = 2 and 4 (SPEC section 12, rules 1 and 2).

Reference: ``torch.nn.functional.cross_entropy`` on the full float64 logits. megatron's
label smoothing eps gives the target 1 - eps and each other entry eps / (V - 1), which is
torch's ``label_smoothing = eps V / (V - 1)`` (torch spreads its factor over all V entries).

* Rule 1: with label smoothing, value and gradient equal the one-device smoothed loss over
  the full vocabulary; negative control: smoothing over the partition's vocabulary fails.
* Rule 2: the loss of gathered logits (gather_from_tensor_model_parallel_region, then
  ordinary cross entropy) equals the vocab-parallel loss in value and gradient; negative
  control: a gather whose backward sums the gradient over the ranks (the replicated loss
  counted T times) fails.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import tensor_parallel as tp
from megatron.core.tensor_parallel import cross_entropy
from tests.unit_tests.dist_utils import WORLD_SIZE, assert_no_failures, rel_error
from tests.unit_tests.tensor_parallel.tp_reference import (
    TOL,
    block,
    on_device,
    seeded,
    world_group,
)

pytestmark = [pytest.mark.world(2, 4), pytest.mark.timeout(120)]

S, B = 5, 3
VOCAB = 4 * WORLD_SIZE


def _dense(logits_full, target, eps):
    """Per-token loss [s, b] and d(sum loss * w)/dlogits on the full float64 logits."""
    logits = logits_full.clone().requires_grad_()
    torch_eps = eps * VOCAB / (VOCAB - 1)
    loss = F.cross_entropy(
        logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none", label_smoothing=torch_eps
    ).view(S, B)
    return loss, logits


def _inputs():
    logits = seeded((S, B, VOCAB), 1) * 3
    target = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(2))
    weights = seeded((S, B), 3)  # upstream gradient of the per-token losses
    return logits, target, weights


def _vocab_parallel_failures(eps):
    group, T, rank = world_group()
    logits_full, target, weights = _inputs()
    local = on_device(block(logits_full, -1, rank, T)).requires_grad_()
    before = local.detach().clone()
    loss = tp.vocab_parallel_cross_entropy(
        local, on_device(target), label_smoothing=eps, tp_group=group
    )
    loss.backward(on_device(weights))
    ref_loss, ref_logits = _dense(logits_full, target, eps)
    ref_loss.backward(weights)
    failures = []
    if not rel_error(loss, ref_loss) <= TOL:
        failures.append(f"loss rel error {rel_error(loss, ref_loss):.2e}")
    expected_grad = block(ref_logits.grad, -1, rank, T)
    if not rel_error(local.grad, expected_grad) <= TOL:
        failures.append(f"grad rel error {rel_error(local.grad, expected_grad):.2e}")
    if not torch.equal(local.detach(), before):
        failures.append("the caller's logits were modified")
    return failures


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3], ids=["no-smoothing", "ls0.1", "ls0.3"])
def test_vocab_parallel_cross_entropy_equals_dense(eps):
    assert_no_failures(_vocab_parallel_failures(eps))


def test_negative_control_smoothing_over_partition_vocab_fails(monkeypatch):
    monkeypatch.setattr(cross_entropy, "_smoothing_vocab_size", lambda part, world: part)
    failures = _vocab_parallel_failures(0.1)
    everyone = [None] * WORLD_SIZE
    dist.all_gather_object(everyone, failures)
    assert all(any("loss" in f for f in fails) for fails in everyone), everyone


def test_mpu_fallback_matches_explicit_group():
    """tp_group=None uses parallel_state's TP group (here the whole world)."""
    from megatron.core import parallel_state
    from tests.unit_tests.dist_utils import reset_layout

    group, T, rank = world_group()
    logits_full, target, _ = _inputs()
    local, target = on_device(block(logits_full, -1, rank, T)), on_device(target)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD_SIZE)
    try:
        fallback = tp.vocab_parallel_cross_entropy(local, target, 0.1)
    finally:
        reset_layout()
    explicit = tp.vocab_parallel_cross_entropy(local, target, 0.1, tp_group=group)
    assert_no_failures([] if torch.equal(fallback, explicit) else ["fallback differs"])


def _gathered_vs_parallel(gather):
    """Rule 2: failures comparing gathered-logit loss/grad with the vocab-parallel ones."""
    group, T, rank = world_group()
    logits_full, target, weights = _inputs()
    target, weights = on_device(target), on_device(weights)
    a = on_device(block(logits_full, -1, rank, T)).requires_grad_()
    b = a.detach().clone().requires_grad_()
    parallel = tp.vocab_parallel_cross_entropy(a, target, tp_group=group)
    (parallel * weights).sum().backward()
    full = gather(b, group=group)
    gathered = F.cross_entropy(full.reshape(-1, VOCAB), target.reshape(-1), reduction="none")
    gathered = gathered.view(S, B)
    (gathered * weights).sum().backward()
    failures = []
    if not rel_error(gathered, parallel) <= TOL:
        failures.append(f"loss rel error {rel_error(gathered, parallel):.2e}")
    if not rel_error(b.grad, a.grad) <= TOL:
        failures.append(f"grad rel error {rel_error(b.grad, a.grad):.2e}")
    return failures


def test_gathered_logits_loss_equals_vocab_parallel_loss():
    assert_no_failures(_gathered_vs_parallel(tp.gather_from_tensor_model_parallel_region))


def test_negative_control_gather_summing_grads_fails():
    """all_gather_last_dim's backward reduce-scatters (sums over ranks): with a loss that
    every rank computes in full, the gradient comes out T times too large."""
    failures = _gathered_vs_parallel(tp.all_gather_last_dim_from_tensor_parallel_region)
    everyone = [None] * WORLD_SIZE
    dist.all_gather_object(everyone, failures)
    assert all(any("grad" in f for f in fails) for fails in everyone), everyone


def test_bad_label_smoothing_and_target_shape():
    group = world_group()[0]
    logits = on_device(torch.zeros(S, B, 4))
    target = on_device(torch.zeros(S, B, dtype=torch.long))
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\), got 1.0"):
        tp.vocab_parallel_cross_entropy(logits, target, 1.0, tp_group=group)
    with pytest.raises(ValueError, match=r"target must have .*\(5, 3\); got \(3, 5\)"):
        tp.vocab_parallel_cross_entropy(logits, target.t(), tp_group=group)
