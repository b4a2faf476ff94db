"""The indexed format and the GPT/blended/mock datasets against megatron-core 0.16.1.

Reference: ``data/mcore_indexed`` holds ``.bin``/``.idx`` files written by megatron-core's own
builder and ``expected.json``, what megatron-core's datasets returned for them
(``tests/tools/make_mcore_dataset_fixture.py``). Our readers must give the same sequences
and the same samples; files we write must be byte-identical to megatron-core's and (with
``MCORE_PYTHON`` set to an interpreter with megatron-core) read back identically there.
"""

import json
import os
import subprocess
import sys

import numpy
import pytest
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    _get_ltor_masks_and_position_ids,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import Split, compile_helpers
from megatron.core.tokenizers import MegatronTokenizer
from megatron.training.tokenizer.tokenizer import _NullTokenizer

pytestmark = [pytest.mark.world(1), pytest.mark.timeout(120)]

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "data", "mcore_indexed")
EXPECTED = json.load(open(os.path.join(FIXTURE, "expected.json")))
NAMES = ["tiny_int32", "tiny_uint16"]


def null_tokenizer(vocab_size: int):
    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null"}, vocab_size=vocab_size
    )


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "file"])
@pytest.mark.parametrize("name", NAMES)
def test_reads_megatron_core_files(name, mmap):
    want = EXPECTED["indexed"][name]
    ds = IndexedDataset(os.path.join(FIXTURE, name), mmap=mmap)
    assert numpy.dtype(ds.index.dtype).name == want["dtype"]
    assert [ds[i].tolist() for i in range(len(ds))] == want["sequences"]
    assert ds.document_indices.tolist() == want["document_indices"]
    assert [s.tolist() for s in ds[1:4]] == want["sequences"][1:4]
    assert ds.get(2, offset=1, length=2).tolist() == want["sequences"][2][1:3]


@pytest.mark.parametrize("name", NAMES)
def test_writes_megatron_core_bytes(tmp_path, name):
    """Rebuilding the fixture's sequences and documents gives byte-identical files."""
    want = EXPECTED["indexed"][name]
    prefix = str(tmp_path / name)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=getattr(numpy, want["dtype"]))
    bounds = want["document_indices"]
    for d in range(len(bounds) - 1):
        for i in range(bounds[d], bounds[d + 1]):
            builder.add_item(torch.tensor(want["sequences"][i]))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    for ext in (".bin", ".idx"):
        assert (
            open(prefix + ext, "rb").read() == open(os.path.join(FIXTURE, name + ext), "rb").read()
        ), ext
    # add_index / add_document produce the same pair
    merged = str(tmp_path / "merged")
    b2 = IndexedDatasetBuilder(merged + ".bin", dtype=getattr(numpy, want["dtype"]))
    b2.add_index(os.path.join(FIXTURE, name))
    b2.finalize(merged + ".idx")
    assert open(merged + ".idx", "rb").read() == open(prefix + ".idx", "rb").read()


def _sample_lists(sample):
    return {k: v.tolist() for k, v in sample.items()}


def test_gpt_samples_match_megatron_core(tmp_path):
    """reset_position_ids, reset_attention_mask, eod_mask_loss, splits, cache: same samples."""
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=16,
        blend=([os.path.join(FIXTURE, "tiny_int32")], None),
        split="70,20,10",
        path_to_cache=str(tmp_path),
        reset_position_ids=True,
        reset_attention_mask=True,
        eod_mask_loss=True,
        tokenizer=null_tokenizer(50),
    )
    for attempt in ("build", "cache hit"):
        splits = BlendedMegatronDatasetBuilder(
            GPTDataset, [12, None, None], lambda: True, config
        ).build()
        got = [None if d is None else [_sample_lists(d[i]) for i in range(len(d))] for d in splits]
        assert got == EXPECTED["gpt"], attempt
    assert any(f.endswith("shuffle_index.npy") for f in os.listdir(tmp_path))


def test_blend_matches_megatron_core(tmp_path):
    config = GPTDatasetConfig(
        random_seed=7,
        sequence_length=8,
        blend=([os.path.join(FIXTURE, n) for n in NAMES], [1, 2]),
        split="100,0,0",
        path_to_cache=str(tmp_path),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=null_tokenizer(50),
    )
    blend = BlendedMegatronDatasetBuilder(GPTDataset, [20, 0, 0], lambda: True, config).build()[0]
    got = [
        {"dataset_id": int(s["dataset_id"]), "tokens": s["tokens"].tolist()}
        for s in (blend[i] for i in range(len(blend)))
    ]
    assert got == EXPECTED["blend"]


