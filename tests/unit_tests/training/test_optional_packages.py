"""A missing optional package is one line naming the extra that installs it (tokenizers,
jinja2, matplotlib); an ImportError that names nothing to install stays a bug (traceback).

Each package is hidden with ``sys.modules[name] = None`` (Python then refuses to import it);
the positive control is that the same call works with the package present.
"""

import json
import sys

import pytest

from megatron.training.errors import is_usage_error, one_line, run_tool
from megatron.training.metrics import read_jsonl, save_metrics
from megatron.training.tokenizer.train_tokenizer import main as tokenizer_main

pytestmark = pytest.mark.world(1)


def _hide(monkeypatch, *names):
    for name in names:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, loaded)
        monkeypatch.setitem(sys.modules, name, None)


def test_training_a_tokenizer_without_tokenizers_is_one_line(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tokenizers")
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n")
    argv = ["train", "--input", str(corpus), "--output-dir", str(tmp_path / "tok"),
            "--vocab-size", "270"]  # fmt: skip
    assert run_tool(tokenizer_main, "megatron.training.tokenizer", argv) == 0  # control
    _hide(monkeypatch, "tokenizers")
    assert run_tool(tokenizer_main, "megatron.training.tokenizer", argv) == 1
    assert capsys.readouterr().err.splitlines() == [
        "megatron.training.tokenizer: error: training a tokenizer needs the 'tokenizers' "
        "package, which is not installed: pip install -e '.[tokenizers]' (or pip install "
        "tokenizers)"
    ]


def test_chat_templates_and_tokenizer_files_without_their_packages(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from megatron.core.tokenizers import chat_template
    from megatron.training.datasets import FileSFTDataset

    corpus = tmp_path / "c.txt"
    corpus.write_text("hi yo\n")
    tokenizer_main(["train", "--input", str(corpus), "--output-dir", str(tmp_path / "tok"),
                    "--vocab-size", "270"])  # fmt: skip
    data = tmp_path / "chat.jsonl"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    data.write_text(json.dumps({"messages": messages}) + "\n")
    assert len(FileSFTDataset(str(data), str(tmp_path / "tok"), 64, seed=0)) == 1  # control
    monkeypatch.setattr(chat_template, "_compile", chat_template._compile.__wrapped__)
    _hide(monkeypatch, "jinja2")
    with pytest.raises(ImportError) as error:
        FileSFTDataset(str(data), str(tmp_path / "tok"), 64, seed=0)
    assert is_usage_error(error.value)
    assert "'jinja2' package" in one_line(error.value) and "pip install -e '.[hf]'" in str(
        error.value
    )
    _hide(monkeypatch, "tokenizers")
    with pytest.raises(ImportError) as error:
        FileSFTDataset(str(data), str(tmp_path / "tok"), 64, seed=0)
    assert is_usage_error(error.value) and "'tokenizers' package" in str(error.value)


def test_the_plot_without_matplotlib_warns_naming_the_extra(tmp_path, monkeypatch):
    records = [{"iteration": 1, "loss": 2.0, "grad_norm": 1.0, "lr": 0.1}]
    # with matplotlib, loss.png is written: test_metrics_plot.py
    _hide(monkeypatch, "matplotlib")
    with pytest.warns(UserWarning, match=r"loss.png not written: matplotlib is not installed"
                      r".*pip install -e '.\[plot\]'"):  # fmt: skip
        written = save_metrics(str(tmp_path / "b"), records, "run")
    assert [p.name for p in written] == ["metrics.jsonl"]
    assert read_jsonl(written[0]) == records


def test_an_import_error_that_names_nothing_to_install_keeps_its_traceback():
    assert not is_usage_error(ImportError("cannot import name 'x' from 'megatron.core'"))
    assert not is_usage_error(ModuleNotFoundError("No module named 'megatron.nope'"))
