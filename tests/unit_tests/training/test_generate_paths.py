"""``python -m megatron.training.generate`` on the paths people take (issue 38).

Default run (one process, no model trained): the decoding flags are checked by name
(temperature 0 is greedy, top-k 0 and top-p 1 are off); a bad command line, prompt or adapter
is refused in one line before any model is built; only rank 0 prints; ``MEGATRON_DEBUG=1``
shows the traceback; a completion stops at any stop id (the chat template's turn end of a
tokenizer made by our tool, its eos) and never ends in a broken character; a PEFT adapter's
``target_modules`` become our targets (generate and the trainer); importing generate costs
no torch and ``jit_fuser`` compiles on first call only.

Slow (``-m slow``): generation from every kind of checkpoint the trainer writes (a full
``--data-path`` run, adapter-only, HuggingFace, HuggingFace + adapter, MoE) at one process
and at TP x PP (x EP) on 4 ranks prints the one-process completion; a damaged checkpoint is
one line; a chat model made with our tokenizer tool stops at its turn end.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.training.errors import UsageError
from megatron.training.generate import Sampling, _choose, generate, main
from tests.unit_tests.dist_utils import fresh_layout
from tests.unit_tests.hf.hf_models import (
    GPT2_CONFIG,
    LLAMA_CONFIG,
    QWEN2_MOE_CONFIG,
    write_random_hf_model,
)

PROMPT = "3 17 42 5"
ROOT = Path(__file__).resolve().parents[3]


def _main(*argv) -> "tuple[int, str, str]":
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), fresh_layout():
        code = main([str(a) for a in argv])
    return code, out.getvalue().strip(), err.getvalue().strip()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate-models")
    gpt2 = dict(GPT2_CONFIG, n_positions=16)  # a position table shorter than --seq-length
    return {
        "llama": write_random_hf_model(root / "llama", LLAMA_CONFIG, std=0.5),
        "gpt2_16": write_random_hf_model(root / "gpt2_16", gpt2, std=0.5),
        "moe": write_random_hf_model(root / "moe", QWEN2_MOE_CONFIG, std=0.5),
    }


# ----------------------------------------------------------------------------- default run


@pytest.mark.world(1)
def test_decoding_flags_are_checked_by_name_and_zero_means_greedy_or_off():
    for kwargs, flag in (
        (dict(temperature=-1.0), "--temperature -1.0: expected a number >= 0"),
        (dict(top_p=0.0), r"--top-p 0.0: expected a number in \(0, 1\]"),
        (dict(top_p=1.5), r"--top-p 1.5: expected a number in \(0, 1\]"),
        (dict(top_k=-1), "--top-k -1: expected an integer >= 0"),
        (dict(temperature=float("nan")), "--temperature nan"),
    ):
        with pytest.raises(UsageError, match=flag):
            Sampling(**kwargs)
    logits = torch.randn(32, generator=torch.Generator().manual_seed(0))
    best = int(logits.argmax())

    def draws(sampling):
        generator = torch.Generator().manual_seed(7)
        return [_choose(logits, sampling, generator) for _ in range(30)]

    assert set(draws(Sampling(temperature=0.0))) == {best}  # greedy, not temperature 1
    assert set(draws(Sampling(temperature=0.0, top_k=5, top_p=0.5))) == {best}
    assert Sampling(top_k=0).greedy and Sampling(top_p=1.0).greedy  # both off
    # top-k 0 with a temperature: no top-k cut (the draws of plain temperature sampling)
    assert draws(Sampling(temperature=1.0, top_k=0)) == draws(Sampling(temperature=1.0))
    assert len(set(draws(Sampling(temperature=1.0, top_k=0)))) > 5


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-new-tokens", "-2"], "--max-new-tokens -2: expected an integer >= 1"),
        (["--temperature", "-1"], "--temperature -1.0: expected a number >= 0"),
        (["--top-p", "0"], r"--top-p 0.0: expected a number in (0, 1]"),
        (["--prompt-ids", "1 2 300"], "token id 300 is outside the model's vocabulary (ids 0"),
        (["--prompt-ids", "1 x"], "--prompt-ids '1 x': expected token ids (integers)"),
        (["--hf-adapter", "{tmp}/none"], "--hf-adapter {tmp}/none: no such folder"),
        (["--prompt", "hi"], "this model has no tokenizer"),
        (["--prompts-file", "{tmp}/p.txt"], "--prompts-file {tmp}/p.txt: no such file"),
    ],
    ids=["max-new-tokens", "temperature", "top-p", "id-beyond-vocab", "ids-not-ints",
         "missing-adapter", "text-without-tokenizer", "missing-prompts-file"],
)  # fmt: skip
def test_bad_input_is_one_line_before_any_model(models, tmp_path, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if not any(a.startswith("--prompt") for a in argv):
        argv += ["--prompt-ids", PROMPT]
    code, out, err = _main("--hf-model", models["llama"], *argv)
    assert (code, out) == (2, "")
    assert len(err.splitlines()) == 1 and err.startswith("megatron.training.generate: error: ")
    assert message.replace("{tmp}", str(tmp_path)) in err


@pytest.mark.world(1)
def test_load_with_hf_adapter_and_a_short_position_table_speak_generates_language(models, tmp_path):
    code, _, err = _main("--load", tmp_path, "--hf-adapter", tmp_path, "--prompt-ids", PROMPT)
    assert code == 2 and f"--hf-adapter {tmp_path} applies to --hf-model BASE" in err
    code, _, err = _main("--hf-model", models["gpt2_16"], "--prompt-ids", PROMPT,
                         "--max-new-tokens", "13")  # fmt: skip
    assert code == 2 and "--seq-length" not in err
    assert "prompt 1 (4 tokens) + --max-new-tokens 13 = 17 positions, but the model's " in err
    assert "learned position table has 16" in err
    code, out, _ = _main("--hf-model", models["gpt2_16"], "--prompt-ids", PROMPT,
                         "--max-new-tokens", "12")  # fmt: skip
    assert code == 0 and len(out.split()) == 12


@pytest.mark.world(1)
def test_only_rank_0_prints_and_megatron_debug_shows_the_traceback(models, monkeypatch):
    """RANK decides who prints (is_rank_zero() is true everywhere once generate has torn
    its groups down); with MEGATRON_DEBUG=1 a refused flag raises, as in the trainer."""
    argv = ["--hf-model", models["llama"], "--prompt-ids", PROMPT, "--max-new-tokens", "2"]
    code, out, _ = _main(*argv)
    assert code == 0 and len(out.split()) == 2
    monkeypatch.setenv("RANK", "1")
    assert _main(*argv) == (0, "", "")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MEGATRON_DEBUG", "1")
    with pytest.raises(UsageError, match="--top-p 2.0"):
        _main(*argv, "--top-p", "2")


def _chat_tokenizer(directory: Path) -> Path:
    from megatron.training.tokenizer.train_tokenizer import train_tokenizer

    corpus = directory / "corpus.txt"
    corpus.write_text("hello there, how are you? é è ü\n" * 3 + "fine thanks\n" * 3)
    return Path(train_tokenizer([str(corpus)], str(directory / "tok"), vocab_size=300))


@pytest.mark.world(1)
def test_a_tool_made_chat_tokenizer_stops_at_its_turn_end_and_holds_back_broken_characters(
    tmp_path,
):
    from megatron.training.tokenizer.generation import ByteCodec, generation_codec

    codec = generation_codec(str(_chat_tokenizer(tmp_path)))
    vocab = codec.tokenizer.get_vocab()
    # eos_token is <|endoftext|> (the end of a document); the ChatML turn ends with <|im_end|>
    assert codec.stop_ids == {vocab["<|endoftext|>"], vocab["<|im_end|>"]}
    rendered = codec.tokenizer.decode(codec.encode("hi", chat=True), skip_special_tokens=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = codec.tokenizer.encode("fine €", add_special_tokens=False).ids  # € unseen: 3 bytes
    assert codec.decode(ids) == "fine €"
    assert codec.decode(ids[:-1]) == codec.decode(ids[:-2]) == "fine "  # held back, no U+FFFD
    assert ByteCodec().decode(list("aé".encode())[:-1]) == "a"
    assert ByteCodec().decode(list("aé".encode())) == "aé"


@pytest.mark.world(1)
def test_generation_stops_at_any_of_the_stop_ids(models):
    from megatron.training.hf import model_from_hf

    model, _ = model_from_hf(models["llama"])
    model.eval()
    prompt = [int(t) for t in PROMPT.split()]
    free = generate([model], prompt, 6, vocab_size=128)
    k = [i for i in range(1, 5) if free[i] not in free[:i]][-1]  # a first occurrence, not last
    stopped = generate([model], prompt, 6, vocab_size=128, eos_id={free[k], 1000})
    assert stopped == free[: k + 1]
    assert generate([model], prompt, 6, vocab_size=128, eos_id=free[k]) == stopped


def _peft_folder(directory: Path, targets, r: int = 4) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": targets}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.world(1)
def test_an_adapters_target_modules_become_the_lora_targets(models, tmp_path):
    from megatron.training.arguments import TrainingConfig
    from megatron.training.hf import read_hf_config
    from megatron.training.hf.peft import lora_settings_of_peft
    from megatron.training.hf_settings import resolve_hf_model

    arch, _ = read_hf_config(models["moe"])
    attention = _peft_folder(tmp_path / "a", ["q_proj", "k_proj", "v_proj", "o_proj"])
    settings = lora_settings_of_peft(attention, arch)
    layers = ("linear_qkv", "linear_proj")
    assert settings["lora_target_modules"] == tuple(
        f"decoder.layers.{i}.self_attention.{m}" for i in (0, 1) for m in layers
    )
    assert (settings["lora_dim"], settings["lora_alpha"]) == (4, 8.0)
    # a regular expression, as PEFT reads a string: layer 0's dense MLP only
    mlp0 = _peft_folder(tmp_path / "b", r"model\.layers\.0\.mlp\.(gate|up|down)_proj")
    assert lora_settings_of_peft(mlp0, arch)["lora_target_modules"] == (
        "decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc2")  # fmt: skip
    # exclusions and layers_to_transform, as PEFT applies them
    excluded = _peft_folder(tmp_path / "d", ["q_proj", "k_proj", "v_proj", "o_proj"])
    raw = json.loads((excluded / "adapter_config.json").read_text())
    raw["exclude_modules"] = r"model\.layers\.1\..*"
    (excluded / "adapter_config.json").write_text(json.dumps(raw))
    layer0 = settings["lora_target_modules"][:2]
    assert lora_settings_of_peft(excluded, arch)["lora_target_modules"] == layer0
    raw.update(exclude_modules=None, layers_to_transform=[0])
    (excluded / "adapter_config.json").write_text(json.dumps(raw))
    assert lora_settings_of_peft(excluded, arch)["lora_target_modules"] == layer0
    with pytest.raises(ValueError, match="adapts .*q_proj but not .*k_proj.*v_proj"):
        lora_settings_of_peft(_peft_folder(tmp_path / "c", ["q_proj"]), arch)
    # the trainer: --hf-adapter without --lora-target-modules takes the adapter's targets
    config = TrainingConfig(hf_model=str(models["moe"]), lora_dim=4, lora_alpha=8.0,
                            hf_adapter=str(attention))  # fmt: skip
    assert resolve_hf_model(config).lora_target_modules == settings["lora_target_modules"]
    given = TrainingConfig(hf_model=str(models["moe"]), lora_dim=4, hf_adapter=str(attention),
                           lora_target_modules=("linear_qkv",))  # fmt: skip
    assert resolve_hf_model(given).lora_target_modules == ("linear_qkv",)


@pytest.mark.world(1)
def test_the_trainers_hf_adapter_takes_the_adapters_rank_and_alpha(models, tmp_path):
    """``--hf-model M --hf-adapter A`` alone: r and lora_alpha from A's adapter_config.json
    (a run's own --lora-dim stays, and a different one is refused when the adapter loads)."""
    from megatron.training.arguments import TrainingConfig, validate_config
    from megatron.training.hf_settings import resolve_hf_model

    folder = _peft_folder(tmp_path / "a", ["q_proj", "k_proj", "v_proj", "o_proj"], r=2)
    config = resolve_hf_model(TrainingConfig(hf_model=str(models["moe"]), hf_adapter=str(folder)))
    assert (config.lora_dim, config.lora_alpha) == (2, 8.0)
    validate_config(config, 1)  # was: "--hf-adapter ... needs --lora-dim R"
    own = TrainingConfig(hf_model=str(models["moe"]), hf_adapter=str(folder), lora_dim=4)
    assert resolve_hf_model(own).lora_dim == 4


@pytest.mark.world(1)
def test_generate_with_a_moe_adapter_builds_the_adapters_targets(models, tmp_path):
    from safetensors.torch import save_file

    from megatron.training.hf import read_hf_config
    from megatron.training.hf.peft import adapter_shapes, lora_of_settings, to_peft

    arch, _ = read_hf_config(models["moe"])
    folder = _peft_folder(tmp_path / "ad", ["q_proj", "k_proj", "v_proj", "o_proj"])
    targets = ["linear_qkv", "linear_proj"]
    lora = lora_of_settings(dict(lora_dim=4, lora_alpha=8, lora_target_modules=targets))
    generator = torch.Generator().manual_seed(0)
    ours = {k: torch.randn(s, generator=generator) for k, s in adapter_shapes(arch, lora).items()}
    tensors, _ = to_peft(ours, arch, lora)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    base = _main("--hf-model", models["moe"], "--prompt-ids", PROMPT, "--max-new-tokens", "4")
    adapted = _main("--hf-model", models["moe"], "--hf-adapter", folder, "--prompt-ids", PROMPT,
                    "--max-new-tokens", "4")  # fmt: skip
    assert base[0] == adapted[0] == 0, adapted[2]
    assert base[1] != adapted[1]  # the adapter changes the tokens (B is not zero)


@pytest.mark.world(1)
def test_generate_help_imports_no_torch_and_jit_fuser_compiles_on_first_call(monkeypatch):
    code = "import sys, megatron.training.generate as g; g.build_parser(); "
    code += "print('torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)  # fmt: skip
    assert out.stdout.strip() == "False", out.stderr
    from megatron.core import jit

    calls = []
    monkeypatch.setattr(torch, "compile", lambda f: calls.append(f) or f)
    fused = jit.jit_fuser(lambda x: x + 1)
    assert calls == []  # nothing compiled (nor torch._inductor imported) at decoration
    assert fused(1) == 2 and fused(2) == 3 and len(calls) == 1


@pytest.mark.world(1)
def test_the_tokenizer_tool_refuses_empty_text_foreign_bytes_and_an_existing_tokenizer(
    tmp_path, capsys
):
    from megatron.training.tokenizer.train_tokenizer import main as tokenizer_main

    empty, bad = tmp_path / "empty.txt", tmp_path / "bad.txt"
    empty.write_text("\n\n")
    bad.write_bytes(b"fine\n\xff\xfe not utf-8\n")
    out = tmp_path / "tok"
    with pytest.raises(ValueError, match=f"--input {empty}: no text in these files"):
        tokenizer_main(["train", "--input", str(empty), "--output-dir", str(out)])
    with pytest.raises(ValueError, match=f"{bad}:2: not UTF-8 text \\(byte 0xff at column 1\\)"):
        tokenizer_main(["train", "--input", str(bad), "--output-dir", str(out)])
    assert not out.exists()
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello\n")
    train = ["train", "--input", str(corpus), "--output-dir", str(out), "--vocab-size"]
    tokenizer_main(train + ["300"])
    note = "note: the vocabulary has 259 tokens, fewer than --vocab-size 300"
    assert note in capsys.readouterr().out
    before = (out / "tokenizer.json").read_text()
    with pytest.raises(ValueError, match="already holds tokenizer.json, tokenizer_config.json; "
                       "refusing to replace a tokenizer"):  # fmt: skip
        tokenizer_main(train + ["270"])
    assert (out / "tokenizer.json").read_text() == before
    tokenizer_main(train + ["270", "--overwrite", "--chat-template", "none"])
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())


