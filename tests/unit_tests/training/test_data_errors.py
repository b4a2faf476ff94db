"""Bad data files are named with the line and what was wrong; truncation and records without
trained tokens are counted and reported; data with nothing to train is refused; --eod-token.

Expected counts are computed here from the records' byte lengths (byte-level tokenizer), not
read back from the dataset.
"""

import json

import pytest

from megatron.training.datasets import FileSFTDataset
from megatron.training.preprocess_data import main as preprocess

pytestmark = pytest.mark.world(1)


def _jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_jsonl_errors_name_the_file_and_line(tmp_path):
    good = json.dumps({"prompt": "a", "response": "b"})
    cases = [
        ([good, "", "{oops"], r"bad.jsonl:3: not valid JSON \(Expecting property name"),
        ([good, "42"], r"bad.jsonl:2: expected a JSON object with 'messages'.*; got int"),
        ([good, "[1, 2]"], r"bad.jsonl:2: expected a JSON object .*; got list"),
        ([json.dumps({"prompt": 1, "response": "x"})], r"bad.jsonl:1: 'prompt' is int"),
        ([json.dumps({"text": None})], r"bad.jsonl:1: 'text' is NoneType"),
        ([good, json.dumps({"q": 1})], r"bad.jsonl:2: keys \['q'\]; expected a JSON object"),
        # chat records need a tokenizer with a chat template; byte-level has none
        ([json.dumps({"messages": [{"role": "user", "content": "x"}]})], r"bad.jsonl:1: a chat"),
    ]
    for lines, match in cases:
        path = _jsonl(tmp_path / "bad.jsonl", lines)
        with pytest.raises(ValueError, match=match):
            FileSFTDataset(path, None, 16, seed=0)
    (tmp_path / "bin.jsonl").write_bytes(good.encode() + b"\n" + b'{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=r"bin.jsonl:2: not UTF-8 text"):
        FileSFTDataset(str(tmp_path / "bin.jsonl"), None, 16, seed=0)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"--data-path .*empty.jsonl.*no records"):
        FileSFTDataset(str(tmp_path / "empty.jsonl"), None, 16, seed=0)


def test_missing_data_path_and_preprocess_problems_name_the_flag(tmp_path):
    for missing in ("nope.jsonl", "nope_prefix"):
        with pytest.raises(FileNotFoundError, match=f"--data-path '.*{missing}': no such file"):
            FileSFTDataset(str(tmp_path / missing), None, 16, seed=0)
    with pytest.raises(ValueError, match="--data-path .* is a folder"):
        FileSFTDataset(str(tmp_path), None, 16, seed=0)
    data = _jsonl(tmp_path / "d.jsonl", [json.dumps({"text": "hi"})])
    with pytest.raises(FileNotFoundError, match="--output-prefix .*the folder .*no_dir.* does not"):
        preprocess(["--input", data, "--output-prefix", str(tmp_path / "no_dir" / "out")])
    with pytest.raises(NotADirectoryError, match="--output-prefix .*d.jsonl.* is a file; expected"):
        preprocess(["--input", data, "--output-prefix", str(tmp_path / "d.jsonl" / "out")])
    with pytest.raises(FileNotFoundError, match="--input .*nope.jsonl.*no such file"):
        preprocess(["--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="--tokenizer-model None"):
        preprocess(
            ["--input", data, "--output-prefix", str(tmp_path / "o"),
             "--tokenizer-type", "HuggingFaceTokenizer"]
        )  # fmt: skip
    bad = _jsonl(tmp_path / "bad.jsonl", [json.dumps({"text": "hi"}), "42"])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object .* got int"):
        preprocess(["--input", bad, "--output-prefix", str(tmp_path / "o")])
    bad = _jsonl(tmp_path / "bad.jsonl", ["", "{x"])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        preprocess(["--input", bad, "--output-prefix", str(tmp_path / "o")])
    (tmp_path / "bin.jsonl").write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=r"bin.jsonl:2: not UTF-8 text"):
        preprocess(["--input", str(tmp_path / "bin.jsonl"), "--output-prefix", str(tmp_path / "o")])
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"version": "1.0", "truncation": null, "model": {')
    with pytest.raises(ValueError, match=r"tokenizer.json: not a valid"):
        preprocess(
            ["--input", data, "--output-prefix", str(tmp_path / "o"),
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok)]
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"tokenizer.json: not a valid"):
        FileSFTDataset(data, str(tok), 16, seed=0)


def test_truncation_and_records_without_loss_tokens_are_counted(tmp_path):
    seq = 12
    records = [
        {"prompt": "ab", "response": "cd"},  # 5 tokens with EOD: fits
        {"prompt": "abcdef", "response": "ghijkl"},  # 13 tokens = seq + 1: fits exactly
        {"prompt": "abcdefgh", "response": "ijklmnop"},  # 17 > 13: cut, still trains
        {"prompt": "a" * 20, "response": "z"},  # cut inside the prompt: no loss token left
        {"text": "x" * 30},  # cut, trains
        {"prompt": "abcdefghijklm", "response": "n"},  # 15 > 13: the prompt fills it
    ]
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in records])
    lengths = [len(r.get("prompt", "")) + len(r.get("response", r.get("text", ""))) + 1
               for r in records]  # fmt: skip
    cut = sum(n > seq + 1 for n in lengths)
    # labels 1..seq of the record are in the sample; the prompt's labels are not trained
    no_loss = sum(len(r.get("prompt", "")) >= seq + 1 for r in records)
    assert (cut, no_loss) == (4, 2)
    dataset = FileSFTDataset(path, None, seq, seed=0)
    assert dataset.notes == [
        f"{cut} of 6 records truncated to --seq-length {seq}",
        f"warning: {no_loss} of 6 records have no loss tokens within --seq-length {seq} "
        "(their prompt fills the sequence, or they train nothing); they add no gradient",
    ]
    trained = [int(dataset[i]["loss_mask"].sum()) for i in range(len(records))]
    assert sorted(trained) == sorted([3, 7, 5, 0, 12, 0])
    fits = FileSFTDataset(path, None, 64, seed=0)
    assert fits.notes == []


