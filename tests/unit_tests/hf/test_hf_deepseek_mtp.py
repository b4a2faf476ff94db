"""DeepSeek-V3 with its multi-token prediction (MTP) layers through HuggingFace, float64, one
process. The tiny checkpoint: transformers' 3-layer V3 saved as 2 layers plus layer 2 as MTP
depth 1 (DeepSeek-V3's layout: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, copies
of ``embed_tokens`` and ``shared_head.head``; ``num_nextn_predict_layers`` 1).

transformers drops MTP layers, so the MTP part is checked against an independent float64
reference of megatron-core's convention built from transformers' own modules: h_1 =
shared_head.norm(layer_2(eh_proj([enorm(embed(tokens 1 ahead)); hnorm(h_0)]))), h_0
transformers' normed output, the loss S_1 / N_1 over the mask rolled by one, weighted by
``mtp_loss_scaling_factor``. The main model's logits are transformers'; every gradient (main
and MTP parameters) is the reference's; import then export gives every tensor back bit for
bit. Configs and checkpoints we cannot express are refused by name."""

import json

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper
from megatron.training.hf import model_from_hf
from megatron.training.hf.config import read_hf_config
from megatron.training.hf.weights import SafetensorsReader, parameter_sources
from tests.unit_tests.hf.hf_models import HAVE_TRANSFORMERS, SKIP_REASON
from tests.unit_tests.hf.test_hf_deepseek import CONFIGS, VOCAB, _batch, _patches, hf_grad

pytestmark = [
    pytest.mark.world(1),
    pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=SKIP_REASON),
]
MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def build_mtp_checkpoint(directory, seed: int = 0):
    """Save the tiny V3 with one MTP layer in ``directory``; (transformers' 3-layer model in
    float64, {key: float64 parameter} of the MTP layer's own tensors)."""
    import transformers
    from safetensors.torch import load_file, save_file

    _, kwargs = CONFIGS["v3"]
    config = transformers.DeepseekV3Config(**dict(kwargs, num_hidden_layers=3))
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.normal_(0.0, 1.0 if "gate.weight" in pname else 0.3)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    h = config.hidden_size
    own = {
        "model.layers.2.enorm.weight": 1.0 + 0.1 * torch.randn(h),
        "model.layers.2.hnorm.weight": 1.0 + 0.1 * torch.randn(h),
        "model.layers.2.eh_proj.weight": 0.3 * torch.randn(h, 2 * h),
        "model.layers.2.shared_head.norm.weight": 1.0 + 0.1 * torch.randn(h),
    }
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update(own)
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    raw = json.loads((directory / "config.json").read_text())
    raw.update(num_hidden_layers=2, num_nextn_predict_layers=1)
    (directory / "config.json").write_text(json.dumps(raw))
    model.config.num_hidden_layers = 2  # transformers' forward runs layers[:num_hidden_layers]
    own = {k: torch.nn.Parameter(v.double()) for k, v in own.items()}
    return model.double(), own


def _rms(x, weight):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    norm = DeepseekV3RMSNorm(x.shape[-1], eps=1e-6).double()
    norm.weight = weight
    return norm(x)


def _shift(t: torch.Tensor) -> torch.Tensor:
    """t[:, p + 1], zero past the end (megatron-core rolls and masks what rolls in)."""
    out = torch.zeros_like(t)
    out[:, :-1] = t[:, 1:]
    return out


