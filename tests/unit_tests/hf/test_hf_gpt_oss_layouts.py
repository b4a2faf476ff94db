"""GPT-OSS at parallel layouts (2 ranks, slow), float64 against transformers' float64 model
(its RMSNorm kept in float64, as in ``test_hf_gpt_oss.py``).

At TP 2 with sequence parallelism (expert TP 1), CP 2 (a2a: the sliding-window layers need it
at C > 1) with a loss mask that leaves the two CP ranks different token counts, EP 2 (each
data-parallel rank one row of the batch) and PP 2 (two stages by hand): the loss and the
gradient of every parameter shard (after the reductions DDP and finalize_model_grads do:
sequence-parallel parameters over TP, the others over CP / DP, experts over expert DP) equal
transformers'. The expected shards come from the family's own table: transformers'
gradients saved as a HuggingFace checkpoint and loaded at the layout by ``model_from_hf``.
At PP 2 the last stage's logits equal transformers' too.
"""

import json

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.training.hf import model_from_hf
from tests.unit_tests.dist_utils import (
    Layout,
    assert_no_failures,
    rel_error,
    reset_layout,
    use_layout,
)
from tests.unit_tests.hf.hf_models import HAVE_TRANSFORMERS, SKIP_REASON, token_ids
from tests.unit_tests.hf.test_hf_gpt_oss import (
    _rms_norm_in_input_dtype,
    build_gpt_oss,
    transformers_float64,
)

pytestmark = [
    pytest.mark.world(2),
    pytest.mark.slow,
    pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=SKIP_REASON),
]

LAYOUTS = {
    "tp2-sp": (Layout(tp=2, sp=True, etp=1), dict(sequence_parallel=True)),
    "tp2-sp-etp2": (Layout(tp=2, sp=True), dict(sequence_parallel=True)),
    "cp2": (Layout(cp=2), dict(cp_comm_type="a2a")),
    "ep2": (Layout(dp=2, ep=2), dict(moe_token_dispatcher_type="alltoall")),
    "pp2": (Layout(pp=2), {}),
}


