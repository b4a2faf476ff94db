"""The GPT on packed sequences (THD, ``PackedSeqParams``), alone and under context parallelism.

Reference: every document of a packed row run alone through the same float64 model (its own
positions from 0), and, for the losses, through the independent dense GPT (``dense_gpt.py``).
The packed row must give the same per-token losses on real tokens and the same gradients of
sum(mask * loss); under CP (each padded document split over the ranks with
the load-balanced rule, ``get_thd_batch_on_this_cp_rank``) the shards must give the packed
one-process model's losses on their positions and, summed over the CP group, its gradients.
"""

from typing import Dict, List, Optional, Union

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.context_parallel import thd_partitioned_indices
from megatron.core.device import comm_device
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_thd_batch_on_this_cp_rank
from tests.unit_tests.models.dense_gpt import Arch, dense_gpt_losses
from tests.unit_tests.models.test_gpt_cp_attention import (
    HEADS,
    HIDDEN,
    LAYERS,
    SPEC,
    VOCAB,
    all_reduce_sum,
    global_grads,
    make_config,
    relative_error,
)

TOTAL = 48
# Real document lengths and their padded lengths (multiples of 8 = 2C for C <= 4); the row
# ends with 8 tokens of padding after the last document.
REAL = [5, 19, 0, 8]
PADDED = [8, 24, 0, 8]


