"""The trainer from a HuggingFace model: ``--hf-model DIR`` (its config sets the model, its
weights are loaded at any layout) and ``--export-hf DIR``; an imported checkpoint
(``python -m megatron.training.hf import``) read by ``--load --finetune``.

World 4: SFT at CP = 2, PP = 2 from a tiny Llama follows the one-process run
(``--compare-single-process``, 1e-5), and the exported model, loaded in transformers, gives
the logits of our trained model (its ``--save`` checkpoint loaded at one process).
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.training import TrainingConfig
from megatron.training.checkpointing import checkpoint_dir
from megatron.training.cli import LAUNCHER_VARIABLES
from megatron.training.cli import main as train_cli
from megatron.training.hf import model_from_hf
from megatron.training.hf.__main__ import main as hf_cli
from megatron.training.hf.config import architecture_from_config, training_settings
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout, rel_error
from tests.unit_tests.hf.hf_models import (
    GEMMA2_CONFIG,
    GEMMA3_CONFIG,
    GPT2_CONFIG,
    HAVE_TRANSFORMERS,
    LLAMA_CONFIG,
    QWEN2_MOE_CONFIG,
    SKIP_REASON,
    shared_hf_models,
    token_ids,
    transformers_logits,
    write_random_hf_model,
)

RUN = dict(seq_length=16, global_batch_size=4, micro_batch_size=1, progress=False)


def _losses(**changes):
    with fresh_layout():
        result = pretrain(TrainingConfig(**{**RUN, **changes}))
    return [r["loss"] for r in result.records], result


def _shared_dir() -> Path:
    path = [tempfile.mkdtemp(prefix="hf-trainer-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return Path(path[0])


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "config",
    [
        pytest.param(LLAMA_CONFIG, id="llama"),
        pytest.param(GPT2_CONFIG, id="gpt2"),
        pytest.param(QWEN2_MOE_CONFIG, id="qwen2_moe", marks=pytest.mark.slow),  # ~10 s
        pytest.param(GEMMA2_CONFIG, id="gemma2", marks=pytest.mark.slow),
        pytest.param(GEMMA3_CONFIG, id="gemma3", marks=pytest.mark.slow),
    ],
)
def test_an_imported_checkpoint_loads_as_the_hf_model_does(tmp_path, config):
    """--load of `hf import`'s checkpoint with --finetune (model flags given explicitly)
    trains exactly as --hf-model; without the weights (random init) it does not."""
    hf = write_random_hf_model(tmp_path / "hf", config)
    assert hf_cli(["import", "--hf", str(hf), "--out", str(tmp_path / "ckpt")]) == 0
    settings = training_settings(architecture_from_config(config))
    from_hf, _ = _losses(hf_model=str(hf), train_iters=2)
    loaded, _ = _losses(**settings, load=str(tmp_path / "ckpt"), finetune=True, train_iters=2)
    scratch, _ = _losses(**settings, train_iters=2)
    assert loaded == from_hf
    assert abs(scratch[0] - from_hf[0]) > 1e-3
    with pytest.raises(ValueError, match="model weights only.*--finetune"):
        _losses(**settings, load=str(tmp_path / "ckpt"), train_iters=2)


@pytest.mark.world(1)
def test_conflicting_model_flags_are_refused_by_name(tmp_path, capsys):
    hf = write_random_hf_model(tmp_path / "hf", LLAMA_CONFIG)
    with pytest.raises(ValueError, match=r"--num-layers 3 \(config.json gives 2\)"):
        _losses(hf_model=str(hf), num_layers=3)
    # on the command line even a flag at its default value counts as given
    with pytest.raises(SystemExit):
        train_cli(["--hf-model", str(hf), "--num-layers", "4", "--no-progress"])
    assert "--num-layers 4 (config.json gives 2)" in capsys.readouterr().err


@pytest.mark.world(2)
@pytest.mark.slow  # 9 s; the default run keeps the cp2-pp2 HF SFT run and the layout logits
def test_an_imported_checkpoint_reshards_to_tensor_parallel():
    directory = _shared_dir()
    hf = directory / "hf"
    if dist.get_rank() == 0:  # the command line, as a user runs it: one process
        write_random_hf_model(hf, LLAMA_CONFIG)
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
        command = [sys.executable, "-m", "megatron.training.hf", "import", "--hf", str(hf)]
        subprocess.run(command + ["--out", str(directory / "ckpt")], env=env, check=True)
    dist.barrier()
    settings = training_settings(architecture_from_config(LLAMA_CONFIG))
    tp = dict(tensor_model_parallel_size=2, train_iters=2)
    from_hf, _ = _losses(hf_model=str(hf), **tp)
    loaded, _ = _losses(**settings, load=str(directory / "ckpt"), finetune=True, **tp)
    failures = [] if loaded == from_hf else [f"--load {loaded} != --hf-model {from_hf}"]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    assert_no_failures(failures)


@pytest.mark.world(4)
def test_sft_from_hf_at_cp2_pp2_follows_one_process_and_exports_to_transformers():
    if not HAVE_TRANSFORMERS:
        pytest.skip(SKIP_REASON)
    models = shared_hf_models(with_logits=False)
    directory = _shared_dir()
    losses, result = _losses(
        hf_model=str(models.paths["llama"]),
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        train_iters=3,
        compare_single_process=True,
        compare_tolerance=1e-5,
        save=str(directory / "ckpt"),
        export_hf=str(directory / "exported"),
    )
    failures = [] if result.passed else ["the comparison with the one-process run failed"]
    # Our trained model at one process: the original model, its weights from --save.
    model, _ = model_from_hf(models.paths["llama"])
    saved = dist_checkpointing.load(
        {"model": model.sharded_state_dict()}, str(checkpoint_dir(str(directory / "ckpt"), 3))
    )
    model.load_state_dict(saved["model"])
    original = model_from_hf(models.paths["llama"])[0].embedding.word_embeddings.weight
    if torch.equal(model.embedding.word_embeddings.weight, original):
        failures.append("the saved model equals the original: nothing was trained")
    if dist.get_rank() == 0:
        ids = token_ids()
        model.eval()
        with torch.no_grad():
            ours = model(ids, torch.arange(ids.shape[1]).expand_as(ids))
        err = rel_error(transformers_logits(directory / "exported", ids), ours)
        if not err <= 1e-5:
            failures.append(f"exported model's logits differ from ours: {err:.2e}")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(models.directory, ignore_errors=True)
    assert_no_failures(failures)


@pytest.mark.world(1)
def test_chat_data_with_the_hf_models_tokenizer(tmp_path, capsys):
    """--hf-model DIR --data-path chat.jsonl: DIR's tokenizer.json and chat template are the
    tokenizer, the model keeps config.json's (padded) vocabulary, and --export-hf carries
    the tokenizer files along; a tokenizer larger than the vocabulary is refused. DIR's
    tokenizer also reads --valid-data-path of a --skip-train run without --data-path."""
    pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    pytest.importorskip("jinja2", reason="jinja2 (the hf extra) is not installed")
    import json

    from megatron.training.tokenizer.train_tokenizer import main as tokenizer_main

    words = "the quick brown fox jumps over the lazy dog hello world how are you".split()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(words[k:] + words[:k]) for k in range(len(words))))
    hf = write_random_hf_model(tmp_path / "hf", dict(LLAMA_CONFIG, vocab_size=320))
    tokenizer_main(
        ["train", "--input", str(corpus), "--output-dir", str(hf), "--vocab-size", "300"]
    )
    data = tmp_path / "chat.jsonl"
    chat = [{"role": "user", "content": "hello fox"}, {"role": "assistant", "content": "the dog"}]
    data.write_text("\n".join(json.dumps({"messages": chat}) for _ in range(8)) + "\n")
    out = tmp_path / "exported"
    losses, result = _losses(
        hf_model=str(hf), data_path=str(data), train_iters=2, seq_length=32, export_hf=str(out)
    )
    assert all(loss == loss and loss > 0 for loss in losses)
    assert (out / "tokenizer.json").read_text() == (hf / "tokenizer.json").read_text()
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 320
    small = write_random_hf_model(tmp_path / "small", dict(LLAMA_CONFIG, vocab_size=128))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / name, small / name)
    with pytest.raises(ValueError, match="more than --hf-model .* vocab_size 128"):
        _losses(hf_model=str(small), data_path=str(data), train_iters=1, seq_length=32)
    # --skip-train --valid-data-path without --data-path: DIR's tokenizer reads it too
    capsys.readouterr()
    only = dict(RUN, hf_model=str(hf), skip_train=True, valid_data_path=str(data), seq_length=32)
    with fresh_layout():
        (record,) = pretrain(TrainingConfig(**only, eval_iters=-1)).records
    assert record["valid_loss"] > 0 and f"({hf} tokenizer)" in capsys.readouterr().out


@pytest.mark.world(2)
@pytest.mark.slow  # suite time; MoE weights at EP = 2: test_hf_layouts (default run)
def test_a_moe_model_from_hf_at_ep2_follows_one_process_and_exports():
    """--hf-model with a Qwen2-MoE (a dense and a MoE layer, shared expert): at EP = 2
    (alltoall) the run equals the one-process run, and --export-hf writes the trained model
    with every tensor of the original, trained."""
    from megatron.training.hf.weights import SafetensorsReader

    directory = _shared_dir()
    hf = directory / "hf"
    if dist.get_rank() == 0:
        write_random_hf_model(hf, QWEN2_MOE_CONFIG)
    dist.barrier()
    losses, result = _losses(
        hf_model=str(hf),
        expert_model_parallel_size=2,
        moe_token_dispatcher_type="alltoall",
        train_iters=2,
        compare_single_process=True,
        compare_tolerance=1e-5,
        export_hf=str(directory / "exported"),
    )
    failures = [] if result.passed else ["ep2 differs from the one-process run"]
    if dist.get_rank() == 0:
        original, exported = SafetensorsReader(hf), SafetensorsReader(directory / "exported")
        if sorted(original.keys()) != sorted(exported.keys()):
            failures.append("the export's tensors differ in name from the original's")
        key = "model.layers.1.mlp.experts.3.up_proj.weight"
        everything = (slice(None), slice(None))
        if torch.equal(original.read(key, everything), exported.read(key, everything)):
            failures.append(f"{key} was not trained")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    assert_no_failures(failures)


@pytest.mark.world(2)
@pytest.mark.slow  # suite time; the HF weights at a layout: test_hf_layouts (default run)
def test_hf_weights_at_pp2_vpp2_follow_the_one_process_run():
    """Four layers over 2 pipeline ranks x 2 virtual stages: each chunk loads its own global
    layers (layer_number - 1) and the run equals the one-process one."""
    directory = _shared_dir()
    hf = directory / "hf"
    if dist.get_rank() == 0:
        write_random_hf_model(hf, dict(LLAMA_CONFIG, num_hidden_layers=4))
    dist.barrier()
    _, result = _losses(
        hf_model=str(hf),
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        train_iters=2,
        compare_single_process=True,
        compare_tolerance=1e-5,
    )
    failures = [] if result.passed else ["pp2-vpp2 differs from the one-process run"]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    assert_no_failures(failures)
