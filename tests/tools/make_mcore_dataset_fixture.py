"""Write the megatron-core dataset fixture (run with megatron-core 0.16.1's interpreter).

    cd /tmp && env -u PYTHONPATH /opt/mcore/bin/python \
        <repo>/tests/tools/make_mcore_dataset_fixture.py <repo>/tests/unit_tests/data/mcore_indexed

Writes two tiny ``.bin``/``.idx`` pairs with megatron-core's own ``IndexedDatasetBuilder``
(int32 and uint16 tokens, several sequences per document) and ``expected.json``: what
megatron-core's datasets return for them (GPT samples with end-of-document resets, a blend of
the two) and for its mock dataset, so our readers can be checked sample for sample.
"""

import json
import os
import sys
import tempfile

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.tokenizers import MegatronTokenizer

EOD = 50


def write(prefix: str, dtype, seed: int) -> None:
    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for _doc in range(7):
        for _ in range(int(rng.integers(1, 3))):
            n = int(rng.integers(3, 20))
            ids = rng.integers(0, EOD, size=n).tolist() + [EOD]
            builder.add_item(torch.tensor(ids))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def sample_dict(sample) -> dict:
    return {k: v.tolist() for k, v in sample.items()}


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    write(os.path.join(out, "tiny_int32"), numpy.int32, 1)
    write(os.path.join(out, "tiny_uint16"), numpy.uint16, 2)
    expected = {"indexed": {}}
    for name in ("tiny_int32", "tiny_uint16"):
        ds = IndexedDataset(os.path.join(out, name))
        expected["indexed"][name] = {
            "sequences": [ds[i].tolist() for i in range(len(ds))],
            "document_indices": ds.document_indices.tolist(),
            "dtype": str(ds.index.dtype.__name__),
        }
    tok = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=EOD)
    with tempfile.TemporaryDirectory() as cache:
        config = GPTDatasetConfig(
            random_seed=1234,
            sequence_length=16,
            blend=([os.path.join(out, "tiny_int32")], None),
            split="70,20,10",
            path_to_cache=cache,
            reset_position_ids=True,
            reset_attention_mask=True,
            eod_mask_loss=True,
            tokenizer=tok,
        )
        splits = BlendedMegatronDatasetBuilder(GPTDataset, [12, None, None], lambda: True, config)
        splits = splits.build()
        expected["gpt"] = [
            [sample_dict(d[i]) for i in range(len(d))] if d is not None else None for d in splits
        ]
        config = GPTDatasetConfig(
            random_seed=7,
            sequence_length=8,
            blend=([os.path.join(out, "tiny_int32"), os.path.join(out, "tiny_uint16")], [1, 2]),
            split="100,0,0",
            path_to_cache=cache,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            tokenizer=tok,
        )
        blend = BlendedMegatronDatasetBuilder(GPTDataset, [20, 0, 0], lambda: True, config).build()
        expected["blend"] = [
            {"dataset_id": int(s["dataset_id"]), "tokens": s["tokens"].tolist()}
            for s in (blend[0][i] for i in range(len(blend[0])))
        ]
    tok64 = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=64)
    config = GPTDatasetConfig(
        random_seed=0,
        sequence_length=64,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=tok64,
    )
    mock = BlendedMegatronDatasetBuilder(MockGPTDataset, [1000, None, None], lambda: True, config)
    mock = mock.build()
    picks = [0, 1, 2, 999, 12345]
    expected["mock"] = {
        "lengths": [len(d) for d in mock],
        "picks": picks,
        "tokens": [[mock[s][i]["tokens"].tolist() for i in picks] for s in range(3)],
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f)


if __name__ == "__main__":
    main(sys.argv[1])
