"""A HuggingFace folder must be one consistent model, and an export never destroys what it
did not write (SPEC section 8). Each case plants one fault, checks that the fault really took
effect (the positive control), and that it is refused by name with one line; no
transformers needed."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron.training.cli import main as train_cli
from megatron.training.errors import is_usage_error, one_line
from megatron.training.hf import model_from_hf
from megatron.training.hf.__main__ import main as hf_cli
from megatron.training.hf.target import INDEX_FILENAME
from tests.unit_tests.hf.hf_models import LLAMA_CONFIG, write_random_hf_model

pytestmark = pytest.mark.world(1)

TIED = dict(LLAMA_CONFIG, tie_word_embeddings=True)


def _tensors(directory: Path) -> dict:
    return load_file(str(directory / "model.safetensors"))


def _rewrite(directory: Path, change) -> None:
    tensors = _tensors(directory)
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert (
        err.count("\n") == 0
        and err.startswith("megatron.training.hf: error: ")
        and "Traceback" not in err
    ), err
    return err


def test_a_head_that_differs_from_tied_embeddings_is_refused_naming_both(tmp_path):
    hf = write_random_hf_model(tmp_path / "tied", TIED)
    _rewrite(hf, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model_from_hf(hf)  # a redundant copy equal to the embeddings is accepted
    _rewrite(hf, lambda t: t["lm_head.weight"].mul_(2.0))
    stored = _tensors(hf)
    assert not torch.equal(stored["lm_head.weight"], stored["model.embed_tokens.weight"])
    with pytest.raises(ValueError, match="tie_word_embeddings: true") as info:
        model_from_hf(hf)
    assert "'lm_head.weight'" in str(info.value)
    assert "'model.embed_tokens.weight'" in str(info.value)


def test_an_integer_weight_is_refused_naming_the_tensor(tmp_path, capsys):
    hf = write_random_hf_model(tmp_path / "int", LLAMA_CONFIG)
    key = "model.layers.1.mlp.down_proj.weight"
    _rewrite(hf, lambda t: t.update({key: (t[key] * 100).to(torch.int32)}))
    with safe_open(str(hf / "model.safetensors"), framework="pt") as handle:
        assert handle.get_slice(key).get_dtype() == "I32"  # the fault took effect
    with pytest.raises(ValueError, match=rf"tensor '{key}' has dtype I32; expected a floating"):
        model_from_hf(hf)
    assert hf_cli(["import", "--hf", str(hf), "--out", str(tmp_path / "ckpt")]) == 2
    assert key in _one_line_error(capsys)


def test_a_nan_or_inf_weight_is_refused_unless_allowed(tmp_path, capsys):
    hf = write_random_hf_model(tmp_path / "nan", LLAMA_CONFIG)
    key = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(hf, lambda t: t[key].__setitem__((3, 5), float("nan")))
    assert torch.isnan(_tensors(hf)[key]).any()  # the fault took effect
    with pytest.raises(ValueError, match=rf"tensor '{key}' holds NaN or infinite values"):
        model_from_hf(hf)
    model, _ = model_from_hf(hf, allow_non_finite=True)  # the flag loads it as it is
    assert torch.isnan(model.decoder.layers[0].self_attention.linear_qkv.weight).any()
    assert hf_cli(["import", "--hf", str(hf), "--out", str(tmp_path / "ckpt")]) == 2
    assert key in _one_line_error(capsys)
    argv = ["import", "--hf", str(hf), "--out", str(tmp_path / "ckpt"), "--allow-non-finite"]
    assert hf_cli(argv) == 0
    inf = write_random_hf_model(tmp_path / "inf", LLAMA_CONFIG)
    _rewrite(inf, lambda t: t["model.norm.weight"].__setitem__(0, float("inf")))
    with pytest.raises(ValueError, match="'model.norm.weight' holds NaN or infinite"):
        model_from_hf(inf)


def test_an_index_that_points_at_the_wrong_shard_is_one_line(tmp_path, capsys):
    hf = write_random_hf_model(tmp_path / "sharded", LLAMA_CONFIG)
    tensors = _tensors(hf)
    (hf / "model.safetensors").unlink()
    keys = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    weight_map = {}
    for name, part in halves.items():
        save_file({k: tensors[k] for k in part}, str(hf / name))
        weight_map.update({k: name for k in part})
    index = hf / INDEX_FILENAME
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model_from_hf(hf)  # the consistent sharded folder loads
    moved = keys[0]  # in shard 1; the index now says shard 2
    weight_map[moved] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with safe_open(str(hf / weight_map[moved]), framework="pt") as handle:
        assert moved not in handle.keys()  # the fault took effect
    with pytest.raises(ValueError) as info:
        model_from_hf(hf)
    message = str(info.value)
    assert all(s in message for s in (repr(moved), str(index), weight_map[moved])), message
    assert hf_cli(["import", "--hf", str(hf), "--out", str(tmp_path / "ckpt")]) == 2
    assert repr(moved) in _one_line_error(capsys)


def test_a_file_given_as_the_model_folder_says_so(tmp_path, capsys):
    hf = write_random_hf_model(tmp_path / "m", LLAMA_CONFIG)
    weights = hf / "model.safetensors"
    with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
        model_from_hf(weights)
    with pytest.raises(SystemExit):
        train_cli(["--hf-model", str(weights), "--no-progress"])
    err = capsys.readouterr().err
    assert "--hf-model" in err and "is a file" in err and "does not exist" not in err


def test_a_missing_safetensors_package_names_the_extra(tmp_path, monkeypatch):
    hf = write_random_hf_model(tmp_path / "m", LLAMA_CONFIG)
    for name in [m for m in sys.modules if m == "safetensors" or m.startswith("safetensors.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError):  # positive control: the package is really gone
        import safetensors  # noqa: F401
    with pytest.raises(ImportError, match=r"'safetensors'.*pip install -e '\.\[hf\]'") as info:
        model_from_hf(hf)
    assert is_usage_error(info.value) and "\n" not in one_line(info.value)


def _export(load, out, *extra):
    return hf_cli(["export", "--load", str(load), "--out", str(out), *extra])


@pytest.fixture
def checkpoint(tmp_path):
    hf = write_random_hf_model(tmp_path / "hf", LLAMA_CONFIG)
    assert hf_cli(["import", "--hf", str(hf), "--out", str(tmp_path / "ckpt")]) == 0
    return tmp_path / "ckpt"


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_export_into_another_models_folder_is_refused_and_leaves_it(tmp_path, checkpoint, capsys):
    other = write_random_hf_model(tmp_path / "other", dict(LLAMA_CONFIG, num_hidden_layers=1))
    (other / "README.md").write_text("someone's model\n")
    before = _snapshot(other)
    assert _export(checkpoint, other) == 2
    err = _one_line_error(capsys)
    assert str(other) in err and "not an earlier export" in err
    assert _snapshot(other) == before
    # an earlier export of ours is replaced; --overwrite allows the foreign folder
    ours = tmp_path / "ours"
    assert _export(checkpoint, ours) == 0 and _export(checkpoint, ours) == 0
    assert _export(checkpoint, other, "--overwrite") == 0
    assert (other / "README.md").read_text() == "someone's model\n"
    assert json.loads((other / "config.json").read_text())["num_hidden_layers"] == 2
    assert not list(tmp_path.glob(".*export-staging*"))


def test_a_failed_export_leaves_the_earlier_export_intact(tmp_path, checkpoint, capsys):
    out = tmp_path / "exported"
    assert _export(checkpoint, out) == 0
    before = _snapshot(out)
    assert before
    broken = tmp_path / "broken"
    os.system(f"cp -r {checkpoint} {broken}")
    data = sorted((broken / "iter_0000000").glob("*.distcp"))
    assert data
    for path in data:  # truncate every data file of the checkpoint
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    assert _export(broken, out) == 2
    err = _one_line_error(capsys)
    assert "Traceback" not in err
    assert _snapshot(out) == before
    assert not list(tmp_path.glob(".*export-staging*"))


def test_export_to_a_file_or_an_unwritable_folder_is_one_line(tmp_path, checkpoint, capsys):
    target = tmp_path / "a_file"
    target.write_text("x")
    assert _export(checkpoint, target) == 2
    assert "is a file" in _one_line_error(capsys)
    assert target.read_text() == "x"
    readonly = Path("/sys/megatron-export-test")
    try:
        readonly.mkdir()
    except OSError:
        pass  # the positive control: this folder cannot be written here
    else:
        readonly.rmdir()
        pytest.skip("/sys is writable on this machine: no read-only folder to try")
    assert _export(checkpoint, readonly / "out") == 2
    err = _one_line_error(capsys)
    assert "cannot write there" in err and "/sys" in err


def test_export_hf_equal_to_hf_model_is_refused(tmp_path, capsys):
    hf = write_random_hf_model(tmp_path / "m", LLAMA_CONFIG)
    before = _snapshot(hf)
    for target in (hf, Path(str(hf) + "/")):
        with pytest.raises(SystemExit):
            train_cli(["--hf-model", str(hf), "--export-hf", str(target), "--no-progress"])
        err = capsys.readouterr().err
        assert "--export-hf" in err and "--hf-model's folder" in err, err
    assert _snapshot(hf) == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("x")
    with pytest.raises(SystemExit):  # refused before training, not after
        train_cli(["--hf-model", str(hf), "--export-hf", str(foreign), "--no-progress"])
    assert "--export-hf" in capsys.readouterr().err