# ----------------------------------------------------------------------------- slow: the matrix

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
             micro_batch_size=1, global_batch_size=4, progress=False, lr=1e-2)  # fmt: skip
KINDS = ("full_data_path", "adapter_only", "hf", "hf_adapter", "moe", "hf_moe_adapter")
DENSE_LAYOUTS = (("--tp", "2", "--pp", "2"),)
MOE_LAYOUTS = DENSE_LAYOUTS + (("--tp", "2", "--ep", "2", "--etp", "1"), ("--ep", "4"))


def _pretrain(**settings) -> None:
    from megatron.training import TrainingConfig
    from megatron.training.training import pretrain

    with fresh_layout():
        assert pretrain(TrainingConfig(**{**SMALL, **settings})).passed


def _hf_adapter(base: Path, folder: Path) -> Path:
    """A PEFT folder of random (non-zero) attention adapters for HF model ``base``."""
    from safetensors.torch import save_file

    from megatron.training.hf import read_hf_config
    from megatron.training.hf.peft import adapter_shapes, lora_of_settings, to_peft

    arch, _ = read_hf_config(base)
    _peft_folder(folder, ["q_proj", "k_proj", "v_proj", "o_proj"])
    targets = ["linear_qkv", "linear_proj"]
    lora = lora_of_settings(dict(lora_dim=4, lora_alpha=8, lora_target_modules=targets))
    generator = torch.Generator().manual_seed(1)
    ours = {k: torch.randn(s, generator=generator) for k, s in adapter_shapes(arch, lora).items()}
    tensors, _ = to_peft(ours, arch, lora)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / ADAPTER_FILE))
    return folder


