"""The LoRA paths people take (issue 38): the README's recipe (adapter-only checkpoints with
``--export-hf``, at the end and at every ``--save-interval``, and ``python -m
megatron.training.hf export`` of such a checkpoint), a MoE model with its experts left out
(attention and shared experts adapted; the PEFT adapter gives our logits in peft), adapters
on some layers only, a PEFT adapter whose base path works from any directory, and the
refusals: a resume on another base, a target pattern that matches nothing, an
``adapter_config.json`` without ``r`` or with per-module ranks / alphas.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron.core import dist_checkpointing
from megatron.core.transformer.lora import LoRAConfig, apply_lora
from megatron.training import TrainingConfig
from megatron.training.arguments import validate_config
from megatron.training.checkpointing import checkpoint_dir
from megatron.training.errors import UsageError
from megatron.training.hf import model_from_hf, read_hf_config
from megatron.training.hf.__main__ import main as hf_cli
from megatron.training.hf.peft import load_peft_adapter, lora_settings_of_peft, read_peft_config
from megatron.training.hf_settings import resolve_hf_model
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import fresh_layout, rel_error
from tests.unit_tests.hf.hf_models import (
    HAVE_TRANSFORMERS,
    LLAMA_CONFIG,
    QWEN2_MOE_CONFIG,
    SKIP_REASON,
    token_ids,
    write_random_hf_model,
)

pytestmark = [
    pytest.mark.world(1),
    pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=SKIP_REASON),
]
LORA = dict(lora_dim=4, lora_alpha=8.0, lora_b_init_method="normal", lora_a_init_method="normal")
RUN = dict(seq_length=16, global_batch_size=4, micro_batch_size=2, train_iters=2, lr=0.05,
           progress=False)  # fmt: skip
EXPERTS_OUT = dict(lora_exclude_modules=["*.experts.*"])
README = Path(__file__).resolve().parents[3] / "README.md"


def _train(**changes):
    with fresh_layout():
        result = pretrain(TrainingConfig(**{**LORA, **RUN, **changes}))
    assert result.passed
    return result


def _adapted_logits(base: Path, ckpt: Path, iteration: int, **lora) -> torch.Tensor:
    """Our model at one process: ``base``'s weights, the adapters of an adapter-only
    checkpoint (only the adapters' keys asked for)."""
    model, _ = model_from_hf(base)
    apply_lora(model, LoRAConfig(dim=4, alpha=8.0, **lora))
    state = {k: v for k, v in model.sharded_state_dict().items() if ".adapter." in k}
    loaded = dist_checkpointing.load({"model": state}, str(checkpoint_dir(str(ckpt), iteration)))
    result = model.load_state_dict(loaded["model"], strict=False)
    assert not result.unexpected_keys and all(".adapter." not in k for k in result.missing_keys)
    model.eval()
    ids = token_ids()
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids))


def _peft_logits(base: Path, adapter: Path) -> torch.Tensor:
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(input_ids=token_ids()).logits