@pytest.mark.parametrize("tok", ["training-null", "core-null-text"])
def test_mock_dataset_like_megatron_core_example(tok):
    """The calls of megatron-core's examples/run_simple_mcore_train_loop.py, same samples."""
    compile_helpers()
    tokenizer = (
        _NullTokenizer(vocab_size=64)
        if tok == "training-null"
        else MegatronTokenizer.from_pretrained(metdata_path={"library": "null-text"}, vocab_size=64)
    )
    config = GPTDatasetConfig(
        random_seed=0,
        sequence_length=64,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=tokenizer,
        mid_level_dataset_surplus=0.005,
    )
    splits = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [1000, None, None], lambda: True, config
    ).build()
    want = EXPECTED["mock"]
    assert [len(d) for d in splits] == want["lengths"]
    for s, d in enumerate(splits):
        assert [d[i]["tokens"].tolist() for i in want["picks"]] == want["tokens"][s]
    batch = next(iter(torch.utils.data.DataLoader(splits[0], batch_size=8, shuffle=True)))
    assert batch["tokens"].shape == (8, 64) and batch["attention_mask"].shape == (8, 1, 64, 64)
    assert batch["loss_mask"].dtype == torch.float32 and bool((batch["loss_mask"] == 1).all())


def test_masks_and_positions_dense_reference():
    """Independent reference: per-token document ids decide mask, positions and loss."""
    eod = 9
    data = torch.tensor([3, 9, 4, 5, 9, 9, 1, 2])
    doc = torch.cumsum(torch.cat([torch.tensor([0]), (data[:-1] == eod).long()]), 0)
    first = {int(d): int((doc == d).nonzero()[0]) for d in doc.unique()}
    want_pos = torch.tensor([i - first[int(doc[i])] for i in range(len(data))])
    q, k = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    want_mask = ~((k <= q) & (doc[q] == doc[k]))
    mask, loss, pos = _get_ltor_masks_and_position_ids(data, eod, True, True, True, True)
    assert torch.equal(pos, want_pos) and torch.equal(mask[0], want_mask)
    assert torch.equal(loss, (data != eod).float())
    mask, loss, pos = _get_ltor_masks_and_position_ids(data, eod, False, False, False, True)
    assert torch.equal(pos, torch.arange(8)) and torch.equal(mask[0], k > q)
    assert bool((loss == 1).all())


def test_padding_sample_and_bad_input(tmp_path):
    config = GPTDatasetConfig(
        random_seed=0,
        sequence_length=16,
        blend=([os.path.join(FIXTURE, "tiny_int32")], None),
        split="1,0,0",
        path_to_cache=str(tmp_path),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=null_tokenizer(50),
    )
    ds = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, config)
    train = ds.build()[0]
    assert train.index_split == Split.train and bool((train[None]["loss_mask"] == 0).all())
    with pytest.raises(ValueError, match="reset_position_ids=None"):
        GPTDatasetConfig(random_seed=0, sequence_length=8, tokenizer=null_tokenizer(8))
    with pytest.raises(FileNotFoundError, match="path_prefix"):
        IndexedDataset(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="sizes"):
        BlendedMegatronDatasetBuilder(GPTDataset, [1, 2], lambda: True, config)


