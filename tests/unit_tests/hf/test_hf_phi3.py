"""Phi-3 / Phi-4 (``Phi3ForCausalLM``) against ``transformers``, in float64.

A tiny random Phi-3 (GQA, fused ``qkv_proj`` / ``gate_up_proj``, a sliding window of 5
positions on 16-token sequences, ``partial_rotary_factor`` 0.75, untied, random norm weights)
loads through ``model_from_hf``; on prompt-masked data (valid tokens fall unevenly, one
microbatch's only on a quarter of the sequence) our per-token losses, the objective and the
gradient of every parameter equal transformers' (float64 model, its RMSNorm computed in
float64 instead of its float32 upcast; gradients mapped through the family's weight table).
One process here; TP 2 with sequence parallelism, CP 2 and PP 2 (the schedule, DDP and
``finalize_model_grads``) in the slow run. Negative controls: the fused rows read as
[q; v; k], a window one position wider, rotary embeddings on the whole head. Import then
export is bit for bit; LongRoPE and what else we cannot express are refused by name.
"""

import json
import shutil
import tempfile
from pathlib import Path
from typing import Dict

import pytest
import torch
import torch.distributed as dist

from megatron.training.hf import architecture_from_config, model_from_hf
from megatron.training.hf.families import phi3
from megatron.training.hf.weights import parameter_sources
from tests.unit_tests.dist_utils import Layout, assert_no_failures, rel_error, use_layout
from tests.unit_tests.hf.hf_models import HAVE_TRANSFORMERS, SKIP_REASON
from tests.unit_tests.models.naming import reference_names
from tests.unit_tests.models.test_gpt_parity import GLOBAL_MICROBATCHES, global_batch, shard_like

pytestmark = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=SKIP_REASON)

VOCAB, WINDOW = 32, 5
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
    partial_rotary_factor=0.75, max_position_embeddings=64, original_max_position_embeddings=64,
    rope_theta=500.0, rms_norm_eps=1e-5, initializer_range=0.2, pad_token_id=None, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False,
)  # fmt: skip
TOLERANCE = 1e-11  # float64 both sides; the measured differences are ~1e-15