def test_the_readme_recipe_exports_an_adapter_only_run_with_an_absolute_base(tmp_path, monkeypatch):
    """--save DIR --save-trainable-params-only --export-hf OUT (before: 'no
    embedding.word_embeddings.weight; not a GPT checkpoint', no adapter), with
    --save-interval (before: the run died at its first save) and ``hf export`` of the
    adapter-only checkpoint; the base is typed relative, the adapter names it absolute (so
    peft finds it from another directory: ``test_the_readmes_lora_commands_run_as_written``)."""
    base = write_random_hf_model(tmp_path / "base", LLAMA_CONFIG)
    (base / "special_tokens_map.json").write_text("{}")  # a tokenizer file the export carries
    monkeypatch.chdir(tmp_path)
    _train(hf_model="base", save="ckpt", save_trainable_params_only=True, save_interval=1,
           export_hf="adapter")  # fmt: skip
    config = json.loads(Path("adapter/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    assert (tmp_path / "adapter/iter_0000001/adapter_model.safetensors").is_file()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the base's recorded path, not the typed one
    assert hf_cli(["export", "--load", str(tmp_path / "ckpt"), "--out", "../again"]) == 0
    monkeypatch.chdir(tmp_path)
    assert Path("again/special_tokens_map.json").is_file()
    written, again = (load_file(f"{d}/adapter_model.safetensors") for d in ("adapter", "again"))
    assert written.keys() == again.keys() and all(torch.equal(written[k], again[k]) for k in again)
    assert any(".lora_B." in k and again[k].abs().max() > 0 for k in again)  # trained


@pytest.mark.parametrize(
    "config",
    [
        QWEN2_MOE_CONFIG,  # a dense layer and a MoE layer: stored layer by layer
        pytest.param(dict(QWEN2_MOE_CONFIG, mlp_only_layers=[]), marks=pytest.mark.slow),
    ],
    ids=["dense-and-moe", "every-layer-moe"],
)
def test_lora_on_a_moe_model_with_the_experts_left_out_exports_a_peft_adapter(tmp_path, config):
    """With the experts left out (``--lora-exclude-modules '*.experts.*'``) the attention
    and the shared experts train, save adapter-only at an interval, and export a PEFT adapter
    (before: "no tensor 'decoder.layers.mlp.linear_fc1.adapter...'") that peft loads onto
    the transformers model with our logits. (Before issue 42 the default targets, which name
    the routed experts too, were refused; they are adapted now: the test below.)"""
    pytest.importorskip("peft", reason="peft is a test extra (pip install -e .[dev])")
    base = write_random_hf_model(tmp_path / "base", config)
    ckpt, adapter = tmp_path / "ckpt", tmp_path / "adapter"
    _train(hf_model=str(base), save=str(ckpt), save_trainable_params_only=True, save_interval=1,
           export_hf=str(adapter), train_iters=1, **EXPERTS_OUT)  # fmt: skip
    modules = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert "model.layers.1.mlp.shared_expert.gate_proj" in modules
    assert not any(".experts." in m for m in modules)
    ours = _adapted_logits(base, ckpt, 1, exclude_modules=("*.experts.*",))
    assert rel_error(_peft_logits(base, adapter), ours) <= 1e-5
    without = _adapted_logits(base, ckpt, 1, exclude_modules=("*.experts.*", "*.shared_*"))
    assert rel_error(without, ours) > 1e-4  # positive control: the shared expert's adapter
    # read back (--hf-adapter): the same model
    model, _ = model_from_hf(base)
    lora = LoRAConfig(dim=4, alpha=8.0, exclude_modules=("*.experts.*",))
    apply_lora(model, lora)
    load_peft_adapter(model, adapter, read_hf_config(base)[0], lora)
    ids = token_ids()
    with torch.no_grad():
        back = model.eval()(ids, torch.arange(ids.shape[1]).expand_as(ids))
    assert rel_error(back, ours) <= 1e-6


# the HuggingFace config.json of each MoE family whose transformers model holds its
# experts as 3-D parameters (peft's ``target_parameters``), every layer MoE
MOE_CONFIGS = {
    "mixtral": dict(LLAMA_CONFIG, model_type="mixtral", num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=None),
    "qwen3_moe": dict(LLAMA_CONFIG, model_type="qwen3_moe", head_dim=16, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True),
    "olmoe": dict(LLAMA_CONFIG, model_type="olmoe", num_experts=4, num_experts_per_tok=2,
                  norm_topk_prob=False),
    "qwen2_moe": dict(QWEN2_MOE_CONFIG, mlp_only_layers=[]),  # with a gated shared expert
    # [E, in, out] experts with biases, fc1's gate / up columns interleaved; sinks, yarn
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=32, intermediate_size=24,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, vocab_size=LLAMA_CONFIG["vocab_size"], num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.4,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, rope_theta=150000.0,
                                         original_max_position_embeddings=16)),
}  # fmt: skip