def loss_mask_of(ids: torch.Tensor) -> torch.Tensor:
    """No loss at the last position (no next token) nor at the first five of row 0: the CP
    ranks' shards hold different numbers of loss tokens."""
    mask = torch.ones(ids.shape, dtype=torch.float64)
    mask[:, -1] = 0
    mask[0, :5] = 0
    return mask


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(model dir, transformers' logits, loss, gradients-as-a-checkpoint dir), on rank 0,
    shared with the other rank."""
    from safetensors.torch import save_file
    from transformers.models.gpt_oss import modeling_gpt_oss

    payload = None
    if dist.get_rank() == 0:
        root = tmp_path_factory.mktemp("gpt-oss-layouts")
        path = build_gpt_oss(root / "model")
        original = modeling_gpt_oss.GptOssRMSNorm.forward
        modeling_gpt_oss.GptOssRMSNorm.forward = _rms_norm_in_input_dtype
        try:
            theirs = transformers_float64(path)
            ids = token_ids()
            logits = theirs(ids).logits
            mask = loss_mask_of(ids)
            per_token = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), ids.roll(-1, dims=1), reduction="none"
            )
            loss = (per_token * mask).sum() / mask.sum()
            loss.backward()
        finally:
            modeling_gpt_oss.GptOssRMSNorm.forward = original
        grads = root / "grads"
        grads.mkdir()
        save_file({n: p.grad.contiguous() for n, p in theirs.named_parameters()},
                  str(grads / "model.safetensors"))  # fmt: skip
        config = json.loads((path / "config.json").read_text())
        (grads / "config.json").write_text(json.dumps(dict(config, dtype="float32")))
        payload = [path, logits.detach(), loss.item(), grads]
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    yield box[0]
    reset_layout()


def _reduce_grads(model, layout: Layout) -> None:
    """What DDP and finalize_model_grads do to the gradients of this test's layouts."""
    for param in model.parameters():
        if param.grad is None:
            continue
        if not getattr(param, "allreduce", True):  # experts: over expert data parallelism
            group = parallel_state.get_expert_data_parallel_group()
            dist.all_reduce(param.grad, group=group)
            continue
        if layout.tp > 1 and getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
        if layout.cp > 1:
            dist.all_reduce(param.grad, group=parallel_state.get_context_parallel_group())
        if layout.dp > 1:
            dist.all_reduce(param.grad, group=parallel_state.get_data_parallel_group())


@pytest.mark.parametrize("name", ["tp2-sp", "tp2-sp-etp2", "cp2", "ep2"])
def test_logits_loss_and_gradients_at_a_layout(reference, name):
    path, their_logits, their_loss, grads = reference
    layout, extra = LAYOUTS[name]
    use_layout(layout)
    model, _ = model_from_hf(path, params_dtype=torch.float64, **extra)
    model.train()
    ids, mask = token_ids(), loss_mask_of(token_ids())
    labels, positions = ids.roll(-1, dims=1), torch.arange(ids.shape[1]).expand_as(ids)
    batch = dict(tokens=ids, labels=labels, loss_mask=mask, position_ids=positions)
    if layout.cp > 1:
        batch = get_batch_on_this_cp_rank(batch)
    if layout.dp > 1:  # each data-parallel rank one row
        row = parallel_state.get_data_parallel_rank()
        batch = {k: v[row : row + 1] for k, v in batch.items()}
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss = (per_token * batch["loss_mask"]).sum() / mask.sum()
    loss.backward()
    _reduce_grads(model, layout)
    failures = []
    total = loss.detach().clone()
    if layout.cp > 1 or layout.dp > 1:
        dist.all_reduce(total)
    if abs(total.item() - their_loss) > 1e-12 * abs(their_loss):
        failures.append(f"{name}: loss {total.item()!r} != {their_loss!r}")
    expected, _ = model_from_hf(grads, params_dtype=torch.float64, **extra)
    wanted = dict(expected.named_parameters())
    for param_name, param in model.named_parameters():
        err = rel_error(param.grad, wanted[param_name].detach())
        if not err <= 1e-10:
            failures.append(f"{name}: {param_name} gradient relative error {err:.1e}")
    assert_no_failures(failures)


def test_logits_loss_and_gradients_at_pp2(reference):
    """Two stages by hand: stage 0's output goes to stage 1, whose input gradient comes
    back (what the pipeline schedule's messages carry)."""
    path, their_logits, their_loss, grads = reference
    use_layout(LAYOUTS["pp2"][0])
    model, config = model_from_hf(path, params_dtype=torch.float64, pipeline_dtype=torch.float64)
    ids, mask = token_ids(), loss_mask_of(token_ids())
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    group = parallel_state.get_pipeline_model_parallel_group()
    first, last = (dist.get_global_rank(group, r) for r in (0, 1))
    shape = (ids.shape[1], ids.shape[0], config.hidden_size)
    message = torch.empty(shape, dtype=torch.float64)
    failures = []
    if model.pre_process:
        hidden = model(ids, positions)
        message.copy_(hidden.detach())
    dist.broadcast(message, src=first, group=group)
    if model.post_process:
        received = message.clone().requires_grad_(True)
        model.set_input_tensor(received)
        with torch.no_grad():
            err = rel_error(model(ids, positions), their_logits)
        if not err <= 1e-12:
            failures.append(f"pp2: logits relative error {err:.1e}")
        model.set_input_tensor(received)
        per_token = model(ids, positions, None, labels=ids.roll(-1, dims=1))
        loss = (per_token * mask).sum() / mask.sum()
        if abs(loss.item() - their_loss) > 1e-12 * abs(their_loss):
            failures.append(f"pp2: loss {loss.item()!r} != {their_loss!r}")
        loss.backward()
        message.copy_(received.grad)
    dist.broadcast(message, src=last, group=group)
    if model.pre_process:
        hidden.backward(message)
    expected, _ = model_from_hf(grads, params_dtype=torch.float64, pipeline_dtype=torch.float64)
    wanted = dict(expected.named_parameters())
    for param_name, param in model.named_parameters():
        err = rel_error(param.grad, wanted[param_name].detach())
        if not err <= 1e-10:
            failures.append(f"pp2: {param_name} gradient relative error {err:.1e}")
    assert_no_failures(failures)


@pytest.mark.parametrize("saved", ["tp2-sp", "tp2-sp-etp2"])
def test_a_checkpoint_saved_at_tp2_loads_at_ep2(reference, saved):
    """The sinks (split over TP with the heads), the router bias and the expert biases (on
    the global expert axis; at expert TP 2 fc1's split, fc2's whole) in
    ``sharded_state_dict``: saved at TP 2 x SP, loaded at EP 2 into zeroed weights, every
    parameter equals the HuggingFace import at EP 2."""
    from megatron.core import dist_checkpointing

    path = reference[0]
    directory = path.parent / f"checkpoint-{saved}"
    if dist.get_rank() == 0:
        directory.mkdir(exist_ok=True)
    dist.barrier()
    layout, extra = LAYOUTS[saved]
    use_layout(layout)
    model, _ = model_from_hf(path, params_dtype=torch.float64, **extra)
    dist_checkpointing.save(model.sharded_state_dict(), str(directory))
    layout, extra = LAYOUTS["ep2"]
    use_layout(layout)
    expected, _ = model_from_hf(path, params_dtype=torch.float64, **extra)
    fresh, _ = model_from_hf(path, params_dtype=torch.float64, **extra)
    with torch.no_grad():
        for param in fresh.parameters():
            param.zero_()
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(directory)))
    wanted = dict(expected.named_parameters())
    failures = [
        f"ep2: {name} differs after the load"
        for name, param in fresh.named_parameters()
        if not torch.equal(param, wanted[name])
    ]
    assert any("softmax_offset" in n for n in wanted) and any("fc2.bias" in n for n in wanted)
    assert_no_failures(failures)


