"""The small GPT under context parallelism: the load-balanced shards, the CP all-gather, the
layout-independent initialization, and exact equality with the unsharded model.

Distributed cases run under ``torchrun --nproc-per-node 4 -m pytest tests/unit_tests/models``
(gloo). Every rank runs the same collectives in the same order and asserts only afterwards,
so a failed comparison on one rank cannot leave the others waiting.
"""

import re
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.context_parallel import (
    cp_gathered_positions,
    cp_shard_positions,
    gather_from_context_parallel_region,
    get_batch_on_this_cp_rank,
    slice_batch_for_cp_rank,
)
from megatron.core.device import comm_device
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.models.naming import reference_names
from tests.unit_tests.transformer.attention_oracle import explicit_causal_attention as attention

VOCAB, HIDDEN, HEADS, SEQ, LAYERS, BATCH = 32, 16, 2, 16, 4, 2
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
SPEC = get_gpt_layer_local_spec()


# ----------------------------------------------------------------------------- shards


def test_cp_shard_positions_hand_written():
    """Rank r holds chunks r and 2C-1-r of 2C equal chunks; C = 1 holds everything."""
    assert cp_shard_positions(8, 1, 0).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert cp_shard_positions(7, 1, 0).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert cp_shard_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_shard_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert [cp_shard_positions(8, 4, r).tolist() for r in range(4)] == [
        [0, 7],
        [1, 6],
        [2, 5],
        [3, 4],
    ]
    assert cp_shard_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_shard_positions(8, 2, 0).dtype == torch.long
    assert cp_gathered_positions(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


def test_cp_shard_positions_rejects_bad_arguments():
    """Indivisible lengths, ranks out of range and sizes below one are named in the error."""
    with pytest.raises(ValueError, match=r"seq_length \(12\).*divisible.*\(8\)"):
        cp_shard_positions(12, 4, 0)
    with pytest.raises(ValueError, match=r"cp_rank.*\[0, 2\).*got 2"):
        cp_shard_positions(8, 2, 2)
    with pytest.raises(ValueError, match="cp_size"):
        cp_shard_positions(8, 0, 0)


def test_slice_batch_for_cp_rank_leaves_input_intact():
    """[b, s] entries are sliced on dim 1, attention masks on their query dim, the rest kept."""
    batch = make_batch()
    batch["attention_mask"] = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    batch["num_tokens"] = torch.tensor(5)
    batch["name"] = "sample"
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    sliced = slice_batch_for_cp_rank(batch, cp_size=2, cp_rank=1)

    positions = [4, 5, 6, 7, 8, 9, 10, 11]
    assert sliced is not batch and set(sliced) == set(batch)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(sliced[key], before[key][:, positions]), key
    assert sliced["position_ids"][0].tolist() == positions
    assert sliced["attention_mask"].shape == (BATCH, 1, SEQ // 2, SEQ)
    assert sliced["num_tokens"] is batch["num_tokens"] and sliced["name"] == "sample"
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(batch[key], value), key
        else:
            assert batch[key] == value


def test_get_batch_on_this_cp_rank_without_parallel_state_is_identity():
    """No group and no initialized parallel state means C = 1: the same values, a new dict."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    batch = make_batch()
    out = get_batch_on_this_cp_rank(batch)
    assert out is not batch
    assert all(torch.equal(out[k], batch[k]) for k in batch)


# ----------------------------------------------------------------------------- model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_initialization_is_layout_independent(tied):
    """The union of the PP=2, V=2 chunks' parameters equals the PP=1 model's, exactly."""
    rng_before = torch.random.get_rng_state()
    full = build_chunks(pp=1, vp=None, tied=tied)
    chunks = build_chunks(pp=2, vp=2, tied=tied)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "global RNG was used"

    full_params = global_params(full)
    assert [len(c.decoder.layers) for c in chunks] == [1, 1, 1, 1]
    # Virtual stage vp * PP + p holds layer stage + 1: chunk 1 of pipeline rank 0 has layer 3.
    assert [c.decoder.layers[0].layer_number for c in chunks] == [1, 2, 3, 4]
    assert chunks[2].vp_stage == 1 and chunks[2].decoder.layers[0].layer_number == 3
    seen = set()
    for chunk in chunks:
        for name, value in global_params([chunk]).items():
            assert torch.equal(value, full_params[name]), name
            seen.add(name)
    assert seen == set(full_params)

    first, last = chunks[0], chunks[-1]
    if tied:
        assert full[0].output_layer.weight is None
        assert first.shared_embedding_or_output_weight() is (first.embedding.word_embeddings.weight)
        assert last.shared_embedding_or_output_weight() is last.output_layer.weight
        assert torch.equal(last.output_layer.weight, first.embedding.word_embeddings.weight)
        assert first.shared_embedding_or_output_weight().shared_embedding
        assert last.shared_embedding_or_output_weight().shared_embedding
    else:
        assert not torch.equal(last.output_layer.weight, first.embedding.word_embeddings.weight)
    assert [(c.pre_process, c.post_process, c.vp_stage) for c in chunks] == [
        (True, False, 0),
        (False, False, 0),
        (False, False, 1),
        (False, True, 1),
    ]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_pipeline_chunks_chained_equal_full_model(tied):
    """Running the PP=2, V=2 chunks in virtual-stage order (set_input_tensor between them)
    gives the full model's losses and gradients (tied grads summed over both copies)."""
    batch = make_batch()
    ref_losses, ref_grads = forward_backward(as_double(build_chunks(1, None, tied)), batch)
    losses, grads = forward_backward(as_double(build_chunks(2, 2, tied)), batch)
    assert relative_error(losses, ref_losses) <= 1e-12
    assert set(grads) == set(ref_grads)
    assert max(relative_error(grads[k], ref_grads[k]) for k in grads) <= 1e-12


def test_model_outputs_per_stage_and_causality():
    """Shapes per stage ([s, b, h] hidden, [b, s, V] logits, [b, s] losses) and a causal
    model: changing token t leaves the losses before t unchanged."""
    batch = make_batch()
    first, last = as_double(build_chunks(pp=2, vp=None, tied=False))
    hidden = first(batch["tokens"], batch["position_ids"])
    assert hidden.shape == (SEQ, BATCH, HIDDEN)
    last.set_input_tensor([hidden])
    assert last(None, None).shape == (BATCH, SEQ, VOCAB)
    # megatron-core's positional order: input_ids, position_ids, attention_mask,
    # decoder_input, labels
    losses = last(None, None, None, None, batch["labels"])
    assert losses.shape == (BATCH, SEQ) and losses.dtype == torch.float64

    (full,) = as_double(build_chunks(pp=1, vp=None, tied=False))
    tokens = batch["tokens"].clone()
    before = full(tokens, batch["position_ids"], labels=batch["labels"])
    tokens[:, 9] = (tokens[:, 9] + 1) % VOCAB
    after = full(tokens, batch["position_ids"], labels=batch["labels"])
    assert torch.equal(before[:, :9], after[:, :9])
    assert (before[:, 9:] - after[:, 9:]).abs().min() > 0


def test_decoder_input_replaces_the_embedding_lookup():
    """``decoder_input`` [s, b, h] on the first stage is used instead of the embeddings:
    passing the embeddings themselves gives the same losses; other inputs, other losses."""
    batch = make_batch()
    (full,) = as_double(build_chunks(pp=1, vp=None, tied=True))
    embedded = full.embedding(batch["tokens"], batch["position_ids"])
    plain = full(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    fed = full(None, None, None, embedded, batch["labels"])
    assert torch.equal(plain, fed)
    assert not torch.equal(plain, full(None, None, None, embedded * 2, batch["labels"]))


def test_attention_matches_torch_causal_sdpa():
    """With C = 1 the attention core equals torch's causal scaled_dot_product_attention."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, SEQ, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert relative_error(attention(q, k, v, allowed), expected) <= 1e-13


def test_model_rejects_unsupported_layouts():
    """Clear errors for group sizes that differ from the config, uneven layer splits, bad
    vp_stage, a vocabulary not divisible by TP, missing inputs."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    with pytest.raises(ValueError, match=r"tp group.*1 rank\(s\).*tensor_model_parallel_size is 2"):
        GPTModel(make_config(tensor_model_parallel_size=2), SPEC, VOCAB, SEQ)
    with pytest.raises(ValueError, match=r"num_layers \(3\).*= 4"):
        GPTModel(
            make_config(
                num_layers=3,
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
            ),
            SPEC,
            VOCAB,
            SEQ,
            pp_rank=0,
        )
    with pytest.raises(ValueError, match=r"vp_stage must be in \[0, 2\).*got 2"):
        GPTModel(
            make_config(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            SPEC,
            VOCAB,
            SEQ,
            vp_stage=2,
            pp_rank=0,
        )
    with pytest.raises(ValueError, match=r"pp group of pg_collection.*pass pg_collection.pp"):
        GPTModel(
            make_config(pipeline_model_parallel_size=2),
            SPEC,
            VOCAB,
            SEQ,
            pg_collection=no_groups(),
        )
    with pytest.raises(ValueError, match=r"cp group of pg_collection.*pass pg_collection.cp"):
        GPTModel(make_config(context_parallel_size=2), SPEC, VOCAB, SEQ, pg_collection=no_groups())
    with pytest.raises(ValueError, match=r"1 rank\(s\).*context_parallel_size is 2"):
        GPTModel(make_config(context_parallel_size=2), SPEC, VOCAB, SEQ)
    with pytest.raises(ValueError, match=r"vocab_size \(0\).*positive multiple"):
        GPTModel(make_config(), SPEC, 0, SEQ)
    later_stage = GPTModel(make_config(), SPEC, VOCAB, SEQ, pre_process=False)
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        later_stage(None, None)


PER_LAYER = ["a2a+p2p", "p2p", "a2a", None]


@pytest.mark.parametrize("pp", [1, 2], ids=["pp1", "pp2"])
def test_per_layer_cp_comm_type_follows_global_layer_numbers(pp):
    """A ``cp_comm_type`` list gives layer n (global, 1-based) entry n - 1, on every stage.
    (megatron-core 0.16.1 reads entry n, which leaves the first entry unused and indexes
    past the end at the last layer.)"""
    config = make_config(pipeline_model_parallel_size=pp, cp_comm_type=PER_LAYER)
    got = {}
    for stage in range(pp):
        model = GPTModel(
            config, SPEC, VOCAB, SEQ, pre_process=stage == 0, post_process=stage == pp - 1,
            pg_collection=no_groups(), pp_rank=stage,
        )  # fmt: skip
        for layer in model.decoder.layers:
            got[layer.layer_number] = layer.self_attention.core_attention.cp_comm_type
    assert got == {n: PER_LAYER[n - 1] for n in range(1, LAYERS + 1)}


def test_cp_comm_type_is_checked():
    """Unknown kinds, and per-layer lists of the wrong length, name what was wrong."""
    with pytest.raises(ValueError, match=r"cp_comm_type entries must be one of .*got 'ring'"):
        make_config(cp_comm_type="ring")
    with pytest.raises(ValueError, match=r"cp_comm_type entries must be one of .*got 'a2a\+a2a'"):
        make_config(cp_comm_type=["p2p", "a2a+a2a", "p2p", "p2p"])
    with pytest.raises(ValueError, match=r"cp_comm_type has 3 entries.*num_layers = 4"):
        make_config(cp_comm_type=["p2p"] * 3)


# ----------------------------------------------------------------------------- distributed


@pytest.mark.world(4)
def test_gather_backward_sums_gradients_over_ranks(dist_world):
    """y = cat_r x_r; with loss_q = <w_q, y> on rank q, dL/dx_r = block r of sum_q w_q."""
    rank, world = dist.get_rank(), dist_world
    x = torch.full((2, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    y = gather_from_context_parallel_region(x, dist.group.WORLD)
    base = torch.arange(2 * world * 3, dtype=torch.float64).view(2 * world, 3)
    (y * (rank + 1) * base).sum().backward()

    expected_y = torch.cat([torch.full((2, 3), float(q + 1)) for q in range(world)]).double()
    expected_grad = sum(q + 1 for q in range(world)) * base[2 * rank : 2 * rank + 2]
    assert torch.equal(y.detach(), expected_y)
    assert torch.equal(x.grad, expected_grad)


@pytest.mark.world(4)
@pytest.mark.parametrize("source", ["explicit", "mpu"])
def test_get_batch_on_this_cp_rank_uses_the_group(model_parallel, source):
    """The explicit group and the MPU fallback both slice to this CP rank's positions."""
    model_parallel(context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    batch = make_batch()
    before = {k: v.clone() for k, v in batch.items()}
    sliced = get_batch_on_this_cp_rank(batch, group if source == "explicit" else None)
    positions = cp_shard_positions(SEQ, 2, dist.get_rank(group))
    assert torch.equal(sliced["position_ids"], before["position_ids"][:, positions])
    assert torch.equal(sliced["tokens"], before["tokens"][:, positions])
    assert all(torch.equal(batch[k], before[k]) for k in batch)


@pytest.mark.world(4)
def test_a2a_p2p_checks_its_groups(model_parallel):
    """a2a+p2p: the hierarchical groups come from pg_collection.hcp or parallel_state; a
    collection without them, or with the levels swapped, is a named error at build time."""
    model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    group = parallel_state.get_context_parallel_group()
    a2a, ring = parallel_state.get_hierarchical_context_parallel_groups()
    config = make_config(context_parallel_size=4, cp_comm_type="a2a+p2p")
    GPTModel(config, SPEC, VOCAB, SEQ)  # the MPU fallback
    GPTModel(
        config, SPEC, VOCAB, SEQ, pg_collection=ProcessGroupCollection(cp=group, hcp=[a2a, ring])
    )
    with pytest.raises(ValueError, match=r"needs two hierarchical CP groups.*pg_collection.hcp"):
        GPTModel(config, SPEC, VOCAB, SEQ, pg_collection=ProcessGroupCollection(cp=group))
    swapped = ProcessGroupCollection(cp=group, hcp=[ring, a2a])
    rank = dist.get_rank()
    needed = [[rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]]
    with pytest.raises(ValueError, match=re.escape(f"this rank needs {needed}")):
        GPTModel(config, SPEC, VOCAB, SEQ, pg_collection=swapped)


CP_CASES = [
    # (C, where the CP group comes from, dtype, (PP, V) of the chunks this rank chains, tied)
    pytest.param(2, "explicit", torch.float64, (1, None), False, id="C2-explicit-f64"),
    pytest.param(4, "explicit", torch.float64, (1, None), True, id="C4-explicit-tied-f64"),
    pytest.param(2, "mpu", torch.float64, (2, None), True, id="C2-mpu-pp2-tied-f64"),
    pytest.param(4, "mpu", torch.float64, (2, 2), False, id="C4-mpu-pp2-vp2-f64"),
    pytest.param(2, "explicit", torch.float32, (1, None), True, id="C2-explicit-tied-f32"),
]


@pytest.mark.world(4)
@pytest.mark.parametrize("cp_size, source, dtype, stages, tied", CP_CASES)
def test_cp_attention_matches_full_sequence(model_parallel, cp_size, source, dtype, stages, tied):
    """Sharded losses equal the unsharded float64 model's on this rank's positions; parameter
    gradients summed over the CP group equal its gradients (objective sum(loss * mask))."""
    model_parallel(context_parallel_size=cp_size)
    group = parallel_state.get_context_parallel_group()
    batch = make_batch()
    ref_losses, ref_grads = forward_backward(as_double(build_chunks(1, None, tied)), batch)

    explicit = source == "explicit"
    local_batch = get_batch_on_this_cp_rank(batch, group if explicit else None)
    chunks = build_chunks(
        *stages,
        tied=tied,
        cp_size=cp_size,
        pg_collection=ProcessGroupCollection(cp=group) if explicit else None,
    )
    if dtype == torch.float64:
        chunks = as_double(chunks)
    losses, grads = forward_backward(chunks, local_batch)
    grads = all_reduce_sum(grads, group)

    positions = cp_shard_positions(SEQ, cp_size, dist.get_rank(group))
    errors = {"losses": relative_error(losses, ref_losses[:, positions])}
    errors.update({k: relative_error(grads[k], ref_grads[k]) for k in grads if k in ref_grads})
    assert set(grads) == set(ref_grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE[dtype], f"worst: {worst} {errors[worst]:.3e}"


# ----------------------------------------------------------------------------- helpers


def make_config(**overrides) -> TransformerConfig:
    """The tiny test configuration (4 layers, hidden 16, 2 heads), with overrides."""
    fields = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def no_groups() -> ProcessGroupCollection:
    """An explicit collection holding no groups at all."""
    return ProcessGroupCollection()


def build_chunks(
    pp: int,
    vp: Optional[int],
    tied: bool,
    cp_size: int = 1,
    pg_collection: Optional[ProcessGroupCollection] = None,
) -> List[GPTModel]:
    """All chunks of a (PP, V) layout, in virtual-stage order, built in one process.

    Virtual stage s is chunk s // PP of pipeline rank s % PP (explicit ``pp_rank``).
    """
    config = make_config(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        context_parallel_size=cp_size,
    )
    if pg_collection is None and cp_size == 1:
        pg_collection = no_groups()
    stages = pp * (vp or 1)
    return [
        GPTModel(
            config,
            SPEC,
            VOCAB,
            SEQ,
            pre_process=stage == 0,
            post_process=stage == stages - 1,
            share_embeddings_and_output_weights=tied,
            vp_stage=None if vp is None else stage // pp,
            pg_collection=pg_collection,
            pp_rank=stage % pp,
        )
        for stage in range(stages)
    ]


def as_double(chunks: List[GPTModel]) -> List[GPTModel]:
    """The chunks converted to float64 in place."""
    return [chunk.double() for chunk in chunks]


def make_batch() -> Dict[str, torch.Tensor]:
    """A fixed [b, s] batch with an uneven mask (prompt-masked rows, scattered tokens), on the
    device the models are built on (CPU with gloo, the current GPU with nccl)."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    loss_mask = torch.zeros(BATCH, SEQ)
    loss_mask[0, [5, 9, 10, 14]] = 1.0
    loss_mask[1, [2, 12, 13, 14, 15]] = 1.0
    batch = {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).contiguous(),
    }
    return {key: value.to(comm_device()) for key, value in batch.items()}


def forward_backward(chunks: List[GPTModel], batch: Dict[str, torch.Tensor]):
    """Chain the chunks on ``batch``, backpropagate sum(loss * mask).

    Returns (per-token losses, {global parameter name: gradient})."""
    hidden = None
    for chunk in chunks:
        chunk.set_input_tensor(hidden)
        hidden = chunk(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    (hidden * batch["loss_mask"].to(hidden.dtype)).sum().backward()
    return hidden.detach(), global_grads(chunks)


def global_grads(chunks: List[GPTModel]) -> Dict[str, torch.Tensor]:
    """Gradients keyed by one-chunk-model name; the two copies of a tied weight are summed."""
    out: Dict[str, torch.Tensor] = {}
    for key, param in global_named_parameters(chunks):
        out[key] = out[key] + param.grad.double() if key in out else param.grad.double()
    return out


def global_params(chunks: List[GPTModel]) -> Dict[str, torch.Tensor]:
    """Parameter values keyed by one-chunk-model name; tied copies must agree exactly."""
    out: Dict[str, torch.Tensor] = {}
    for key, param in global_named_parameters(chunks):
        assert key not in out or torch.equal(out[key], param.detach()), f"{key} copies differ"
        out[key] = param.detach()
    return out


def global_named_parameters(chunks: List[GPTModel]):
    """(name in the one-chunk model, parameter) for every parameter of every chunk."""
    for chunk in chunks:
        yield from reference_names(chunk)


def all_reduce_sum(tensors: Dict[str, torch.Tensor], group) -> Dict[str, torch.Tensor]:
    """Sum each tensor over ``group`` with one all-reduce of their concatenation."""
    keys = sorted(tensors)
    flat = torch.cat([tensors[k].reshape(-1) for k in keys])
    dist.all_reduce(flat, group=group)
    out, offset = {}, 0
    for key in keys:
        numel = tensors[key].numel()
        out[key] = flat[offset : offset + numel].view_as(tensors[key])
        offset += numel
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (absolute when expected is zero)."""
    actual, expected = actual.double(), expected.double()
    scale = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / scale if scale > 0 else diff