ADAPTER_FILE = "adapter_model.safetensors"


def _model_args(root: Path, kind: str, writer: bool) -> list:
    """The generate arguments of a model of ``kind`` under ``root``; the trainer runs on
    every rank of the launch, files are written by ``writer`` alone."""
    from tests.unit_tests.hf.hf_models import MOE_TRAINER_SETTINGS

    if kind == "full_data_path":  # byte-level tokenizer, recorded vocabulary 258
        if writer:
            (root / "d.jsonl").write_text('{"text": "hello there"}\n' * 4)
        _barrier()
        _pretrain(data_path=str(root / "d.jsonl"), train_iters=2, save=str(root / kind))
        return ["--load", root / kind, "--prompt", "he"]
    if kind == "adapter_only":
        _pretrain(train_iters=2, save=str(root / "base"))
        _pretrain(train_iters=2, lora_dim=4, lora_b_init_method="normal",
                  pretrained_checkpoint=str(root / "base"), save_trainable_params_only=True,
                  save=str(root / kind))  # fmt: skip
        return ["--load", root / kind, "--prompt-ids", PROMPT]
    if kind == "moe":
        _pretrain(train_iters=2, save=str(root / kind), **MOE_TRAINER_SETTINGS)
        return ["--load", root / kind, "--prompt-ids", PROMPT]
    config = QWEN2_MOE_CONFIG if "moe" in kind else LLAMA_CONFIG
    if writer:
        write_random_hf_model(root / kind, config, std=0.5)
        if "adapter" in kind:
            _hf_adapter(root / kind, root / f"{kind}-adapter")
    _barrier()
    adapter = ["--hf-adapter", root / f"{kind}-adapter"] if "adapter" in kind else []
    return ["--hf-model", root / kind, *adapter, "--prompt-ids", PROMPT]


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