@pytest.mark.parametrize(
    "family",
    ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow),
     pytest.param("olmoe", marks=pytest.mark.slow),
     pytest.param("qwen2_moe", marks=pytest.mark.slow),
     pytest.param("gpt_oss", marks=pytest.mark.slow)],
)  # fmt: skip
def test_expert_adapters_export_as_a_peft_adapter_that_peft_loads(tmp_path, family):
    """The default targets adapt every routed expert's fc1 / fc2 (one A, B each): trained,
    saved and exported, the adapter names the experts' 3-D parameters in
    ``target_parameters`` (``...mlp.experts.gate_up_proj`` / ``down_proj``); peft loads it
    onto the transformers model with our logits (fp32, 1e-5), and so do the merged export
    in transformers and ``--hf-adapter`` read back into our model."""
    pytest.importorskip("peft", reason="peft is a test extra (pip install -e .[dev])")
    import transformers

    base = write_random_hf_model(tmp_path / "base", MOE_CONFIGS[family])
    ckpt, adapter = tmp_path / "ckpt", tmp_path / "adapter"
    _train(hf_model=str(base), save=str(ckpt), export_hf=str(adapter), train_iters=1)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_parameters"] == [
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")
    ]
    ours = _adapted_logits(base, ckpt, 1)
    assert rel_error(_peft_logits(base, adapter), ours) <= 1e-5
    without = _adapted_logits(base, ckpt, 1, exclude_modules=("*.experts.*",))
    assert rel_error(without, ours) > 1e-4  # positive control: the experts' adapters act
    # merged into the base weights, in transformers
    assert (
        hf_cli(["export", "--load", str(ckpt), "--out", str(tmp_path / "m"), "--merge-lora"]) == 0
    )
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    with torch.no_grad():
        assert rel_error(merged.eval()(input_ids=token_ids()).logits, ours) <= 1e-5
    # read back (--hf-adapter): the same model
    model, _ = model_from_hf(base)
    lora = LoRAConfig(dim=4, alpha=8.0)
    apply_lora(model, lora)
    load_peft_adapter(model, adapter, read_hf_config(base)[0], lora)
    ids = token_ids()
    with torch.no_grad():
        back = model.eval()(ids, torch.arange(ids.shape[1]).expand_as(ids))
    assert rel_error(back, ours) <= 1e-6
    # --hf-adapter without targets: the adapter's target_parameters name every expert
    targets = lora_settings_of_peft(adapter, read_hf_config(base)[0])["lora_target_modules"]
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2" in targets


def test_expert_adapters_of_a_family_without_a_peft_form_are_refused_before_the_run(
    tmp_path, monkeypatch
):
    """A family whose experts have no PEFT form here (none today: the table is emptied):
    ``--export-hf`` of expert adapters is refused before the run, naming ``--merge-lora``;
    with ``--merge-lora``, or with the experts left out, the run is accepted."""
    from megatron.training.hf import peft

    base = write_random_hf_model(tmp_path / "base", MOE_CONFIGS["mixtral"])
    run = dict(hf_model=str(base), export_hf=str(tmp_path / "out"), **LORA, **RUN)
    resolve_hf_model(TrainingConfig(**run))  # positive control: mixtral has the form
    monkeypatch.setattr(peft, "PEFT_EXPERTS", {})
    with pytest.raises(ValueError, match=r"mixtral model have no PEFT.*--merge-lora"):
        resolve_hf_model(TrainingConfig(**run))
    resolve_hf_model(TrainingConfig(**run, merge_lora=True))
    resolve_hf_model(TrainingConfig(**run, **EXPERTS_OUT))


def test_adapters_on_some_layers_save_resume_and_export(tmp_path):
    """--lora-target-modules '*.layers.0.*.linear_qkv' (documented): the adapter-only
    checkpoint stores layer 0's adapter on its own (before: the save was refused, 'main
    replicas cover 128 of 256 elements', leaving an empty iter_*), a resume loads it, and
    the PEFT adapter adapts layer 0's q/k/v only with our logits in peft."""
    pytest.importorskip("peft", reason="peft is a test extra (pip install -e .[dev])")
    base = write_random_hf_model(tmp_path / "base", LLAMA_CONFIG)
    ckpt, adapter = tmp_path / "ckpt", tmp_path / "adapter"
    targets = dict(lora_target_modules=["*.layers.0.*.linear_qkv"])
    _train(hf_model=str(base), save=str(ckpt), save_trainable_params_only=True,
           export_hf=str(adapter), train_iters=1, **targets)  # fmt: skip
    stored = dist_checkpointing.load_tensors_metadata(str(checkpoint_dir(str(ckpt), 1)))
    weights = sorted(k for k in stored if not k.startswith(("optimizer", "rng_state")))
    assert weights == [f"decoder.layers.0.self_attention.linear_qkv.adapter.{p}.weight"
                       for p in ("linear_in", "linear_out")]  # fmt: skip
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_modules"] == [f"model.layers.0.self_attn.{m}_proj" for m in "kqv"]
    ours = _adapted_logits(base, ckpt, 1, target_modules=("*.layers.0.*.linear_qkv",))
    assert rel_error(_peft_logits(base, adapter), ours) <= 1e-5
    resumed = _train(hf_model=str(base), load=str(ckpt), save=str(ckpt), train_iters=2,
                     save_trainable_params_only=True, **targets)  # fmt: skip
    assert [r["iteration"] for r in resumed.records] == [2]


