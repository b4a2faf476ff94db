"""The trainer on real data: JSONL and indexed datasets, the tokenizers, the preprocessing
tool, and the learning-rate schedule.

References are written out by hand: the prompt-masked sample of a record (bytes of prompt +
response + EOD, loss on the response labels), the schedule's closed form per iteration. The
distributed case trains from an indexed dataset at CP = 2, PP = 2 with warm-up and cosine
decay and must follow the one-process run.
"""

import json
import math
import os
import tempfile

import numpy
import pytest
import torch
import torch.distributed as dist

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training import TrainingConfig, validate_config
from megatron.training.arguments import parse_args
from megatron.training.datasets import FileSFTDataset
from megatron.training.preprocess_data import main as preprocess
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout

RECORDS = [
    {"prompt": "abc", "response": "cba"},
    {"prompt": "hello ", "response": "olleh"},
    {"prompt": "xy", "response": "yx"},
    {"prompt": "é!", "response": "!é"},  # two-byte UTF-8
    {"prompt": "a long prompt that gets cut", "response": "never seen"},
]


def _write_jsonl(directory: str) -> str:
    path = os.path.join(directory, "sft.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for record in RECORDS:
            f.write(json.dumps(record) + "\n")
    return path


def _expected_sample(record: dict, seq_length: int):
    """Byte-level ids: prompt, response, EOD (256), PAD (257); loss on labels t with
    len(prompt) <= t + 1 < len(body)."""
    prompt, response = record["prompt"].encode(), record["response"].encode()
    body = list(prompt) + list(response) + [256]
    x = (body + [257] * (seq_length + 1))[: seq_length + 1]
    n = min(len(body), seq_length + 1)
    mask = [1.0 if len(prompt) <= t + 1 < n else 0.0 for t in range(seq_length)]
    return x[:-1], x[1:], mask


@pytest.mark.world(1)
def test_jsonl_and_preprocessed_indexed_data_give_the_same_masked_samples(tmp_path):
    jsonl = _write_jsonl(str(tmp_path))
    (prefix,) = preprocess(["--input", jsonl, "--output-prefix", str(tmp_path / "d"), "--sft"])
    indexed = IndexedDataset(prefix)
    assert indexed.index.dtype == numpy.uint16 and len(indexed.document_indices) == 6
    seq = 16
    from_jsonl = FileSFTDataset(jsonl, None, seq, seed=5)
    from_prefix = FileSFTDataset(prefix, "byte-level", seq, seed=5)
    assert from_jsonl.vocab_size == 258
    seen = set()
    for i in range(2 * len(RECORDS)):  # two epochs: every record once per epoch
        a, b = from_jsonl[i], from_prefix[i]
        assert all(torch.equal(a[k], b[k]) for k in a)
        matches = [r for r in RECORDS if _expected_sample(r, seq)[0] == a["tokens"].tolist()]
        assert len(matches) == 1
        tokens, labels, mask = _expected_sample(matches[0], seq)
        assert a["labels"].tolist() == labels and a["loss_mask"].tolist() == mask
        seen.add((i // len(RECORDS), matches[0]["prompt"]))
    assert len(seen) == 2 * len(RECORDS)
    batch = from_jsonl.global_batch(1, 4)
    assert batch["tokens"].shape == (4, seq) and torch.equal(
        batch["tokens"][0], from_jsonl[4]["tokens"]
    )


@pytest.mark.world(1)
def test_text_records_train_every_token_and_plain_mode_writes_megatron_names(tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text(json.dumps({"text": "hi there"}) + "\n")
    (prefix,) = preprocess(
        ["--input", str(path), "--output-prefix", str(tmp_path / "t"), "--append-eod"]
    )
    assert prefix.endswith("t_text_document")
    assert IndexedDataset(prefix)[0].tolist() == list(b"hi there") + [256]
    sample = FileSFTDataset(prefix, None, 12, seed=0)[0]
    assert sample["loss_mask"].tolist() == [1.0] * 8 + [0.0] * 4  # 8 labels: "i there" + EOD


@pytest.mark.world(1)
def test_tokenizers_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    vocab = {"<pad>": 0, "<|endoftext|>": 1, "[UNK]": 2, "hello": 3, "world": 4, "bye": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok_path = str(tmp_path / "tokenizer.json")
    tok.save(tok_path)
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "hello world", "response": "bye bye"}) + "\n")
    (prefix,) = preprocess(
        [
            "--input", str(path), "--output-prefix", str(tmp_path / "h"), "--sft",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok_path,
        ]
    )  # fmt: skip
    ds = IndexedDataset(prefix)
    assert [ds[0].tolist(), ds[1].tolist()] == [[3, 4], [5, 5, 1]]
    sample = FileSFTDataset(str(path), tok_path, 6, seed=0)[0]
    assert sample["tokens"].tolist() == [3, 4, 5, 5, 1, 0]
    assert sample["loss_mask"].tolist() == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    from megatron.core.tokenizers import MegatronTokenizer

    hf = MegatronTokenizer.from_pretrained(tok_path, metadata_path={"library": "huggingface"})
    assert hf.tokenize("hello bye") == [3, 5] and hf.eod == 1 and hf.pad == 0


@pytest.mark.world(1)
def test_schedule_flags_parse_and_bad_values_name_the_flag():
    config = parse_args(
        ["--data-path", "x.jsonl", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
         "--min-lr", "1e-4", "--weight-decay", "0.1", "--tokenizer", "byte-level"]
    )  # fmt: skip
    assert (config.lr_warmup_iters, config.lr_decay_style, config.min_lr) == (2, "cosine", 1e-4)
    assert config.data_path == "x.jsonl" and config.weight_decay == 0.1
    for changes, flag in [
        ({"lr_warmup_iters": 20}, "--lr-warmup-iters"),
        ({"lr_decay_style": "step"}, "--lr-decay-style"),
        ({"min_lr": 1.0}, "--min-lr"),
        ({"tokenizer": "byte-level"}, "--tokenizer"),
    ]:
        with pytest.raises(ValueError, match=flag):
            validate_config(TrainingConfig(**changes), 1)


@pytest.mark.world(4)
def test_indexed_data_with_warmup_and_cosine_follows_the_one_process_run():
    """CP = 2, PP = 2 on a preprocessed indexed dataset (byte-level), warm-up 1 then cosine
    to min_lr over 3 iterations: the loss equals the one-process run's per iteration and
    the logged lr is the closed form."""
    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    if dist.get_rank() == 0:
        preprocess(
            ["--input", _write_jsonl(directory[0]), "--output-prefix",
             os.path.join(directory[0], "d"), "--sft"]
        )  # fmt: skip
    dist.barrier()
    lr, low, warm, iters = 4e-3, 4e-4, 1, 3
    config = TrainingConfig(
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        data_path=os.path.join(directory[0], "d_sft_document"),
        seq_length=16,
        hidden_size=16,
        num_layers=2,
        train_iters=iters,
        lr=lr,
        min_lr=low,
        lr_warmup_iters=warm,
        lr_decay_style="cosine",
        weight_decay=0.01,
        compare_single_process=True,
        compare_tolerance=1e-5,
        allow_truncation=True,  # 1 of 5 records is longer than 16 tokens
        progress=False,
    )
    with fresh_layout():
        result = pretrain(config)
    failures = [] if result.passed else ["the comparison with the one-process run failed"]
    for n, record in enumerate(result.records):  # the lr used at iteration n + 1
        want = (
            lr * n / warm
            if n <= warm
            else low + (lr - low) * 0.5 * (1 + math.cos(math.pi * (n - warm) / (iters - warm)))
        )
        if abs(record["lr"] - want) > 1e-12:
            failures.append(f"iteration {n + 1}: lr {record['lr']}, expected {want}")
    assert_no_failures(failures)


@pytest.mark.world(1)
def test_bad_data_is_rejected_with_the_place_and_the_expectation(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps({"q": 1}))
    with pytest.raises(
        ValueError, match=r"bad.jsonl:2: keys \['q'\]; expected a JSON object with 'messages'"
    ):
        FileSFTDataset(str(bad), None, 8, seed=0)
    text = tmp_path / "ids.jsonl"
    text.write_text(json.dumps({"text": "300 1 2"}) + "\n")
    (prefix,) = preprocess(
        ["--input", str(text), "--output-prefix", str(tmp_path / "n"),
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "400"]
    )  # fmt: skip
    with pytest.raises(ValueError, match="token id 300, outside the tokenizer's vocabulary of 258"):
        FileSFTDataset(prefix, None, 8, seed=0)
    with pytest.raises(FileNotFoundError, match="--tokenizer 'nope.json'"):
        FileSFTDataset(str(text), "nope.json", 8, seed=0)