def packed_row() -> Dict[str, torch.Tensor]:
    """One [1, TOTAL] row: random tokens, prompt-like masks, positions restarting per
    document, padding masked; plus the cumulative lengths (on the test backend's device)."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (1, TOTAL), generator=gen)
    labels = torch.randint(0, VOCAB, (1, TOTAL), generator=gen)
    loss_mask = torch.zeros(1, TOTAL)
    positions = torch.zeros(1, TOTAL, dtype=torch.long)
    start = 0
    for real, padded in zip(REAL, PADDED):
        loss_mask[0, start + real // 2 : start + real] = 1.0  # the second half of each doc
        positions[0, start : start + padded] = torch.arange(padded)
        start += padded
    real = torch.tensor([0] + REAL, dtype=torch.int32).cumsum(0).int()
    padded = torch.tensor([0] + PADDED, dtype=torch.int32).cumsum(0).int()
    row = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": positions,
        "cu_seqlens": real,
        "cu_seqlens_padded": padded,
        "max_seqlen": torch.tensor([max(PADDED)], dtype=torch.int32),
    }
    return {key: value.to(comm_device()) for key, value in row.items()}


def params_of(row) -> PackedSeqParams:
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=row["cu_seqlens"],
        cu_seqlens_kv=row["cu_seqlens"],
        cu_seqlens_q_padded=row["cu_seqlens_padded"],
        cu_seqlens_kv_padded=row["cu_seqlens_padded"],
        max_seqlen_q=int(row["max_seqlen"][0]),
        max_seqlen_kv=int(row["max_seqlen"][0]),
    )


# Gemma's features (the layer spec's LayerNorm, zero-centred): sandwich norms, scaled
# embeddings, both soft-caps, a window of 3 keys on layers 1 and 3 with their own RoPE base,
# the other layers' positions / 2
GEMMA = dict(
    layernorm_zero_centered_gamma=True, sandwich_layernorm=True,
    embedding_scale_sqrt_hidden=True, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
    window_size=(3, 0), window_attn_skip_freq=2, local_rotary_base=100.0,
)  # fmt: skip


def build(
    cp_size: int = 1,
    pg_collection: Optional[ProcessGroupCollection] = None,
    cp_comm_type: Union[str, List[str]] = "all_gather",
    position_embedding_type: str = "learned_absolute",
    gemma: bool = False,
) -> GPTModel:
    """A float64 GPT (same weights for every layout) with room for TOTAL positions
    (``gemma``: with the ``GEMMA`` features, rope)."""
    extra = dict(GEMMA) if gemma else {}
    config = make_config(context_parallel_size=cp_size, cp_comm_type=cp_comm_type, **extra)
    if pg_collection is None and cp_size == 1:
        pg_collection = ProcessGroupCollection()
    model = GPTModel(
        config, SPEC, VOCAB, TOTAL, pg_collection=pg_collection,
        position_embedding_type=position_embedding_type,
        seq_len_interpolation_factor=2.0 if gemma else None,
    )  # fmt: skip
    if gemma:  # zero-centred norms start at 0: draw them so that the offset matters
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "layernorm" in name and name.endswith("weight"):
                    param.copy_(torch.linspace(-0.5, 0.5, param.numel()).view_as(param))
    return model.double()


POSITIONS = ["learned_absolute", "rope"]


def run(model: GPTModel, row, packed: Optional[PackedSeqParams]):
    """Per-token losses [1, s] and gradients of sum(mask * loss)."""
    model.zero_grad(set_to_none=True)
    kwargs = {} if packed is None else {"packed_seq_params": packed}
    losses = model(row["tokens"], row["position_ids"], labels=row["labels"], **kwargs)
    (losses * row["loss_mask"].double()).sum().backward()
    return losses.detach(), global_grads([model])


@pytest.mark.world(1)
def test_packed_gemma_row_equals_documents_run_alone():
    """Gemma's windows, soft-caps and per-layer RoPE in a packed row: the losses and the
    gradient of each document run alone (float64), the windows and RoPE restarting in
    every document; without packing the documents see each other (negative control)."""
    row = packed_row()
    model = build(position_embedding_type="rope", gemma=True)
    packed_losses, packed_grads = run(model, row, params_of(row))
    expected_losses = torch.zeros(1, TOTAL, dtype=torch.float64, device=comm_device())
    expected_grads: Dict[str, torch.Tensor] = {}
    start = 0
    for real, padded in zip(REAL, PADDED):
        if real:
            doc = {k: row[k][:, start : start + real] for k in ("tokens", "labels", "loss_mask")}
            doc["position_ids"] = torch.arange(real, device=comm_device()).unsqueeze(0)
            losses, grads = run(model, doc, None)
            expected_losses[:, start : start + real] = losses
            for k, g in grads.items():
                expected_grads[k] = expected_grads.get(k, 0) + g
        start += padded
    real_rows = row["loss_mask"] > 0
    assert relative_error(packed_losses[real_rows], expected_losses[real_rows]) <= 1e-12
    assert max(relative_error(packed_grads[k], g) for k, g in expected_grads.items()) <= 1e-12
    mixed_losses, _ = run(model, row, None)
    assert relative_error(mixed_losses[real_rows], expected_losses[real_rows]) > 1e-3


@pytest.mark.world(1)
@pytest.mark.parametrize("position_embedding_type", POSITIONS)
def test_packed_row_equals_documents_run_alone(position_embedding_type):
    """Real tokens of a packed row get the losses of their document run alone (learned
    positions and RoPE both restart in every document), and the gradient is the sum of the
    documents' gradients. Negative control: the same row without ``packed_seq_params``
    (documents see each other, RoPE counts from the row's start) gives other losses."""
    row = packed_row()
    model = build(position_embedding_type=position_embedding_type)
    packed_losses, packed_grads = run(model, row, params_of(row))

    expected_losses = torch.zeros(1, TOTAL, dtype=torch.float64, device=comm_device())
    expected_grads: Dict[str, torch.Tensor] = {}
    start = 0
    for real, padded in zip(REAL, PADDED):
        if real:
            doc = {k: row[k][:, start : start + real] for k in ("tokens", "labels", "loss_mask")}
            doc["position_ids"] = torch.arange(real, device=comm_device()).unsqueeze(0)
            losses, grads = run(model, doc, None)
            expected_losses[:, start : start + real] = losses
            for k, g in grads.items():
                expected_grads[k] = expected_grads.get(k, 0) + g
        start += padded
    real_rows = row["loss_mask"] > 0
    assert relative_error(packed_losses[real_rows], expected_losses[real_rows]) <= 1e-12
    worst = max(relative_error(packed_grads[k], expected_grads[k]) for k in expected_grads)
    assert worst <= 1e-12
    assert torch.isfinite(packed_losses).all()

    mixed_losses, _ = run(model, row, None)
    assert relative_error(mixed_losses[real_rows], expected_losses[real_rows]) > 1e-3

    # The losses once more against the independent dense reference (plain torch ops on the
    # same weights, each document from position 0), which shares no code with the model.
    arch = Arch(
        "packed", layers=LAYERS, hidden=HIDDEN, heads=HEADS, groups=HEADS, ffn=4 * HIDDEN,
        vocab=VOCAB, norm="LayerNorm", swiglu=False, bias=True, tied=False,
        rope=position_embedding_type == "rope",
    )  # fmt: skip
    params = {name: p.detach().cpu() for name, p in model.named_parameters()}  # on the CPU
    dense_losses = torch.zeros(1, TOTAL, dtype=torch.float64)
    start = 0
    for real, padded in zip(REAL, PADDED):
        doc = slice(start, start + real)
        dense_losses[:, doc] = dense_gpt_losses(
            params, arch, row["tokens"][:, doc].cpu(), row["labels"][:, doc].cpu()
        )
        start += padded
    # The model builds RoPE angles in float32, as megatron-core does; the reference in float64.
    tolerance = 1e-6 if arch.rope else 1e-12
    real_rows, packed_losses = real_rows.cpu(), packed_losses.cpu()
    assert relative_error(packed_losses[real_rows], dense_losses[real_rows]) <= tolerance


PER_LAYER = ["a2a+p2p", "p2p", "all_gather", "a2a+p2p"]  # 2 heads: no plain a2a at C = 4
PACKED_CP_CASES = [
    pytest.param(2, "all_gather", "learned_absolute", None, id="C2-all_gather"),
    pytest.param(4, "all_gather", "learned_absolute", None, id="C4-all_gather"),
    pytest.param(2, "a2a", "learned_absolute", None, id="C2-a2a"),
    pytest.param(2, "p2p", "learned_absolute", None, id="C2-p2p"),
    pytest.param(2, "all_gather", "rope", None, id="C2-all_gather-rope"),
    pytest.param(4, "p2p", "rope", None, id="C4-p2p-rope"),
    pytest.param(4, "a2a+p2p", "rope", [2, 2], id="C4-a2a2xp2p2-rope"),
    pytest.param(4, PER_LAYER, "learned_absolute", [2, 2], id="C4-per-layer"),
]


@pytest.mark.world(4)
@pytest.mark.parametrize("cp_size, comm, position_embedding_type, hierarchical", PACKED_CP_CASES)
def test_packed_cp_matches_one_process(
    model_parallel, cp_size, comm, position_embedding_type, hierarchical
):
    """Each rank's THD shard gives the one-process packed losses on its positions; gradients
    summed over the CP group equal the one-process gradients (float64). a2a+p2p runs over
    ``hierarchical_context_parallel_sizes``; the per-layer list mixes every kind."""
    model_parallel(context_parallel_size=cp_size, hierarchical_context_parallel_sizes=hierarchical)
    group = parallel_state.get_context_parallel_group()
    hcp = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    row = packed_row()
    ref_model = build(position_embedding_type=position_embedding_type)
    ref_losses, ref_grads = run(ref_model, row, params_of(row))

    local, packed = get_thd_batch_on_this_cp_rank(
        row, row["cu_seqlens"], row["cu_seqlens_padded"], row["max_seqlen"]
    )
    collection = ProcessGroupCollection(cp=group, hcp=hcp)
    model = build(cp_size, collection, comm, position_embedding_type)
    losses, grads = run(model, local, packed)
    grads = all_reduce_sum(grads, group)

    positions = thd_partitioned_indices(row["cu_seqlens_padded"], TOTAL, cp_size, group.rank())
    errors: Dict[str, float] = {"losses": relative_error(losses, ref_losses[:, positions])}
    errors.update({k: relative_error(grads[k], ref_grads[k]) for k in ref_grads})
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-10, f"worst: {worst} {errors[worst]:.3e}"
    assert torch.equal(local["tokens"], row["tokens"][:, positions])


@pytest.mark.world(2)
@pytest.mark.slow
def test_packed_gemma_cp2_matches_one_process(model_parallel):
    """Gemma's features on uneven packed documents at CP = 2 (a2a: the windows): each
    rank's shard gives the one-process losses on its positions, the gradients summed over
    CP the one-process gradients (float64)."""
    model_parallel(context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    row = packed_row()
    ref_losses, ref_grads = run(build(position_embedding_type="rope", gemma=True), row,
                                params_of(row))  # fmt: skip
    local, packed = get_thd_batch_on_this_cp_rank(
        row, row["cu_seqlens"], row["cu_seqlens_padded"], row["max_seqlen"]
    )
    model = build(2, ProcessGroupCollection(cp=group), "a2a", "rope", gemma=True)
    losses, grads = run(model, local, packed)
    grads = all_reduce_sum(grads, group)
    positions = thd_partitioned_indices(row["cu_seqlens_padded"], TOTAL, 2, group.rank())
    errors: Dict[str, float] = {"losses": relative_error(losses, ref_losses[:, positions])}
    errors.update({k: relative_error(grads[k], ref_grads[k]) for k in ref_grads})
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-10, f"worst: {worst} {errors[worst]:.3e}"


@pytest.mark.world(1)
def test_thd_batch_helper_without_parallel_state_is_identity():
    """megatron-core's helper: C = 1 keeps every entry and builds the THD parameters."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    row = packed_row()
    local, packed = get_thd_batch_on_this_cp_rank(
        row, row["cu_seqlens"], row["cu_seqlens_padded"], row["max_seqlen"]
    )
    assert local is not row and all(torch.equal(local[k], row[k]) for k in row)
    assert packed.qkv_format == "thd" and packed.max_seqlen_q == max(PADDED)
    sliced, _ = get_thd_batch_on_this_cp_rank(
        row, row["cu_seqlens"], row["cu_seqlens_padded"], row["max_seqlen"], 2, 1
    )
    expected = thd_partitioned_indices(row["cu_seqlens_padded"], TOTAL, 2, 1)
    assert torch.equal(sliced["tokens"], row["tokens"][:, expected])
    assert torch.equal(sliced["cu_seqlens"], row["cu_seqlens"])