def test_a_failed_save_leaves_no_iteration_directory(tmp_path, monkeypatch):
    from megatron.training import checkpointing

    def refuse(*args, **kwargs):
        raise dist_checkpointing.CheckpointingException("refused")

    monkeypatch.setattr(checkpointing.dist_checkpointing, "save", refuse)
    with pytest.raises(dist_checkpointing.CheckpointingException, match="refused"):
        checkpointing.save_checkpoint(str(tmp_path), 3, [_Model()], _NoOptimizer())
    assert tmp_path.is_dir() and not list(tmp_path.iterdir())
    (tmp_path / "iter_0000004").mkdir()  # a directory the save did not create stays
    with pytest.raises(dist_checkpointing.CheckpointingException, match="refused"):
        checkpointing.save_checkpoint(str(tmp_path), 4, [_Model()], _NoOptimizer())
    assert (tmp_path / "iter_0000004").is_dir()


class _NoOptimizer:
    def sharded_state_dict(self, model_state):
        return {}


class _Model(torch.nn.Module):
    def sharded_state_dict(self):
        return {}


def test_an_adapter_only_resume_on_another_base_is_refused(tmp_path):
    """The adapter-only checkpoint records its base's fingerprint: a resume with --hf-model
    of other weights of the same shapes is refused naming both (before: trained on); the
    same weights copied elsewhere resume (a fingerprint of the contents, not of the path)."""
    base = write_random_hf_model(tmp_path / "base", LLAMA_CONFIG)
    other = write_random_hf_model(tmp_path / "other", LLAMA_CONFIG, seed=1)
    ckpt = tmp_path / "ckpt"
    _train(hf_model=str(base), save=str(ckpt), save_trainable_params_only=True, train_iters=1)
    resume = dict(load=str(ckpt), train_iters=2)
    with pytest.raises(ValueError, match=rf"trained on the base --hf-model {base}.*--hf-model "):
        _train(hf_model=str(other), **resume)
    copy = shutil.copytree(base, tmp_path / "copy")
    assert [r["iteration"] for r in _train(hf_model=str(copy), **resume).records] == [2]


def test_each_lora_target_pattern_must_match_a_layer():
    """One of several patterns matching nothing was ignored; now refused by name, before any
    worker starts (positive control: the same targets without it pass)."""
    config = TrainingConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                            global_batch_size=8, lora_dim=4)  # fmt: skip
    targets = ["linear_qkv", "*.layers.7.*"]
    with pytest.raises(UsageError, match=r"--lora-target-modules '\*\.layers\.7\.\*' matches no"):
        validate_config(TrainingConfig(**{**vars(config), "lora_target_modules": targets}), 1)
    validate_config(TrainingConfig(**{**vars(config), "lora_target_modules": targets[:1]}), 1)


