"""Gemma 2 and Gemma 3 text against transformers, float64, one process, in-process.

Tiny random models (2-3 layers, hidden 32, GQA, head_dim 16 != hidden / heads, norm weights
drawn around 0 so the (1 + w) offset matters) built with transformers (eager attention),
saved, imported with ``model_from_hf`` in float64: logits, the loss and every parameter's
gradient equal transformers' (each of our gradients assembled from the HuggingFace ones
through the family's weight table) to 1e-10 relative. transformers' Gemma RMSNorm rounds
through float32 by design; the reference runs the same formula in float64 (the patched
``forward`` below), so the comparison is exact arithmetic, not float32 noise.

Negative controls: a soft-cap left out, the wrong norm offset (1 + w read as w), the
embedding scale left out, the local RoPE base replaced by the global one: each fails the
logit check. Import then export gives back the same tensors bit for bit; a model trained
from scratch with the Gemma flags exports as that family.
"""

import dataclasses
import json

import pytest
import torch

from megatron.training.hf import model_from_hf
from megatron.training.hf.config import read_hf_config
from megatron.training.hf.weights import parameter_sources
from tests.unit_tests.dist_utils import rel_error
from tests.unit_tests.hf.hf_models import HAVE_TRANSFORMERS, SKIP_REASON

pytestmark = [
    pytest.mark.world(1),
    pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=SKIP_REASON),
]

VOCAB, SEQ = 96, 12
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, initializer_range=0.1, max_position_embeddings=64,
)  # fmt: skip
# Gemma 2: soft-caps small enough to bite (scores and logits reach them), a window of 4 on
# layers 1 and 3 (full attention every other layer), query_pre_attn_scalar != head_dim
GEMMA2 = dict(
    SMALL, num_hidden_layers=3, sliding_window=4, attn_logit_softcapping=2.0,
    final_logit_softcapping=3.0, query_pre_attn_scalar=24, rope_theta=5000.0,
)  # fmt: skip
# Gemma 3: q/k norms, full attention every 2nd layer, the local base differs from the global,
# the global layers' linear RoPE scaling (the 4B+ models' factor 8)
GEMMA3 = dict(
    SMALL, num_hidden_layers=2, sliding_window=5, sliding_window_pattern=2,
    rope_theta=10_000.0, rope_local_base_freq=100.0, tie_word_embeddings=False,
    rope_scaling=dict(rope_type="linear", factor=8.0),
)  # fmt: skip
CASES = {"gemma2": ("Gemma2ForCausalLM", "Gemma2Config", GEMMA2),
         "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA3)}  # fmt: skip


def _float64_norms(monkeypatch) -> None:
    """transformers' Gemma RMSNorm and eager attention softmax in the input's dtype (both
    round through float32 by design): the same formulas, in float64."""
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.gemma3 import modeling_gemma3

    def forward(self, x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * (1.0 + self.weight)

    def attention(module, query, key, value, mask, dropout=0.0, scaling=None, softcap=None, **_):
        groups = module.num_key_value_groups
        key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))
        scores = (query @ key.transpose(2, 3)) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1)
        return (probs @ value).transpose(1, 2).contiguous(), probs

    for module, norm in ((modeling_gemma2, "Gemma2RMSNorm"), (modeling_gemma3, "Gemma3RMSNorm")):
        monkeypatch.setattr(getattr(module, norm), "forward", forward)
        monkeypatch.setattr(module, "eager_attention_forward", attention)


def _build(family: str, directory):
    import transformers

    model_cls, config_cls, kwargs = CASES[family]
    torch.manual_seed(7)
    config = getattr(transformers, config_cls)(**kwargs, attn_implementation="eager")
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)  # zero-centred: the offset 1 is visible
    model.save_pretrained(directory)
    return model.double()


def _ids() -> torch.Tensor:
    """Token ids without the pad token 0 (transformers' embedding never passes a gradient to
    the pad row, ``padding_idx``; ours does, as for every family)."""
    return torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


def _ours(path, ids):
    model, _ = model_from_hf(path, params_dtype=torch.float64)
    model.eval()
    return model, model(ids, torch.arange(ids.shape[1]).expand_as(ids))


