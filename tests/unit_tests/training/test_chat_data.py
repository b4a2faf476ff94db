"""Chat-format SFT data end to end: a tokenizer trained with ``python -m
megatron.training.tokenizer train`` (ChatML template), chat / prompt-completion JSONL records,
assistant-only loss masks in plain and packed samples, truncation counts, and a CP = 2 trainer
run on packed conversations that must follow the one-process run.

Independent references: the trained labels, decoded, must read exactly as each assistant
turn's content followed by ``<|im_end|>`` (the text the template's generation block writes);
``transformers`` (when installed) reads the trained folder and gives the same ids and mask.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron.core.tokenizers.chat_template import tokenize_conversation
from megatron.training import TrainingConfig
from megatron.training.data import PackedSFTDataset
from megatron.training.datasets import FileSFTDataset
from megatron.training.errors import run_tool
from megatron.training.preprocess_data import main as preprocess_main
from megatron.training.tokenizer import load_hf_tokenizer
from megatron.training.tokenizer.train_tokenizer import CHATML_TEMPLATE
from megatron.training.tokenizer.train_tokenizer import main as tokenizer_main
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout

pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
pytest.importorskip("jinja2", reason="jinja2 (the hf extra) is not installed")

WORDS = "the quick brown fox jumps over the lazy dog hello world how are you today".split()


def _conversation(i: int) -> list:
    turns = 1 + i % 3
    messages = [{"role": "system", "content": "be brief"}] if i % 2 else []
    for t in range(turns):
        question = " ".join(WORDS[(i + t + k) % len(WORDS)] for k in range(2 + (i + t) % 4))
        answer = " ".join(WORDS[(3 * i + t + k) % len(WORDS)] for k in range(1 + (i * t) % 5))
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    return messages


def _records(n: int) -> list:
    records = []
    for i in range(n):
        messages = _conversation(i)
        if i % 4 == 3:  # TRL's conversational prompt/completion form
            records.append({"prompt": messages[:-1], "completion": messages[-1:]})
        else:
            records.append({"messages": messages})
    return records


def _write(directory: str, n: int = 24) -> tuple:
    corpus = os.path.join(directory, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write(("\n".join(" ".join(WORDS[k:] + WORDS[:k]) for k in range(len(WORDS))) + "\n") * 4)
    tokenizer_dir = os.path.join(directory, "tok")
    os.makedirs(tokenizer_dir)
    tokenizer_main(
        ["train", "--input", corpus, "--output-dir", tokenizer_dir, "--vocab-size", "300"]
    )
    data = os.path.join(directory, "chat.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for record in _records(n):
            f.write(json.dumps(record) + "\n")
    return tokenizer_dir, data


def _assistant_text(record: dict) -> str:
    messages = record.get("messages") or record["prompt"] + record["completion"]
    return "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")


@pytest.mark.world(1)
def test_trained_tokenizer_folder_is_read_by_us_and_by_transformers(tmp_path):
    tokenizer_dir, _ = _write(str(tmp_path), 4)
    tok = load_hf_tokenizer(tokenizer_dir)
    assert tok.chat_template == CHATML_TEMPLATE
    assert (tok.eod, tok.vocab["<|im_start|>"], tok.vocab["<|im_end|>"]) == (0, 1, 2)
    assert tok.vocab_size == 300 and tok.pad == tok.eod
    text = "the lazy dog — ünïcode ok"
    assert tok.detokenize(tok.tokenize(text)) == text
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    for messages in (_conversation(1), _conversation(2)):
        ref = fast.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = tokenize_conversation(tok, messages)
        assert ids == list(ref["input_ids"]) and mask == list(ref["assistant_masks"])


@pytest.mark.world(1)
def test_chat_samples_train_exactly_the_assistant_turns(tmp_path):
    tokenizer_dir, data = _write(str(tmp_path), 12)
    records = _records(12)
    dataset = FileSFTDataset(data, tokenizer_dir, 128, seed=3)
    tok = dataset.tokenizer
    assert dataset.notes == []  # nothing cut at 128 tokens
    seen = set()
    for i in range(len(records)):
        sample = dataset[i]
        trained = sample["labels"][sample["loss_mask"] == 1].tolist()
        text = tok.detokenize(trained)
        matches = [k for k, r in enumerate(records) if _assistant_text(r) == text]
        assert matches, f"sample {i}: trained text {text!r} is no record's assistant turns"
        seen.update(matches)
        # tokens and labels are one sequence shifted; the rest of the row is padding
        n = int((sample["tokens"] != tok.pad).sum())
        assert torch.equal(sample["tokens"][1:n], sample["labels"][: n - 1])
        assert not sample["loss_mask"][n:].any()
    assert len(seen) == len(records)
    # string prompt/completion records keep the plain prompt-masked layout (no template)
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "hello world", "completion": " the dog"}) + "\n")
    sample = FileSFTDataset(str(plain), tokenizer_dir, 16, seed=0)[0]
    trained = sample["labels"][sample["loss_mask"] == 1].tolist()
    assert tok.detokenize(trained) == " the dog<|endoftext|>"


@pytest.mark.world(1)
def test_packed_conversations_and_truncation_counts(tmp_path):
    tokenizer_dir, data = _write(str(tmp_path), 24)
    records = _records(24)
    lengths = {
        k: len(tokenize_conversation(load_hf_tokenizer(tokenizer_dir), _messages(r))[0])
        for k, r in enumerate(records)
    }
    seq = 96
    dataset = FileSFTDataset(data, tokenizer_dir, seq, seed=1)
    tok = dataset.tokenizer
    cut = sum(n > seq + 1 for n in lengths.values())
    assert 0 < cut < len(records)
    assert dataset.notes[0] == f"{cut} of {len(records)} records truncated to --seq-length {seq}"
    packed = PackedSFTDataset(seq, dataset.vocab_size, 1, dataset)
    assert packed.notes == dataset.notes
    documents, r, most = 0, 0, 0
    while documents < len(records):  # the first epoch, in sample order
        row, first = packed[r], documents
        bounds = row["cu_seqlens"].tolist()
        padded = row["cu_seqlens_padded"].tolist()
        for a, b, pa in zip(bounds[:-1], bounds[1:], padded[:-1]):
            if b == a:
                continue
            expected = dataset.document(documents)
            length, index = b - a, dataset._perm(0)[documents]
            assert length == min(lengths[index] - 1, seq)
            for key in ("tokens", "labels", "loss_mask"):
                assert torch.equal(row[key][pa : pa + length], expected[key])
            assert row["position_ids"][pa : pa + length].tolist() == list(range(length))
            # independent: the trained labels read as the record's assistant turns (a prefix
            # of them when the conversation was cut)
            labels = row["labels"][pa : pa + length][row["loss_mask"][pa : pa + length] == 1]
            text, want = tok.detokenize(labels.tolist()), _assistant_text(records[index])
            assert text == want if lengths[index] <= seq + 1 else want.startswith(text)
            documents += 1
        assert not row["loss_mask"][padded[-1] :].any()
        most, r = max(most, documents - first), r + 1
    assert most >= 2  # short conversations share a row


def _messages(record: dict) -> list:
    return record.get("messages") or record["prompt"] + record["completion"]


@pytest.mark.world(1)
def test_preprocessed_chat_gives_the_jsonl_samples(tmp_path):
    """preprocess_data --chat writes every record form as untrained/trained segments; the
    trainer reads the same ids and loss masks from the indexed prefix as from the JSONL."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.training.preprocess_data import main as preprocess

    tokenizer_dir, data = _write(str(tmp_path), 12)
    with open(data, "a", encoding="utf-8") as f:  # plain forms too
        f.write(json.dumps({"prompt": "hello", "completion": " world"}) + "\n")
        f.write(json.dumps({"text": "the lazy dog"}) + "\n")
    (prefix,) = preprocess(
        ["--input", data, "--output-prefix", str(tmp_path / "c"), "--chat",
         "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir]
    )  # fmt: skip
    assert prefix.endswith("c_chat_document")
    indexed = IndexedDataset(prefix)
    assert len(indexed.document_indices) == 15 and indexed.index.dtype.__name__ == "uint16"
    from_jsonl = FileSFTDataset(data, tokenizer_dir, 96, seed=2)
    from_prefix = FileSFTDataset(prefix, tokenizer_dir, 96, seed=2)
    assert from_prefix.notes == from_jsonl.notes
    for i in range(2 * len(from_jsonl)):
        a, b = from_jsonl[i], from_prefix[i]
        assert all(torch.equal(a[k], b[k]) for k in a), f"sample {i}"


@pytest.mark.world(1)
def test_tokenizer_command_errors_name_the_flag(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="--input .*nope.txt"):
        tokenizer_main(["train", "--input", str(tmp_path / "nope.txt"), "--output-dir", "."])
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello\n")
    # a missing --output-dir is created (the folder really did not exist before)
    target = tmp_path / "new" / "tok"
    assert not target.exists()
    tokenizer_main(["train", "--input", str(corpus), "--output-dir", str(target),
                    "--vocab-size", "300"])  # fmt: skip
    assert sorted(p.name for p in target.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    # a file where the folder should be: one line from the command, exit 1
    argv = ["train", "--input", str(corpus), "--output-dir", str(corpus)]
    assert run_tool(tokenizer_main, "megatron.training.tokenizer", argv) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"megatron.training.tokenizer: error: --output-dir {str(corpus)!r} is a file; expected "
        "a folder (created when missing)"
    ]
    with pytest.raises(ValueError, match="--vocab-size 100: .* at least 259"):
        tokenizer_main(["train", "--input", str(corpus), "--output-dir", str(tmp_path),
                        "--vocab-size", "100"])  # fmt: skip


@pytest.mark.world(2)
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_chat_training_at_cp2_follows_the_one_process_run(capsys, pack):
    from megatron.training.training import pretrain

    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    if dist.get_rank() == 0:
        paths = _write(directory[0], 24)
    dist.barrier()
    tokenizer_dir, data = os.path.join(directory[0], "tok"), os.path.join(
        directory[0], "chat.jsonl"
    )
    config = TrainingConfig(
        context_parallel_size=2,
        data_path=data,
        tokenizer=tokenizer_dir,
        pack_sequences=pack,
        micro_batch_size=1,
        global_batch_size=2,
        seq_length=64,
        hidden_size=16,
        num_layers=2,
        train_iters=3,
        compare_single_process=True,
        compare_tolerance=1e-5,
        allow_truncation=True,  # 12 of the 24 records are cut: the count is reported
        progress=False,
    )
    with fresh_layout():
        result = pretrain(config)
    failures = [] if result.passed else ["the comparison with the one-process run failed"]
    if dist.get_rank() == 0:
        out = capsys.readouterr().out
        assert paths[0] == tokenizer_dir
        if out.count("records truncated to --seq-length 64") != 2:  # this run + the reference
            failures.append(f"rank 0 did not report the truncation once per run: {out!r}")
        if any(r["valid_tokens"] == 0 for r in result.records):
            failures.append("an iteration had no trained tokens")
    assert_no_failures(failures)


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def _with_message(**changes) -> dict:
    """GOOD with its assistant message changed (a value None deletes the key)."""
    message = dict(GOOD["messages"][1], **changes)
    return {"messages": [GOOD["messages"][0], {k: v for k, v in message.items() if v is not None}]}


BAD_CHAT_RECORDS = {
    "content-dict": (_with_message(content={"text": "yo"}),
                     r"messages\[1\] \(assistant\): 'content' is dict \{\"text\": \"yo\"\}; "
                     "expected a string"),
    "content-number": (_with_message(content=42), r"'content' is int 42; expected a string"),
    "content-list": (_with_message(content=[{"type": "text", "text": "yo"}]),
                     r"'content' is list .*; expected a string"),
    "content-missing": (_with_message(content=None), r"'content' is missing; expected a string"),
    "content-null": ({"messages": [{"role": "user", "content": None}, GOOD["messages"][1]]},
                     r"messages\[0\] \(user\): 'content' is null"),
    "role-number": (_with_message(role=7), r"messages\[1\]: role is int 7; expected one of system"),
    "role-unknown": (_with_message(role="robot"), r"role 'robot'; expected one of"),
    "name-number": (_with_message(name=3), r"'name' is int 3; expected a string"),
    "tool-calls-dict": (_with_message(tool_calls={"f": 1}), r"'tool_calls' is .*list of objects"),
    "messages-dict": ({"messages": {"role": "user"}}, r"'messages' must be a non-empty list"),
    "message-string": ({"messages": ["hi", GOOD["messages"][1]]},
                       r"messages\[0\]: expected an object with 'role'"),
    "completion-content-dict": ({"prompt": GOOD["messages"][:1],
                                 "completion": [{"role": "assistant", "content": {"a": 1}}]},
                                r"messages\[1\] \(assistant\): 'content' is dict"),
}  # fmt: skip


@pytest.mark.world(1)
@pytest.mark.parametrize("case", sorted(BAD_CHAT_RECORDS))
def test_chat_fields_of_the_wrong_type_are_refused_with_file_and_line(tmp_path_factory, case):
    """A chat record whose field has the wrong type (before: rendered as Python text and
    trained on) is refused as FILE:LINE naming the message and field, by the trainer's
    reader and by ``preprocess_data --chat`` (one line, exit 1). Positive control: the bad
    record is line 2 of the file, and line 1 alone reads."""
    tokenizer_dir = _shared_tokenizer(tmp_path_factory)
    record, message = BAD_CHAT_RECORDS[case]
    path = tmp_path_factory.mktemp(case) / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(record) + "\n")
    assert json.loads(path.read_text().splitlines()[1]) == record
    with pytest.raises(ValueError, match=f"^{path}:2: (.* )?{message}"):
        FileSFTDataset(str(path), tokenizer_dir, 32, seed=0)
    good = path.with_name("good.jsonl")
    good.write_text(path.read_text().splitlines()[0] + "\n")
    assert len(FileSFTDataset(str(good), tokenizer_dir, 32, seed=0)) == 1


