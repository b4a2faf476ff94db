"""LoRA out to HuggingFace (SPEC section 20): a LoRA run from ``--hf-model`` exports a PEFT
adapter folder that ``peft.PeftModel.from_pretrained(base, DIR)`` turns into our trained
model's logits, and a merged model (``--merge-lora``) that transformers loads with the same
logits; the fused QKV and gate/up adapters are cut exactly as the base weights are (Llama's
grouped q/k/v rows, GPT-2's interleaved ``c_attn`` with Conv1D ``fan_in_fan_out``). A PEFT
adapter read back (``--hf-adapter``) continues from the same model.

Negative control: cutting B into q/k/v contiguously (ignoring the grouped layout) moves the
logits far off, so the comparison can catch a wrong split.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron.core import dist_checkpointing
from megatron.core.transformer.lora import LoRAConfig, apply_lora
from megatron.training import TrainingConfig
from megatron.training.checkpointing import checkpoint_dir
from megatron.training.hf import model_from_hf
from megatron.training.hf.__main__ import main as hf_cli
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import fresh_layout, rel_error
from tests.unit_tests.hf.hf_models import (
    GEMMA2_CONFIG,
    GEMMA3_CONFIG,
    GPT2_CONFIG,
    HAVE_TRANSFORMERS,
    LLAMA_CONFIG,
    SKIP_REASON,
    token_ids,
    transformers_logits,
    write_random_hf_model,
)

QWEN2_CONFIG = dict(LLAMA_CONFIG, model_type="qwen2", tie_word_embeddings=True)
pytestmark = [
    pytest.mark.world(1),
    pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=SKIP_REASON),
]
LORA = dict(lora_dim=4, lora_alpha=8.0, lora_b_init_method="normal", lora_a_init_method="normal")
RUN = dict(seq_length=16, global_batch_size=4, micro_batch_size=2, train_iters=2, lr=0.05,
           progress=False)  # fmt: skip


def _train(tmp_path: Path, config: dict, **changes) -> Path:
    base = write_random_hf_model(tmp_path / "base", config)
    with fresh_layout():
        result = pretrain(TrainingConfig(hf_model=str(base), **LORA, **RUN, **changes))
    assert result.passed
    return base


def _our_logits(base: Path, ckpt: Path, ids: torch.Tensor, **lora) -> torch.Tensor:
    """Our trained model at one process: the HF base, the adapters from the checkpoint."""
    model, _ = model_from_hf(base)
    apply_lora(model, LoRAConfig(dim=4, alpha=8.0, **lora))
    state = model.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": state}, str(checkpoint_dir(str(ckpt), 2)))
    model.load_state_dict(loaded["model"])
    model.eval()
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids))


def _peft_logits(base: Path, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize(
    "family, config",
    [
        ("llama", LLAMA_CONFIG),
        pytest.param("qwen2", QWEN2_CONFIG, marks=pytest.mark.slow),
        ("gpt2", GPT2_CONFIG),
        pytest.param("gemma2", GEMMA2_CONFIG, marks=pytest.mark.slow),
        pytest.param("gemma3_text", GEMMA3_CONFIG, marks=pytest.mark.slow),
    ],
)
def test_the_peft_adapter_and_the_merged_export_give_our_logits(tmp_path, family, config):
    pytest.importorskip("peft", reason="peft is a test extra (pip install -e .[dev])")
    ckpt, adapter, merged = tmp_path / "ckpt", tmp_path / "adapter", tmp_path / "merged"
    base = _train(tmp_path, config, save=str(ckpt), export_hf=str(adapter))
    written = json.loads((adapter / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"]) == (4, 8.0)
    assert written["fan_in_fan_out"] is (family == "gpt2")
    ids = token_ids()
    ours = _our_logits(base, ckpt, ids)
    assert rel_error(_peft_logits(base, adapter, ids), ours) <= 1e-5
    assert hf_cli(["export", "--load", str(ckpt), "--out", str(merged), "--merge-lora"]) == 0
    assert rel_error(transformers_logits(merged, ids), ours) <= 1e-5
    # positive control: the adapters changed the model
    assert rel_error(transformers_logits(base, ids), ours) > 1e-4


def test_negative_control_b_cut_contiguously_into_q_k_v_is_caught(tmp_path):
    pytest.importorskip("peft", reason="peft is a test extra (pip install -e .[dev])")
    ckpt, adapter = tmp_path / "ckpt", tmp_path / "adapter"
    base = _train(tmp_path, LLAMA_CONFIG, save=str(ckpt), export_hf=str(adapter))
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.self_attn."
    parts = [tensors[f"{prefix}{m}_proj.lora_B.weight"] for m in "qkv"]
    fused = _grouped_to_ours(parts)  # our row order, rebuilt from the right split
    sizes = [p.shape[0] for p in parts]
    for m, piece in zip("qkv", fused.split(sizes)):  # the wrong, contiguous split
        tensors[f"{prefix}{m}_proj.lora_B.weight"] = piece.contiguous()
    save_file(tensors, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    ids = token_ids()
    assert rel_error(_peft_logits(base, adapter, ids), _our_logits(base, ckpt, ids)) > 1e-3


def test_a_peft_adapter_read_back_is_our_trained_model(tmp_path):
    """``load_peft_adapter`` (the trainer's ``--hf-adapter``) puts an exported adapter back:
    the model's logits are those of the checkpoint it was exported from, at TP 1; and the
    trainer starts from it (its first loss differs from fresh adapters' first loss)."""
    from megatron.training.hf import read_hf_config
    from megatron.training.hf.peft import load_peft_adapter

    ckpt, adapter = tmp_path / "ckpt", tmp_path / "adapter"
    base = _train(tmp_path, LLAMA_CONFIG, save=str(ckpt), export_hf=str(adapter))
    model, _ = model_from_hf(base)
    lora = LoRAConfig(dim=4, alpha=8.0)
    apply_lora(model, lora)
    load_peft_adapter(model, adapter, read_hf_config(base)[0], lora)
    ids = token_ids()
    model.eval()
    with torch.no_grad():
        mine = model(ids, torch.arange(ids.shape[1]).expand_as(ids))
    assert rel_error(mine, _our_logits(base, ckpt, ids)) <= 1e-6
    losses = {}
    for name, extra in (("adapter", dict(hf_adapter=str(adapter))), ("fresh", {})):
        with fresh_layout():
            run = pretrain(TrainingConfig(hf_model=str(base), **LORA, **dict(RUN, train_iters=1),
                                          **extra))  # fmt: skip
        losses[name] = run.records[0]["loss"]
    assert losses["adapter"] != pytest.approx(losses["fresh"], rel=1e-4)
    with pytest.raises(ValueError, match="r=4, but --lora-dim 8"):
        with fresh_layout():
            pretrain(
                TrainingConfig(
                    hf_model=str(base),
                    **dict(LORA, lora_dim=8),
                    **dict(RUN, train_iters=1),
                    hf_adapter=str(adapter),
                )
            )


def _grouped_to_ours(parts):
    """Llama's q/k/v rows back in our grouped order (the test model: 4 heads, 2 groups)."""
    q, k, v = parts
    groups, d = 2, k.shape[0] // 2
    per = q.shape[0] // (groups * d)
    rows = []
    for g in range(groups):
        rows += [q[g * per * d : (g + 1) * per * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
    return torch.cat(rows)
