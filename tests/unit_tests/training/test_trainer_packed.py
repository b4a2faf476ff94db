"""``--pack-sequences`` and ``--cp-comm-type``: packed SFT rows, their checks, and packed
training under CP that follows the one-process run.

The distributed cases run under ``torchrun --nproc-per-node 4 -m pytest
tests/unit_tests/training`` (CP = 2 with PP = 2 or TP = 2, then the one-process run on
rank 0).
"""

import pytest
import torch

from megatron.training import TrainingConfig, validate_config
from megatron.training.arguments import parse_args
from megatron.training.data import PACK_PAD_MULTIPLE, PAD, PackedSFTDataset, SFTDataset
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout

PACKED_RUNS = [
    pytest.param(dict(pipeline_model_parallel_size=2), "all_gather", id="cp2-pp2-all_gather"),
    pytest.param(
        dict(tensor_model_parallel_size=2), "a2a", id="tp2-cp2-a2a", marks=pytest.mark.slow
    ),
    pytest.param(
        dict(
            pipeline_model_parallel_size=2,
            position_embedding_type="rope",
            normalization="RMSNorm",
            swiglu=True,
        ),
        "p2p",
        id="cp2-pp2-p2p-llama",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2]),
        "a2a+p2p",
        id="cp4-a2a2xp2p2",
    ),
    pytest.param(dict(), "p2p", id="cp2-dp2-p2p", marks=pytest.mark.slow),
    pytest.param(
        dict(pipeline_model_parallel_size=2), "a2a", id="cp2-pp2-a2a", marks=pytest.mark.slow
    ),
]


@pytest.mark.world(4)
@pytest.mark.parametrize("layout, comm", PACKED_RUNS)
def test_packed_training_follows_the_one_process_run(layout, comm):
    """4 iterations of packed rows at CP = 2 (with PP = 2, or TP = 2: CP then splits each
    tensor-parallel rank's heads; GPT-2 style, or Llama style with RoPE restarting in every
    document), and at CP = 4 as a2a+p2p over [2, 2], equal the one-process run within
    1e-5."""
    fields = dict(
        context_parallel_size=2,
        pack_sequences=True,
        cp_comm_type=comm,
        micro_batch_size=1,
        global_batch_size=4,
        seq_length=64,
        train_iters=4,
        compare_single_process=True,
        compare_tolerance=1e-5,
        progress=False,
    )
    config = TrainingConfig(**{**fields, **layout})
    with fresh_layout():
        result = pretrain(config)
    failures = [] if result.passed else ["the comparison with the one-process run failed"]
    assert_no_failures(failures)


@pytest.mark.world(1)
def test_packed_rows_hold_whole_padded_documents():
    """Each row: documents in stream order, each its SFT sample's real tokens, padded to a
    multiple of 16, positions restarting at 0, padding and prompts masked; rows with two or
    more documents occur; the same rows for every layout (no dependence on C)."""
    packed = PackedSFTDataset(64, 64, seed=5)
    plain = SFTDataset(64, 64, seed=5)
    document, multi = 0, 0
    for i in range(12):
        row = packed[i]
        real, padded = row["cu_seqlens"].tolist(), row["cu_seqlens_padded"].tolist()
        docs = [(a, b, c) for a, b, c in zip(padded[:-1], real[:-1], real[1:]) if c > b]
        multi += len(docs) > 1
        for start, begin, end in docs:
            length = end - begin
            sample = plain[document]
            assert torch.equal(row["tokens"][start : start + length], sample["tokens"][:length])
            assert torch.equal(
                row["loss_mask"][start : start + length], sample["loss_mask"][:length]
            )
            assert row["position_ids"][start] == 0
            document += 1
        assert all((b - a) % PACK_PAD_MULTIPLE == 0 for a, b in zip(padded[:-1], padded[1:]))
        used = padded[-1]
        assert (row["tokens"][used:] == PAD).all() and (row["loss_mask"][used:] == 0).all()
    assert multi > 0


