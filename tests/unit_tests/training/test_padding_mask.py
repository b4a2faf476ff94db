"""The trainer's padding mask (issue 30, "one token layout"): which positions are padding,
how the mask is sharded like the tokens, and that MoE layers see it.

Padding is what holds no data (the fill after a sample, the padding of a packed document
and the unused tail of a row); prompt tokens are data: masked out of the loss, but routed.
The trainer cases check the logged per-expert load: k x the global batch's data tokens with
the mask, k x all of its positions without it (the behaviour before the trainer passed the
mask), and the same at CP = 2 (with PP = 2, or TP = 2 with SP and EP = 2) as in one process.
"""

import json
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from megatron.core.context_parallel import get_thd_batch_on_this_cp_rank, slice_batch_for_cp_rank
from megatron.training import TrainingConfig, loop, training
from megatron.training.data import (
    PACK_PAD_MULTIPLE,
    SEP,
    PackedSFTDataset,
    SFTDataset,
    empty_sample,
)
from megatron.training.datasets import FileSFTDataset
from megatron.training.evaluation import build_validation_set
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout

MOE = dict(
    num_experts=4,
    moe_router_topk=2,
    disable_bias_linear=True,
    moe_ffn_hidden_size=32,
    moe_aux_loss_coeff=0.01,
    moe_z_loss_coeff=0.001,
    num_layers=2,
    progress=False,
)


# ----------------------------------------------------------------------------- the mask


@pytest.mark.world(1)
def test_generated_samples_mark_the_fill_after_the_sample_and_not_the_prompt():
    """Sample [BOS] p_1..p_L [SEP] p_L..p_1 [EOS] [PAD]..: positions 0 .. 2L + 1 (their
    labels are the sample's tokens, EOS the last) are data, the prompt included; the rest
    is padding. The data positions are the ones ``data_tokens`` counts."""
    dataset = SFTDataset(seq_length=32, vocab_size=64, seed=3)
    lengths = set()
    for i in range(20):
        sample = dataset[i]
        length = int((sample["tokens"] == SEP).nonzero()[0]) - 1  # L
        lengths.add(length)
        mask = sample["padding_mask"]
        assert mask.dtype == torch.bool and mask.shape == (32,)
        expected = torch.arange(32) >= 2 * length + 2
        assert torch.equal(mask, expected), (i, length, mask)
        prompt = slice(0, length + 1)  # BOS and the prompt: out of the loss, not padding
        assert not sample["loss_mask"][prompt].any() and not mask[prompt].any()
        assert not mask[sample["loss_mask"] > 0].any()  # trained positions are data
    assert len(lengths) > 3  # uneven padding
    batch = dataset.global_batch(1, 8)
    assert int((~batch["padding_mask"]).sum()) == dataset.data_tokens(1, 8)


@pytest.mark.world(1)
def test_packed_rows_mark_document_padding_and_the_row_tail():
    """Packed rows: data exactly on each document's real positions [padded start, padded
    start + real length); the padding of a document to a multiple of 16 and the rest of the
    row are padding."""
    dataset = PackedSFTDataset(seq_length=64, vocab_size=64, seed=3)
    tails = 0
    for i in range(6):
        row = dataset[i]
        real, padded = row["cu_seqlens"].tolist(), row["cu_seqlens_padded"].tolist()
        expected = torch.ones(64, dtype=torch.bool)
        for j in range(len(real) - 1):
            length = real[j + 1] - real[j]
            expected[padded[j] : padded[j] + length] = False
            assert padded[j] % PACK_PAD_MULTIPLE == 0
        assert torch.equal(row["padding_mask"], expected), (i, real, padded)
        assert not row["padding_mask"][row["loss_mask"] > 0].any()
        tails += int(padded[-1] < 64)
        # prompts (data out of the loss) exist in every row
        assert ((row["loss_mask"] == 0) & ~row["padding_mask"]).any()
    assert tails > 0  # some row ends with unused positions
    batch = dataset.global_batch(0, 4)
    assert int((~batch["padding_mask"]).sum()) == dataset.data_tokens(0, 4)