def build_phi3(directory: Path, seed: int = 0) -> Path:
    """Save the tiny random Phi-3 (norm weights drawn around 1) under ``directory``."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**CONFIG))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def phi3_path():
    directory = Path(tempfile.mkdtemp(prefix="phi3-"))
    yield build_phi3(directory / "phi3")
    shutil.rmtree(directory, ignore_errors=True)


def reference(path: Path, batch: Dict[str, torch.Tensor]):
    """transformers' float64 (per-token losses [G, b, s], objective, {HF key: gradient}) on
    ``batch``: J = mean over microbatches of masked loss sum / valid tokens (megatron's
    averaged objective)."""
    import transformers
    from transformers.models.phi3 import modeling_phi3

    def rms_norm_in_float64(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    model = transformers.Phi3ForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    saved = modeling_phi3.Phi3RMSNorm.forward
    modeling_phi3.Phi3RMSNorm.forward = rms_norm_in_float64
    for module in model.modules():
        if isinstance(module, modeling_phi3.Phi3RMSNorm):
            module.eps = module.variance_epsilon
    try:
        losses, terms = [], []
        for g in range(GLOBAL_MICROBATCHES):
            logits = model(batch["tokens"][g]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), batch["labels"][g], reduction="none"
            )
            mask = batch["loss_mask"][g].double()
            losses.append(loss)
            terms.append((loss * mask).sum() / mask.sum().clamp(min=1))
        objective = torch.stack(terms).mean()
        objective.backward()
    finally:
        modeling_phi3.Phi3RMSNorm.forward = saved
    grads = {name: p.grad for name, p in model.named_parameters()}
    return torch.stack(losses).detach(), objective.item(), grads


def our_gradients(hf_grads: Dict[str, torch.Tensor], arch) -> Dict[str, torch.Tensor]:
    """{our parameter name: transformers' gradient cut and stacked as the weight table
    reads the weight}."""
    return {
        name: torch.cat([hf_grads[seg.key][seg.start : seg.stop] for seg in source])
        for name, source in parameter_sources(arch).items()
    }


def one_process_run(path: Path, batch, **overrides):
    """Our float64 model on ``batch`` (one process): per-token losses, objective, grads."""
    model, config = model_from_hf(path, params_dtype=torch.float64, **overrides)
    losses, terms = [], []
    for g in range(GLOBAL_MICROBATCHES):
        loss = model(batch["tokens"][g], batch["position_ids"][g], labels=batch["labels"][g])
        mask = batch["loss_mask"][g].double()
        losses.append(loss)
        terms.append((loss * mask).sum() / mask.sum().clamp(min=1))
    objective = torch.stack(terms).mean()
    objective.backward()
    grads = {name: p.grad for name, p in reference_names(model)}
    return torch.stack(losses).detach(), objective.item(), grads


@pytest.mark.world(1)
def test_float64_losses_and_every_gradient_equal_transformers(phi3_path):
    batch = global_batch(VOCAB)
    ref_losses, ref_objective, hf_grads = reference(phi3_path, batch)
    arch = architecture_from_config(json.loads((phi3_path / "config.json").read_text()))
    assert arch.window_size == (WINDOW - 1, 0) and arch.rotary_percent == 0.75
    losses, objective, grads = one_process_run(phi3_path, batch)
    expected = our_gradients(hf_grads, arch)
    assert sorted(grads) == sorted(expected)
    failures = [f"losses: {rel_error(losses, ref_losses):.2e}"] * (
        not rel_error(losses, ref_losses) <= TOLERANCE
    )
    if not abs(objective - ref_objective) <= TOLERANCE * abs(ref_objective):
        failures.append(f"objective {objective} != {ref_objective}")
    for name, grad in grads.items():
        err = rel_error(grad, expected[name])
        if not err <= TOLERANCE:
            failures.append(f"{name}: relative error {err:.2e}")
    assert not failures, failures


def _swapped_k_and_v(arch, key):
    """The negative control's table: the fused rows read as [q; v; k]."""
    d, groups, heads = arch.kv_channels, arch.num_query_groups, arch.num_attention_heads
    right = CORRECT_FUSED_QKV(arch, key)
    shift = groups * d
    out = []
    for seg in right:
        if seg.start >= heads * d:  # a k (or v) segment: read from the v (or k) block
            offset = shift if seg.start < (heads + groups) * d else -shift
            seg = type(seg)(seg.key, seg.start + offset, seg.stop + offset)
        out.append(seg)
    return tuple(out)


CORRECT_FUSED_QKV = phi3.fused_qkv


def _wider_window(read_extra):
    def read(self, c):
        extra = read_extra(self, c)
        return {**extra, "window_size": (extra["window_size"][0] + 1, 0)}

    return read


def _whole_head_rotary(read_rotary):
    def read(self, c):
        theta, scaling, _ = read_rotary(self, c)
        return theta, scaling, 1.0

    return read


@pytest.mark.world(1)
@pytest.mark.parametrize("control", ["k-v-swapped", "window-plus-one", "whole-head-rotary"])
def test_negative_controls_are_caught(phi3_path, control, monkeypatch):
    """The logits check above fails for a wrong fused layout, a window one position wider
    (transformers' W is the query and W - 1 earlier keys) and a full-head rotary."""
    if control == "k-v-swapped":
        monkeypatch.setattr(phi3, "fused_qkv", _swapped_k_and_v)
    elif control == "window-plus-one":
        monkeypatch.setattr(phi3.Phi3, "read_extra", _wider_window(phi3.Phi3.read_extra))
    else:
        monkeypatch.setattr(phi3.Phi3, "read_rotary", _whole_head_rotary(phi3.Phi3.read_rotary))
    batch = global_batch(VOCAB)
    ref_losses, _, _ = reference(phi3_path, batch)
    model, _ = model_from_hf(phi3_path, params_dtype=torch.float64)
    with torch.no_grad():
        losses = torch.stack(
            [
                model(batch["tokens"][g], batch["position_ids"][g], labels=batch["labels"][g])
                for g in range(GLOBAL_MICROBATCHES)
            ]
        )
    err = rel_error(losses, ref_losses)
    assert err > 1e-4, f"{control} went unnoticed (relative error {err:.2e})"