_TOKENIZER = {}


def _shared_tokenizer(tmp_path_factory) -> str:
    """One small trained ChatML tokenizer for the parametrized cases."""
    if "dir" not in _TOKENIZER:
        folder = tmp_path_factory.mktemp("shared_tok")
        corpus = folder / "corpus.txt"
        corpus.write_text("\n".join(WORDS) + "\n")
        tokenizer_main(["train", "--input", str(corpus), "--output-dir", str(folder / "tok"),
                        "--vocab-size", "280"])  # fmt: skip
        _TOKENIZER["dir"] = str(folder / "tok")
    return _TOKENIZER["dir"]


@pytest.mark.world(1)
def test_preprocess_chat_errors_are_one_line(tmp_path_factory, capsys):
    """``python -m megatron.training.preprocess_data --chat``: a bad role, a chat record
    without a chat tokenizer and a missing tokenizer file are one line each, exit 1 (before:
    tracebacks). The command line itself is run once in a subprocess."""
    tokenizer_dir = _shared_tokenizer(tmp_path_factory)
    folder = tmp_path_factory.mktemp("pre")
    bad = folder / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps(_with_message(role="robot")) + "\n")
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
    base = ["--chat", "--output-prefix", str(folder / "out"), "--input"]
    cases = [
        (base + [str(bad)] + hf + [tokenizer_dir],
         f"{bad}:2: messages[1]: role 'robot'; expected one of system, developer, user, "
         "assistant, tool"),
        (base + [str(bad)],
         f"{bad}:1: a chat record needs a tokenizer with a chat template: pass "
         "--tokenizer-type HuggingFaceTokenizer --tokenizer-model with a HuggingFace "
         "tokenizer folder (tokenizer.json + tokenizer_config.json holding chat_template)"),
        (base + [str(bad)] + hf + [str(folder / "nope")],
         f"--tokenizer-model {str(folder / 'nope')!r}: no such file (--tokenizer-type "
         "HuggingFaceTokenizer needs a tokenizers JSON file)"),
    ]  # fmt: skip
    for argv, line in cases:
        assert run_tool(preprocess_main, "megatron.training.preprocess_data", argv) == 1
        assert capsys.readouterr().err.splitlines() == [
            f"megatron.training.preprocess_data: error: {line}"
        ]
    good = folder / "good.jsonl"
    good.write_text(json.dumps(GOOD) + "\n")  # positive control: the same command works
    assert run_tool(preprocess_main, "p", base + [str(good)] + hf + [tokenizer_dir]) == 0
    done = subprocess.run(
        [sys.executable, "-m", "megatron.training.preprocess_data"] + cases[0][0],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.splitlines() == [f"megatron.training.preprocess_data: error: {cases[0][1]}"]