def reference(hf, own, factor: float):
    """(main logits, the MTP loss S_1 / N_1) of transformers' modules, the objective
    main mean + factor * S_1 / N_1 backpropagated."""
    tokens, labels, mask = _batch()
    patches, _ = _patches("v3")
    for patch in patches:
        patch.start()
    try:
        h0 = hf.model(input_ids=tokens).last_hidden_state
        logits = hf.lm_head(h0)
        embedded = hf.model.embed_tokens(_shift(tokens))
        x = torch.cat(
            [_rms(embedded, own["model.layers.2.enorm.weight"]),
             _rms(h0, own["model.layers.2.hnorm.weight"])], dim=-1
        ) @ own["model.layers.2.eh_proj.weight"].t()  # fmt: skip
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        rope = hf.model.rotary_emb(x, positions)
        h1 = hf.model.layers[2](x, position_embeddings=rope, position_ids=positions)
        h1 = _rms(h1, own["model.layers.2.shared_head.norm.weight"])
        mtp_logits = hf.lm_head(h1)
    finally:
        for patch in reversed(patches):
            patch.stop()
    main = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    main = (main * mask.reshape(-1)).sum() / mask.sum()
    rolled_labels, rolled_mask = _shift(labels), _shift(mask)
    ce = F.cross_entropy(mtp_logits.reshape(-1, VOCAB), rolled_labels.reshape(-1), reduction="none")
    mtp = (ce * rolled_mask.reshape(-1)).sum() / rolled_mask.sum()
    (main + factor * mtp).backward()
    return logits.detach(), mtp.detach()


def test_deepseek_v3_mtp_matches_transformers_and_the_reference(tmp_path):
    """Main logits = transformers'; logged "mtp_1 loss" and every gradient = the reference's."""
    hf, own = build_mtp_checkpoint(tmp_path)
    arch, _ = read_hf_config(tmp_path)
    assert arch.mtp_num_layers == 1
    ours, config = model_from_hf(tmp_path, params_dtype=torch.float64)
    assert config.mtp_num_layers == 1 and len(ours.mtp.layers) == 1
    hf_logits, hf_mtp = reference(hf, own, config.mtp_loss_scaling_factor)
    tokens, labels, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens, None, None), hf_logits, rtol=1e-12, atol=1e-12)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    MTPLossLoggingHelper.clean_loss_in_tracker()
    loss = ours(tokens, None, None, labels=labels, loss_mask=mask)
    ((loss * mask).sum() / mask.sum()).backward()
    record = {}
    MTPLossLoggingHelper.track_mtp_metrics(1.0, 0, total_loss_dict=record)
    assert float(record["mtp_1 loss"]) == pytest.approx(float(hf_mtp), rel=1e-12)
    hf_params = {**dict(hf.named_parameters()), **own}
    sources = parameter_sources(arch)
    errors = {}
    for name, param in ours.named_parameters():
        expected = torch.cat(
            [hf_grad(hf_params, seg.key)[seg.start : seg.stop] for seg in sources[name]]
        )
        err = (param.grad - expected).abs().max() / expected.abs().max().clamp(min=1e-300)
        errors[name] = err.item()
    assert max(errors.values()) < 1e-10, {k: v for k, v in errors.items() if v >= 1e-10}
    mtp_names = [n for n in errors if n.startswith("mtp.layers.0.")]
    assert any("router" in n for n in mtp_names) and any("eh_proj" in n for n in mtp_names)