@pytest.mark.world(1)
def test_file_records_mark_the_fill_after_the_record(tmp_path):
    """A prompt/completion record of n ids: positions t < n - 1 are data (the prompt
    included), the rest padding; a record cut to seq_length + 1 ids has none. The empty
    sample that fills a validation batch is all padding."""
    records = [
        {"prompt": "ab", "completion": "cd"},  # 2 + 2 + EOD = 5 ids
        {"prompt": "hello there", "completion": "x"},  # 13 ids
        {"text": "0123456789abcdefghij"},  # 21 ids: cut to 17
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    dataset = FileSFTDataset(str(path), None, seq_length=16, seed=0)
    for position, n in enumerate([5, 13, 17]):
        sample = dataset.sample_of_record(position)
        assert torch.equal(sample["padding_mask"], torch.arange(16) >= n - 1), position
    batch = dataset.global_batch(0, 3)
    assert int((~batch["padding_mask"]).sum()) == dataset.data_tokens(0, 3) == 4 + 12 + 16
    prompt = dataset.sample_of_record(1)
    assert not prompt["loss_mask"][:10].any() and not prompt["padding_mask"][:10].any()
    for packed in (False, True):
        assert empty_sample(16, packed)["padding_mask"].all()


@pytest.mark.world(1)
def test_validation_batches_carry_the_mask_with_the_filling_samples():
    """Validation batches (stacked from every sample, the filling empty ones too) carry a
    [GBS, s] padding mask, all True on the fill."""
    config = TrainingConfig(eval_iters=1, eval_interval=1, global_batch_size=4)
    validation = build_validation_set(config)
    mask = validation.batches[0]["padding_mask"]
    assert mask.shape == (4, config.seq_length) and mask.dtype == torch.bool
    assert mask.any() and not mask.all()


@pytest.mark.world(1)
@pytest.mark.parametrize("cp_size", [2, 4])
def test_the_cp_shard_of_the_mask_is_the_tokens_shard(cp_size):
    """The trainer's CP split (zigzag chunks r and 2C-1-r; of every document for packed
    rows) takes the same positions of ``padding_mask`` as of the tokens, for every rank."""
    sft = SFTDataset(seq_length=32, vocab_size=64, seed=1).global_batch(0, 2)
    packed = PackedSFTDataset(seq_length=64, vocab_size=64, seed=1).global_batch(0, 1)
    for batch in (sft, packed):
        width = batch["tokens"].shape[1]
        batch = dict(batch, tokens=torch.arange(width).repeat(batch["tokens"].shape[0], 1))
        seen = []
        for rank in range(cp_size):
            if "cu_seqlens" in batch:
                shard, _ = get_thd_batch_on_this_cp_rank(
                    batch,
                    batch["cu_seqlens"][0],
                    batch["cu_seqlens_padded"][0],
                    batch["max_seqlen"][0],
                    cp_size=cp_size,
                    cp_rank=rank,
                )
            else:
                shard = slice_batch_for_cp_rank(batch, cp_size, rank)
            positions = shard["tokens"]
            assert positions.shape[1] == width // cp_size
            expected = torch.gather(batch["padding_mask"], 1, positions)
            assert torch.equal(shard["padding_mask"], expected), (rank, positions)
            seen.append(positions[0])
        assert sorted(torch.cat(seen).tolist()) == list(range(width))


@pytest.mark.world(1)
def test_forward_step_hands_the_mask_to_the_model_and_dense_batches_drop_it():
    """``forward_step`` passes the microbatch's ``padding_mask`` to the model; a dense
    model's batches carry none (``without_padding_mask``), so its call is unchanged."""
    calls: List[Dict] = []

    def model(tokens, positions, **kwargs):
        calls.append(kwargs)
        return torch.zeros(tokens.shape)

    batch = SFTDataset(seq_length=16, vocab_size=64, seed=0).global_batch(0, 2)
    training.forward_step(iter([batch]), model)
    assert torch.equal(calls[-1]["padding_mask"], batch["padding_mask"])
    dense = training.without_padding_mask(batch)
    assert "padding_mask" in batch and set(dense) == set(batch) - {"padding_mask"}
    training.forward_step(iter([dense]), model)
    assert set(calls[-1]) == {"labels"}


# ----------------------------------------------------------------------------- the trainer


def _routed_per_layer(record: dict) -> List[int]:
    return [sum(layer) for layer in record["moe_tokens_per_expert"]]


@pytest.mark.world(1)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_logged_expert_load_counts_data_tokens_only(packed):
    """One process, a 2-layer MoE on padded (or packed) SFT data: each MoE layer's logged
    per-expert load adds up to k x the global batch's data tokens (prompts included), not
    k x its positions."""
    fields = dict(pack_sequences=True, micro_batch_size=1) if packed else {}
    config = TrainingConfig(train_iters=1, global_batch_size=4, **fields, **MOE)
    with fresh_layout():
        (record,) = training.pretrain(config).records
    k, positions = config.moe_router_topk, config.global_batch_size * config.seq_length
    assert record["padding_tokens"] > 0 and record["data_tokens"] > record["valid_tokens"]
    assert _routed_per_layer(record) == [k * record["data_tokens"]] * 2, (record, positions)


@pytest.mark.world(1)
def test_without_the_mask_padding_is_routed_and_counted(monkeypatch):
    """Negative control: the trainer's batches stripped of ``padding_mask`` (what it did
    before) count every position, padding included, in the logged load and give another
    aux loss: the check above fails when the trainer stops passing the mask."""
    config = TrainingConfig(train_iters=1, global_batch_size=4, **MOE)
    with fresh_layout():
        (masked,) = training.pretrain(config).records
    on_this_cp_rank = loop._on_this_cp_rank
    monkeypatch.setattr(
        loop,
        "_on_this_cp_rank",
        lambda batch, groups: on_this_cp_rank(training.without_padding_mask(batch), groups),
    )
    with fresh_layout():
        (unmasked,) = training.pretrain(config).records
    positions = config.global_batch_size * config.seq_length
    assert _routed_per_layer(unmasked) == [config.moe_router_topk * positions] * 2
    assert _routed_per_layer(masked) != _routed_per_layer(unmasked)
    assert masked["moe_load_balancing_loss"] != unmasked["moe_load_balancing_loss"]
    assert masked["loss"] == unmasked["loss"]  # padding changes no token's output


# ----------------------------------------------------------------------------- layouts

MOE_LAYOUTS = [
    pytest.param(
        dict(context_parallel_size=2, pipeline_model_parallel_size=2),
        id="cp2-pp2",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        dict(
            context_parallel_size=2,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            expert_model_parallel_size=2,
            moe_token_dispatcher_type="alltoall",
        ),
        id="tp2-sp-cp2-ep2",
    ),
    pytest.param(
        dict(
            context_parallel_size=2,
            pipeline_model_parallel_size=2,
            pack_sequences=True,
            micro_batch_size=1,
            seq_length=64,
        ),
        id="cp2-pp2-packed",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.world(4)
@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_router_metrics_follow_the_one_process_run(layout):
    """2 iterations of a MoE model on padded SFT data at CP = 2 with PP = 2 (the second
    stage's MoE layer reads its stage's mask), TP = 2 with SP and EP = 2 (the mask split
    over TP), or packed rows: the logged per-expert load equals the one-process run's
    exactly and adds up to k x the data tokens; the aux and z losses agree within 1e-6
    relative; the losses follow the one-process run."""
    config = TrainingConfig(
        train_iters=2,
        global_batch_size=4,
        compare_single_process=True,
        compare_tolerance=1e-5,
        moe_router_load_balancing_type="aux_loss",
        **{**MOE, **layout},
    )
    with fresh_layout():
        result = training.pretrain(config)
    failures = [] if result.passed else ["the losses do not follow the one-process run"]
    for record in result.records:
        if _routed_per_layer(record) != [config.moe_router_topk * record["data_tokens"]] * 2:
            failures.append(f"load {record['moe_tokens_per_expert']} vs {record['data_tokens']}")
    if dist.get_rank() == 0:
        if not result.records or len(result.records) != len(result.reference):
            failures.append(f"{len(result.records)} records vs {len(result.reference)} reference")
        for ours, reference in zip(result.records, result.reference):
            if ours["moe_tokens_per_expert"] != reference["moe_tokens_per_expert"]:
                failures.append(
                    f"iteration {ours['iteration']}: load {ours['moe_tokens_per_expert']}, "
                    f"one process {reference['moe_tokens_per_expert']}"
                )
            for name in ("moe_load_balancing_loss", "moe_z_loss"):
                difference = abs(ours[name] - reference[name])
                if not difference <= 1e-6 * abs(reference[name]):
                    failures.append(
                        f"iteration {ours['iteration']}: {name} {ours[name]!r}, one process "
                        f"{reference[name]!r}"
                    )
    assert_no_failures(failures)