def _copy_fixture(tmp_path, name="tiny_int32"):
    prefix = str(tmp_path / name)
    for ext in (".bin", ".idx"):
        with open(os.path.join(FIXTURE, name + ext), "rb") as src, open(prefix + ext, "wb") as dst:
            dst.write(src.read())
    return prefix


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "file"])
def test_corrupt_files_are_named_with_what_is_wrong(tmp_path, mmap):
    """A truncated .bin, a bad dtype code, a truncated .idx: errors naming the file and the
    expected vs actual size (never uninitialised memory read as token ids)."""
    prefix = _copy_fixture(tmp_path)
    good = IndexedDataset(prefix, mmap=mmap)
    size = os.path.getsize(prefix + ".bin")
    assert good.index.data_end() == size
    with pytest.raises(
        ValueError,
        match=f"tiny_int32.bin: truncated or wrong data file: reading "
        f"2 tokens at byte {size - 4} needs {size + 4} bytes, the file has {size}",
    ):
        good.bin_reader.read(good.index.dtype, 2, size - 4)
    with pytest.raises(ValueError, match="offset \\+ length <= its length"):
        good.get(0, offset=1, length=int(good.sequence_lengths[0]))
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(size - 4)
    with pytest.raises(
        ValueError,
        match=f"tiny_int32.bin: truncated data file.*ending at byte "
        f"{size}, the file has {size - 4} bytes",
    ):
        IndexedDataset(prefix, mmap=mmap)
    if not mmap:  # opened before the file shrank: the plain read is checked too
        with pytest.raises(ValueError, match="tiny_int32.bin: read 0 of 4 bytes .* truncated"):
            good.get(len(good) - 1, offset=int(good.sequence_lengths[-1]) - 1)
    prefix = _copy_fixture(tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.seek(17)
        f.write(bytes([99]))
    with pytest.raises(ValueError, match="tiny_int32.idx: dtype code 99 .*not a valid DType"):
        IndexedDataset(prefix, mmap=mmap)
    prefix = _copy_fixture(tmp_path)
    idx_size = os.path.getsize(prefix + ".idx")
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(idx_size - 8)
    with pytest.raises(
        ValueError,
        match=f"tiny_int32.idx: truncated index: .* need {idx_size} "
        f"bytes, the file has {idx_size - 8}",
    ):
        IndexedDataset(prefix, mmap=mmap)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(20)
    with pytest.raises(ValueError, match="tiny_int32.idx: truncated index: the sequence and"):
        IndexedDataset(prefix, mmap=mmap)


_MCORE_READS_OURS = r"""
import json, sys
from megatron.core.datasets.indexed_dataset import IndexedDataset
ds = IndexedDataset(sys.argv[1])
print(json.dumps({"sequences": [ds[i].tolist() for i in range(len(ds))],
                  "document_indices": ds.document_indices.tolist(),
                  "dtype": ds.index.dtype.__name__}))
"""


@pytest.mark.skipif(
    not os.environ.get("MCORE_PYTHON"),
    reason="MCORE_PYTHON (an interpreter with megatron-core 0.16.1) not set",
)
@pytest.mark.parametrize("dtype", ["int32", "uint16"])
def test_megatron_core_reads_ours(tmp_path, dtype):
    rng = numpy.random.default_rng(3)
    prefix = str(tmp_path / f"ours_{dtype}")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=getattr(numpy, dtype))
    sequences, bounds = [], [0]
    for _ in range(5):
        for _ in range(int(rng.integers(1, 4))):
            seq = rng.integers(0, 1000, size=int(rng.integers(1, 30))).tolist()
            builder.add_item(torch.tensor(seq))
            sequences.append(seq)
        builder.end_document()
        bounds.append(len(sequences))
    builder.finalize(prefix + ".idx")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = (
        subprocess.run(
            [os.environ["MCORE_PYTHON"], "-c", _MCORE_READS_OURS, prefix],
            capture_output=True,
            text=True,
            cwd=str(tmp_path),
            env=env,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    assert json.loads(out) == {"sequences": sequences, "document_indices": bounds, "dtype": dtype}
    assert sys.executable  # our own reader agrees too
    ours = IndexedDataset(prefix)
    assert [ours[i].tolist() for i in range(len(ours))] == sequences


@pytest.mark.world(4)
def test_distributed_build_rank0_first_cache_shared_and_not_built_ranks_get_none():
    """Under torch.distributed: rank 0 builds and writes the index cache, the other built
    ranks read it after the barrier, ranks with is_built_on_rank() False get None (and take
    part in the same barriers, so nothing hangs); the blend's samples equal megatron-core's."""
    import tempfile

    import torch.distributed as dist

    from tests.unit_tests.dist_utils import assert_no_failures

    cache = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(cache, src=0)
    config = GPTDatasetConfig(
        random_seed=7,
        sequence_length=8,
        blend=([os.path.join(FIXTURE, n) for n in NAMES], [1, 2]),
        split="100,0,0",
        path_to_cache=cache[0],
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=null_tokenizer(50),
    )
    built = dist.get_rank() != 1
    splits = BlendedMegatronDatasetBuilder(GPTDataset, [20, 0, 0], lambda: built, config).build()
    failures = []
    if not built:
        if any(s is not None for s in splits):
            failures.append("a rank that does not build got datasets")
    else:
        got = [
            {"dataset_id": int(s["dataset_id"]), "tokens": s["tokens"].tolist()}
            for s in (splits[0][i] for i in range(len(splits[0])))
        ]
        if got != EXPECTED["blend"]:
            failures.append("blend samples differ from megatron-core's")
    dist.barrier()
    if dist.get_rank() == 0 and not any(
        f.endswith("dataset_index.npy") for f in os.listdir(cache[0])
    ):
        failures.append("no cached blend index")
    assert_no_failures(failures)