@pytest.mark.parametrize(
    "flags", [["--tp", "2", "--expert-tensor-parallel-size", "1"], ["--tp", "2"], ["--pp", "2"]],
    ids=["tp2-etp1", "tp2-etp2", "pp2"],
)  # fmt: skip
def test_generate_at_a_layout_prints_the_one_process_tokens(reference, flags):
    """``python -m megatron.training.generate --hf-model`` at TP 2 (expert TP 1 and 2) and
    PP 2 prints the one-process model's greedy tokens (rank 0 prints)."""
    import contextlib
    import io

    from megatron.training.generate import generate, main
    from tests.unit_tests.dist_utils import fresh_layout

    path = reference[0]
    prompt = [3, 17, 42, 5, 99, 8]
    reset_layout()
    model, _ = model_from_hf(path)
    model.eval()
    expected = " ".join(map(str, generate([model], prompt, 6, vocab_size=128)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), fresh_layout():
        code = main(["--hf-model", str(path), "--prompt-ids", " ".join(map(str, prompt)),
                     "--max-new-tokens", "6", *flags])  # fmt: skip
    assert code == 0
    assert out.getvalue().strip() == (expected if dist.get_rank() == 0 else "")


def test_the_fc2_bias_counts_once_in_the_gradient_norm_at_expert_tp2(reference):
    """At expert TP 2 the fc2 biases are whole on both ranks: rank 1's are marked
    ``expert_tp_duplicate`` and left out of the experts' gradient statistics."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    layout, extra = LAYOUTS["tp2-sp-etp2"]
    use_layout(layout)
    model, _ = model_from_hf(reference[0], params_dtype=torch.float64, **extra)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.ones_like(p)

    class Params:
        def get_parameters(self):
            return params

    counted = MegatronOptimizer.get_expert_main_grads_for_grad_norm(Params())
    biases = [p for n, p in model.named_parameters() if n.endswith("linear_fc2.bias")]
    duplicates = [p for p in biases if getattr(p, "expert_tp_duplicate", False)]
    assert len(duplicates) == (len(biases) if dist.get_rank() == 1 else 0) and biases
    assert not any(g is p.grad for p in duplicates for g in counted)