def test_data_with_nothing_trainable_is_refused_naming_the_flag(tmp_path):
    records = [{"prompt": "p" * 40, "response": "r"} for _ in range(3)]
    path = _jsonl(tmp_path / "long.jsonl", [json.dumps(r) for r in records])
    with pytest.raises(ValueError, match=r"nothing to train on at --seq-length 16: none of the "
                       r"3 records .* \(3 of 3 records are longer"):  # fmt: skip
        FileSFTDataset(path, None, 16, seed=0)
    assert FileSFTDataset(path, None, 48, seed=0).notes == []


def test_eod_token_chooses_the_end_of_document_id(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    vocab = {"<pad>": 0, "<|endoftext|>": 1, "[UNK]": 2, "hi": 3, "</doc>": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"text": "hi hi"})])
    default = FileSFTDataset(path, str(tmp_path / "tokenizer.json"), 4, seed=0)
    assert default[0]["tokens"].tolist() == [3, 3, 1, 0]
    chosen = FileSFTDataset(path, str(tmp_path), 4, seed=0, eod_token="</doc>")
    assert chosen.eod == 4 and chosen[0]["tokens"].tolist() == [3, 3, 4, 0]
    (prefix,) = preprocess(
        ["--input", path, "--output-prefix", str(tmp_path / "p"), "--append-eod",
         "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path),
         "--eod-token", "</doc>"]
    )  # fmt: skip
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert IndexedDataset(prefix)[0].tolist() == [3, 3, 4]
    with pytest.raises(ValueError, match="--eod-token '<nope>': not a token of"):
        FileSFTDataset(path, str(tmp_path), 4, seed=0, eod_token="<nope>")
    with pytest.raises(ValueError, match="--eod-token '</doc>': the byte-level"):
        FileSFTDataset(path, None, 4, seed=0, eod_token="</doc>")


def test_plain_records_start_with_the_tokenizers_own_prefix(tmp_path):
    """A tokenizer whose post-processor puts BOS before a text (Llama style): plain-text
    records start with it, as tokenizer(text) gives, and it is never trained."""
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "[UNK]": 3, "hi": 4, "yo": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 2)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    assert tok.encode("hi yo").ids == [2, 4, 5]
    path = _jsonl(
        tmp_path / "d.jsonl",
        [json.dumps({"text": "hi yo"}), json.dumps({"prompt": "hi", "completion": "yo"})],
    )
    dataset = FileSFTDataset(path, str(tmp_path), 5, seed=0)
    for i in range(2):  # both records read <s> hi yo </s>
        assert dataset[i]["tokens"].tolist() == [2, 4, 5, 1, 0]
        assert dataset[i]["labels"].tolist()[:3] == [4, 5, 1]
    masks = sorted(dataset[i]["loss_mask"].tolist() for i in range(2))
    # prompt/completion trains yo and </s>; text trains every label; <s> is never a label
    assert masks == [[0.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]]


def test_the_trainer_stops_when_more_than_a_tenth_of_the_records_would_be_cut(tmp_path):
    """More than 10% of the records longer than --seq-length + 1: an error naming the count,
    the longest record and --seq-length / --allow-truncation; at 10% or with the flag the
    count is a note."""
    from megatron.training import TrainingConfig
    from megatron.training.datasets import build_sft_dataset

    records = [{"text": "x" * 30}] + [{"text": "ab"}] * 9  # 1 of 10 cut (31 tokens)
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in records])
    config = TrainingConfig(data_path=path, seq_length=12)
    assert build_sft_dataset(config).notes == ["1 of 10 records truncated to --seq-length 12"]
    records[1] = {"text": "y" * 20}  # 2 of 10
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in records])
    with pytest.raises(ValueError, match=r"2 of 10 records \(20%, more than 10%\) .* longest "
                       r"has 31\); raise --seq-length, or pass --allow-truncation"):  # fmt: skip
        build_sft_dataset(TrainingConfig(data_path=path, seq_length=12))
    allowed = build_sft_dataset(
        TrainingConfig(data_path=path, seq_length=12, allow_truncation=True)
    )
    assert allowed.notes == ["2 of 10 records truncated to --seq-length 12"]