@pytest.fixture(scope="module", params=list(CASES))
def gemma(request, tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    _float64_norms(monkeypatch)
    path = tmp_path_factory.mktemp(request.param)
    reference = _build(request.param, path)
    ids = _ids()
    logits = reference(ids).logits
    loss = _loss(logits, ids)
    loss.backward()
    yield request.param, path, reference, logits.detach(), loss.detach()
    monkeypatch.undo()


def test_logits_loss_and_every_gradient_equal_transformers_float64(gemma):
    family, path, reference, ref_logits, ref_loss = gemma
    ids = _ids()
    model, logits = _ours(path, ids)
    assert rel_error(logits, ref_logits) <= 1e-10, family
    loss = _loss(logits, ids)
    assert abs(loss.item() - ref_loss.item()) <= 1e-10 * abs(ref_loss.item())
    loss.backward()
    hf_grads = {n: p.grad for n, p in reference.named_parameters()}
    if "lm_head.weight" not in hf_grads:  # tied: one tensor
        hf_grads["lm_head.weight"] = hf_grads["model.embed_tokens.weight"]
    sources = parameter_sources(read_hf_config(path)[0])
    checked = 0
    for name, param in model.named_parameters():
        expected = torch.cat([hf_grads[s.key][s.start : s.stop] for s in sources[name]])
        err = rel_error(param.grad, expected)
        assert err <= 1e-10, f"{family}: {name} gradient differs ({err:.2e})"
        checked += 1
    assert checked == len(sources)


def _logit_error(path, ref_logits, **change) -> float:
    model, _ = model_from_hf(path, params_dtype=torch.float64)
    for name, value in change.items():
        setattr(model.config, name, value)
        for module in model.modules():
            if hasattr(module, "config"):
                setattr(module.config, name, value)
    model.eval()
    ids = _ids()
    with torch.no_grad():
        return rel_error(model(ids, torch.arange(SEQ).expand_as(ids)), ref_logits)


def test_negative_controls_each_gemma_feature_is_needed(gemma, monkeypatch):
    """Left out, each feature fails the logit check (the check above sees it)."""
    family, path, _, ref_logits, _ = gemma
    assert _logit_error(path, ref_logits) <= 1e-10
    assert _logit_error(path, ref_logits, embedding_scale_sqrt_hidden=False) > 1e-3
    if family == "gemma2":
        assert _logit_error(path, ref_logits, final_logit_softcapping=None) > 1e-3
        model, _ = model_from_hf(path, params_dtype=torch.float64)
        for layer in model.decoder.layers:  # the attention soft-cap left out
            core = layer.self_attention.core_attention
            core.attention_kernel = dataclasses.replace(core.attention_kernel, softcap=None)
        ids = _ids()
        with torch.no_grad():
            err = rel_error(model(ids, torch.arange(SEQ).expand_as(ids)), ref_logits)
        assert err > 1e-3, f"the attention soft-cap went unnoticed ({err:.2e})"
    from megatron.core.transformer.torch_norm import ZeroCenteredRMSNorm

    def plain_offset(self, x):  # y = norm(x) * w: the wrong offset
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    with monkeypatch.context() as m:
        m.setattr(ZeroCenteredRMSNorm, "forward", plain_offset)
        assert _logit_error(path, ref_logits) > 1e-3


def test_the_local_rope_base_and_the_global_scaling_are_needed():
    """Gemma 3's sliding layers rotate by rope_local_base_freq, its full layers by rope_theta
    with positions / 8: the global (scaled) rope on the sliding layers fails, and so does the
    full layers' rope without the scaling (on every layer)."""
    import tempfile

    monkeypatch = pytest.MonkeyPatch()
    _float64_norms(monkeypatch)
    try:
        with tempfile.TemporaryDirectory() as directory:
            reference = _build("gemma3_text", directory)
            ids = _ids()
            with torch.no_grad():
                ref_logits = reference(ids).logits
            model, _ = model_from_hf(directory, params_dtype=torch.float64)
            assert model.config.local_rotary_base == 100.0
            positions = torch.arange(SEQ).expand_as(ids)
            scaled = model.rotary_pos_emb
            assert scaled.seq_len_interpolation_factor == 8.0
            with torch.no_grad():
                model.local_rotary_pos_emb = scaled
                err = rel_error(model(ids, positions), ref_logits)
                assert err > 1e-3, f"the local RoPE base went unnoticed ({err:.2e})"
                del model.local_rotary_pos_emb
                scaled.clear_cache()  # the angles cached with the scaling
                scaled.seq_len_interpolation_factor = None
                err = rel_error(model(ids, positions), ref_logits)
            assert err > 1e-3, f"the global layers' RoPE scaling went unnoticed ({err:.2e})"
    finally:
        monkeypatch.undo()


def test_import_export_gives_back_the_original_tensors(gemma, tmp_path):
    from megatron.training.hf.__main__ import main as hf_cli
    from megatron.training.hf.weights import SafetensorsReader

    family, path, *_ = gemma
    assert hf_cli(["import", "--hf", str(path), "--out", str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "hf"
    assert hf_cli(["export", "--load", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    original, exported = SafetensorsReader(path), SafetensorsReader(out)
    assert sorted(original.keys()) == sorted(exported.keys())
    for key in original.keys():
        everything = (slice(None),) * len(original.shape(key))
        a, b = original.read(key, everything), exported.read(key, everything)
        assert a.dtype == b.dtype and torch.equal(a, b), key
    assert json.loads((out / "config.json").read_text())["model_type"] == family


def test_a_fresh_config_json_reads_back_as_the_same_model(gemma):
    """Each family writes its architecture as a config.json that transformers loads and that
    reads back (with every refusal) as the same architecture."""
    import transformers

    from megatron.training.hf.config import architecture_from_config
    from megatron.training.hf.families import REGISTRY

    family, path, *_ = gemma
    arch = read_hf_config(path)[0]
    written = REGISTRY[family].write(arch)
    assert architecture_from_config(dict(written, dtype=arch.dtype)) == arch
    config = transformers.AutoConfig.for_model(**written)
    assert list(config.layer_types) == written["layer_types"]


@pytest.mark.parametrize("family", list(CASES))
def test_keys_left_out_mean_transformers_defaults(family):
    """A config.json without a key means what transformers' class default means (Gemma's
    defaults: head_dim 256, 4 key/value heads, the soft-caps of Gemma 2, tied, ...)."""
    import transformers

    from megatron.training.hf.config import architecture_from_config

    full = getattr(transformers, CASES[family][1])().to_dict()
    full = {
        k: v for k, v in full.items() if not k.startswith("_") or k == "_sliding_window_pattern"
    }
    assert architecture_from_config({"model_type": family}) == architecture_from_config(full)