@pytest.mark.slow
@pytest.mark.world(1)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_checkpoint_generates_in_one_process(tmp_path, kind):
    argv = _model_args(tmp_path, kind, writer=True)
    code, out, err = _main(*argv, "--max-new-tokens", "5")
    assert code == 0, err
    assert out and (kind == "full_data_path" or len(out.split()) == 5)


@pytest.mark.slow
@pytest.mark.world(4)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_checkpoint_prints_the_same_tokens_at_tp_pp_and_ep(kind):
    """At TP 2 x PP 2 (and, for MoE, TP 2 x EP 2 and EP 4) the launch prints, on rank 0
    only, the completion of TP 1 x PP 1 (every rank a whole model)."""
    import shutil
    import tempfile

    import torch.distributed as dist

    shared = [tempfile.mkdtemp(prefix="generate-matrix-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    root = Path(shared[0])
    try:
        argv = [*_model_args(root, kind, writer=dist.get_rank() == 0), "--max-new-tokens", "6"]
        code, expected, err = _main(*argv)
        assert code == 0, err
        for layout in MOE_LAYOUTS if "moe" in kind else DENSE_LAYOUTS:
            code, printed, err = _main(*argv, *layout)
            assert code == 0, err
            assert printed == (expected if dist.get_rank() == 0 else ""), layout
    finally:
        _barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.world(1)
def test_a_damaged_checkpoint_is_one_line(tmp_path):
    """A changed byte in what generate reads (the common state, or every weight of the
    shards) is one line naming the file, as the trainer reports it (it was a traceback)."""
    argv = _model_args(tmp_path, "full_data_path", writer=True)
    iteration = tmp_path / "full_data_path" / "iter_0000002"
    for damaged in (iteration / "common.pt", sorted(iteration.glob("*.distcp"))[0]):
        original = damaged.read_bytes()
        damaged.write_bytes(bytes(b ^ 0xFF for b in original[:64]) + original[64:])
        if damaged.suffix == ".distcp":  # past the header: the stored tensors themselves
            damaged.write_bytes(original[:64] + bytes(b ^ 0x01 for b in original[64:]))
        code, out, err = _main(*argv, "--max-new-tokens", "2")
        assert (code, out) == (2, "") and len(err.splitlines()) == 1, err
        assert damaged.name in err and "checksum mismatch" in err, err
        damaged.write_bytes(original)


@pytest.mark.slow
@pytest.mark.world(1)
def test_a_chat_model_made_with_our_tokenizer_tool_stops_at_its_turn_end(tmp_path):
    """A tokenizer from ``tokenizer train`` (ChatML; eos_token <|endoftext|>), a model trained
    to answer "fine thanks" and end its turn with <|im_end|>: generate --chat prints the answer
    and stops there (it used to run on to --max-new-tokens)."""
    tok = _chat_tokenizer(tmp_path)
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "fine thanks"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": turn}) + "\n")
    _pretrain(data_path=str(tmp_path / "chat.jsonl"), tokenizer=str(tok), num_layers=1,
              seq_length=64, global_batch_size=2, micro_batch_size=2, train_iters=30,
              save=str(tmp_path / "ck"))  # fmt: skip
    code, out, err = _main("--load", tmp_path / "ck", "--chat", "--prompt", "hi",
                           "--max-new-tokens", "20")  # fmt: skip
    assert (code, out) == (0, "fine thanks"), err


@pytest.mark.world(1)
def test_a_data_path_runs_recorded_settings_build_a_model_config_and_a_byte_tokenizer(
    monkeypatch,
):
    """What a --data-path run records (its vocabulary, 258 for byte-level, and the data
    path) gives a valid model config and the byte-level tokenizer; it was refused as
    "--vocab-size 258 is not used with --data-path". (End to end: the slow matrix.)"""
    import dataclasses

    from megatron.training import generate as g
    from megatron.training.arguments import TrainingConfig

    recorded = dataclasses.asdict(TrainingConfig(data_path="d.jsonl")) | {"vocab_size": 258}
    monkeypatch.setattr(g, "_checkpoint_settings", lambda load: (recorded, {}))
    args = g.build_parser().parse_args(["--load", "CK", "--prompt", "hé"])
    config = g._model_config(args)
    g._layout(config)  # valid
    assert (config.vocab_size, config.data_path, config.tokenizer) == (258, None, None)
    assert g._tokenizer_spec(args) == ("byte-level", None, [])
    codec = g._codec(args)
    assert codec.encode("hé") == [104, 0xC3, 0xA9] and codec.stop_ids == {256}


@pytest.mark.slow
@pytest.mark.world(1)
def test_an_adapter_only_checkpoint_generates_from_another_directory(tmp_path, monkeypatch):
    """The base of an adapter-only checkpoint given as a relative path is found from any
    directory (the checkpoint's recorded absolute path of its base)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    _pretrain(train_iters=2, save="base")
    lora = dict(lora_dim=4, lora_b_init_method="normal", save_trainable_params_only=True)
    _pretrain(train_iters=2, pretrained_checkpoint="base", save="lora", **lora)
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, out, err = _main("--load", tmp_path / "run" / "lora", "--prompt-ids", PROMPT,
                           "--max-new-tokens", "3")  # fmt: skip
    assert code == 0, err
    assert len(out.split()) == 3, out