def test_import_export_gives_back_every_tensor_with_the_mtp_layers(tmp_path):
    from megatron.training.hf.__main__ import main as hf_cli

    build_mtp_checkpoint(tmp_path / "v3")
    assert hf_cli(["import", "--hf", str(tmp_path / "v3"), "--out", str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "hf"
    assert hf_cli(["export", "--load", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    original, exported = SafetensorsReader(tmp_path / "v3"), SafetensorsReader(out)
    assert sorted(original.keys()) == sorted(exported.keys())
    assert "model.layers.2.shared_head.head.weight" in exported.keys()
    for key in original.keys():
        everything = (slice(None),) * len(original.shape(key))
        a, b = original.read(key, everything), exported.read(key, everything)
        assert a.dtype == b.dtype and torch.equal(a, b), key
    assert read_hf_config(out)[0].mtp_num_layers == 1


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v3_mtp")
    build_mtp_checkpoint(directory)
    return directory


def test_mtp_num_layers_0_drops_the_mtp_layers(mtp_dir):
    """``--mtp-num-layers 0`` with ``--hf-model``: the run's TransformerConfig has no MTP
    (megatron-core's None), the model loads the checkpoint's other tensors and computes the
    same logits; the export of such a run writes no MTP layers. An explicit other count is
    a conflict named by flag."""
    from dataclasses import replace

    from megatron.training.arguments import TrainingConfig
    from megatron.training.hf.checkpoint import checkpoint_architecture
    from megatron.training.hf.loading import (
        build_gpt_chunk,
        load_hf_weights,
        transformer_config_from_hf,
    )
    from megatron.training.hf_settings import resolve_hf_model
    from megatron.training.options import TRANSFORMER_CONFIG, library_values

    kept = resolve_hf_model(TrainingConfig(hf_model=str(mtp_dir)))
    dropped = resolve_hf_model(TrainingConfig(hf_model=str(mtp_dir), mtp_num_layers=0))
    assert kept.mtp_num_layers == 1 and dropped.mtp_num_layers == 0
    only = {"mtp_num_layers", "mtp_loss_scaling_factor"}
    assert library_values(dropped, None, TRANSFORMER_CONFIG, only) == {"mtp_num_layers": None}
    with pytest.raises(ValueError, match=r"--mtp-num-layers 2 \(config.json gives 1\)"):
        resolve_hf_model(TrainingConfig(hf_model=str(mtp_dir), mtp_num_layers=2))
    arch, raw = read_hf_config(mtp_dir)
    plain = replace(arch, mtp_num_layers=None)
    config = transformer_config_from_hf(plain, params_dtype=torch.float64)
    model = build_gpt_chunk(plain, config, None)
    load_hf_weights(model, mtp_dir)
    full, _ = model_from_hf(mtp_dir, params_dtype=torch.float64)
    tokens = _batch()[0]
    with torch.no_grad():
        assert torch.equal(model(tokens, None, None), full(tokens, None, None))
    common = {"hf_config": json.dumps(raw), "run_settings": {"mtp_num_layers": 0}}
    assert checkpoint_architecture(common, "ckpt")[0].mtp_num_layers is None
    common["run_settings"]["mtp_num_layers"] = 1
    assert checkpoint_architecture(common, "ckpt")[0].mtp_num_layers == 1


def test_mtp_checkpoints_we_cannot_express_are_refused_by_name(mtp_dir, tmp_path):
    """A count that disagrees with the layers, MTP layers in a V2 checkpoint, a copy of the
    head that is not the head, MTP depths in a family that cannot carry them."""
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron.training.hf.config import architecture_from_config
    from megatron.training.hf.families import REGISTRY
    from megatron.training.hf.weights import check_checkpoint_tensors
    from tests.unit_tests.hf.test_hf_deepseek import _v2, _v3

    v3, keys = architecture_from_config(_v3()), ["model.layers.2.eh_proj.weight"]
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers=2 .*expected num_nextn_pr"):
        REGISTRY["deepseek_v3"].mtp_layers(v3, _v3(num_nextn_predict_layers=2), keys, "ckpt")
    assert REGISTRY["deepseek_v3"].mtp_layers(v3, _v3(num_nextn_predict_layers=1), [], "c") is None
    with pytest.raises(ValueError, match=r"layers.2.eh_proj.weight.*DeepSeek-V2 has no multi"):
        REGISTRY["deepseek_v2"].check_keys(architecture_from_config(_v2()), keys, "ckpt")
    bad = tmp_path / "bad"
    shutil.copytree(mtp_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.2.shared_head.head.weight"] += 1.0
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    arch, _ = read_hf_config(bad)
    reader = SafetensorsReader(bad)
    with pytest.raises(ValueError, match=r"'model.layers.2.shared_head.head.weight' differs"):
        check_checkpoint_tensors(reader, arch, parameter_sources(arch))
    from megatron.training.hf.checkpoint import checkpoint_architecture

    llama = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 24,
             "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 32}  # fmt: skip
    common = {"hf_config": json.dumps(llama), "run_settings": {"mtp_num_layers": 1}}
    with pytest.raises(ValueError, match=r"mtp_num_layers=1 .*llama"):
        checkpoint_architecture(common, "ckpt")