@pytest.mark.world(1)
def test_sft_and_preference_packing_share_the_row_bounds_and_name_what_ran_out():
    """One row builder (``padding_row``, ``set_document_bounds``) for the SFT and the
    preference packers (the SFT rows fill a stream in order, ``PackedRows``; a preference row
    is micro-batch r's pairs, built on demand): the bounds repeat the last one up to the row's
    slots, and a row past a finite stream names the dataset and what it packs."""
    from megatron.training.data import PackedRows, padding_row, set_document_bounds
    from megatron.training.preference_data import PackedPreferenceDataset

    row = set_document_bounds(padding_row(64), [0, 5, 12], [0, 16, 32], 4)
    assert row["cu_seqlens"].tolist() == [0, 5, 12, 12, 12]
    assert row["cu_seqlens_padded"].tolist() == [0, 16, 32, 32, 32]
    assert row["max_seqlen"].tolist() == [16] and bool(row["padding_mask"].all())

    class NoDocuments:
        def document(self, index):
            return None

    sft = PackedSFTDataset(32, 64, 0, documents=NoDocuments())
    pairs = PackedPreferenceDataset(lambda index: None, 1, 16, 64)
    assert isinstance(sft, PackedRows)
    with pytest.raises(IndexError, match="PackedSFTDataset: no documents left for row 0"):
        sft[0]
    with pytest.raises(IndexError, match="PackedPreferenceDataset: no pairs left for row 0"):
        pairs[0]
    assert sft.all_rows() == []


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(micro_batch_size=2), r"--micro-batch-size must be 1, got 2"),
        (dict(seq_length=40), r"--seq-length \(40\) must be a multiple of it"),
    ],
)
def test_packing_rejects_what_it_cannot_run(changes, message):
    """Clear errors naming the flag and value before anything starts."""
    fields = dict(pack_sequences=True, micro_batch_size=1, seq_length=64, global_batch_size=4)
    fields.update(changes)
    with pytest.raises(ValueError, match=message):
        validate_config(TrainingConfig(**fields), 1)


@pytest.mark.world(1)
def test_flags_map_to_the_config():
    """--pack-sequences and --cp-comm-type reach TrainingConfig; a2a needs heads % C == 0."""
    config = parse_args(["--pack-sequences", "--cp-comm-type", "a2a"])
    assert config.pack_sequences and config.cp_comm_type == "a2a"
    assert parse_args([]).cp_comm_type == "all_gather" and not parse_args([]).pack_sequences
    with pytest.raises(ValueError, match=r"a2a .* --num-attention-heads \(4\).*--tp x --cp = 8"):
        validate_config(TrainingConfig(cp_comm_type="a2a", context_parallel_size=8), 8)


@pytest.mark.world(1)
def test_hierarchical_and_per_layer_flags():
    """--cp-comm-type takes one kind or one per layer; a2a+p2p needs
    --hierarchical-context-parallel-sizes A P with A x P = --cp; errors name the flag."""
    config = parse_args(
        ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "4"]
    )
    assert config.cp_comm_type == "a2a+p2p"
    assert config.hierarchical_context_parallel_sizes == [2, 4]
    per_layer = parse_args(["--cp-comm-type", "p2p", "a2a", "a2a+p2p", "all_gather"])
    assert per_layer.cp_comm_type == ["p2p", "a2a", "a2a+p2p", "all_gather"]
    layout = validate_config(
        TrainingConfig(
            context_parallel_size=8,
            cp_comm_type="a2a+p2p",
            hierarchical_context_parallel_sizes=[2, 4],
            seq_length=64,
            global_batch_size=2,
        ),
        8,
    )
    assert layout.hierarchical_sizes == [2, 4]
    bad = [
        (dict(cp_comm_type="a2a+p2p"), r"a2a\+p2p needs --hierarchical-context-parallel-sizes"),
        (
            dict(cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2]),
            r"two sizes \[A, P\] with A x P = --cp 8, got \[2, 2\]",
        ),
        (
            dict(cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[8, 1]),
            r"over A: --num-attention-heads \(4\).*--tp x A = 8",
        ),
        (dict(cp_comm_type=["p2p", "a2a"]), r"one kind or one per layer \(--num-layers 4\)"),
        (dict(cp_comm_type=["p2p", "ring", "a2a", "a2a"]), r"must be one of .*got \['ring'\]"),
    ]
    for changes, message in bad:
        fields = dict(context_parallel_size=8, seq_length=64, global_batch_size=2, **changes)
        with pytest.raises(ValueError, match=message):
            validate_config(TrainingConfig(**fields), 8)


@pytest.mark.world(1)
def test_trainer_knows_every_cp_comm_type():
    """The trainer's list (kept free of torch imports) is the core's."""
    from megatron.core.transformer.transformer_config import CP_COMM_TYPES
    from megatron.training.arguments import CP_COMM_TYPES as TRAINER_TYPES

    assert TRAINER_TYPES == CP_COMM_TYPES