ADAPTER = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj"]}


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(r=None), r"no 'r' \(the adapter's rank\); expected a positive integer"),
        (dict(r=0), r"r=0 \(the adapter's rank\)"),
        (dict(lora_alpha=None), r"no 'lora_alpha'"),
        (dict(alpha_pattern={"q_proj": 32}), r"alpha_pattern=\{'q_proj': 32\} gives some"),
        (dict(rank_pattern={"v_proj": 8}), r"rank_pattern=\{'v_proj': 8\} gives some"),
    ],
    ids=["no-r", "r-zero", "no-alpha", "alpha-pattern", "rank-pattern"],
)
def test_adapter_configs_we_cannot_express_are_refused_by_file_and_key(tmp_path, changes, message):
    """peft applies rank_pattern / alpha_pattern per module; our fused adapters cannot, so
    they are refused (before: silently ignored); a config without r is an error naming the
    file and the key (before: a KeyError traceback in generate). Positive control: the
    config itself, and empty patterns, read."""
    raw = {k: v for k, v in {**ADAPTER, **changes}.items() if v is not None}
    (tmp_path / "adapter_config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + ".*" + message):
        read_peft_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text(
        json.dumps(dict(ADAPTER, alpha_pattern={}, rank_pattern={}))
    )
    assert read_peft_config(tmp_path)["r"] == 4


def test_generate_with_an_adapter_config_without_r_is_one_line(tmp_path, capsys):
    from megatron.training.generate import main as generate

    base = write_random_hf_model(tmp_path / "base", LLAMA_CONFIG)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter/adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    argv = ["--hf-model", str(base), "--hf-adapter", str(tmp_path / "adapter"), "--prompt-ids",
            "1 2"]  # fmt: skip
    assert generate(argv) == 2
    assert "adapter_config.json: no 'r'" in capsys.readouterr().err


def _readme_lora_commands() -> list:
    """The shell commands of README.md's LoRA section (its first bash block), one per
    command, continuation lines joined."""
    text = README.read_text()
    section = text[text.index("## LoRA, PEFT adapters and sampling") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.slow  # launches the README's commands: 4 training ranks, then generate
def test_the_readmes_lora_commands_run_as_written(tmp_path):
    """README.md's LoRA commands, read from the README (so the two cannot drift), run in a
    folder that holds what they name: a tiny Llama-shaped ``./Llama-3.2-1B`` with a chat
    tokenizer and ``chats.jsonl``. Only --train-iters (the README trains the default 20) and
    --global-batch-size are added. The training writes the adapter-only checkpoint and the
    PEFT adapter, and generate samples with that adapter."""
    pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    pytest.importorskip("jinja2", reason="jinja2 (the hf extra) is not installed")
    from megatron.training.tokenizer.train_tokenizer import main as tokenizer_main

    train, sample = _readme_lora_commands()
    assert train[:3] == ["python", "-m", "megatron.training"] and "--export-hf" in train
    assert sample[:3] == ["python", "-m", "megatron.training.generate"]
    base = next(train[i + 1] for i, arg in enumerate(train) if arg == "--hf-model")
    data = next(train[i + 1] for i, arg in enumerate(train) if arg == "--data-path")
    words = "what is two plus four the answer hello world how are you".split()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(words[k:] + words[:k]) for k in range(len(words))))
    hf = write_random_hf_model(tmp_path / base, dict(LLAMA_CONFIG, vocab_size=320))
    tokenizer_main(["train", "--input", str(corpus), "--output-dir", str(hf), "--vocab-size",
                    "300"])  # fmt: skip
    chat = [{"role": "user", "content": "what is 2 + 2?"}, {"role": "assistant", "content": "4"}]
    (tmp_path / data).write_text("\n".join(json.dumps({"messages": chat}) for _ in range(8)))
    env = dict(os.environ, PYTHONPATH=str(README.parent), OMP_NUM_THREADS="1")
    for command, extra in ((train, ["--train-iters", "2", "--global-batch-size", "4"]),
                           (sample, ["--max-new-tokens", "4"])):  # fmt: skip
        run = subprocess.run([sys.executable, *command[1:], *extra], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=900)  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    adapter = tmp_path / next(train[i + 1] for i, arg in enumerate(train) if arg == "--export-hf")
    assert read_peft_config(adapter)["base_model_name_or_path"] == str(hf.resolve())
    # the adapter alone names its base: peft loads it from another directory, offline
    script = ("import sys, torch; from peft import AutoPeftModelForCausalLM; "
              "m = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]); "
              "print(m(input_ids=torch.tensor([[1, 2, 3]])).logits.shape)")  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = subprocess.run([sys.executable, "-c", script, str(adapter)], cwd=elsewhere,
                         env=dict(env, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0 and "[1, 3, 320]" in run.stdout, run.stderr[-3000:]
