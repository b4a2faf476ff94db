"""Multi-token prediction against an independent float64 reference of its convention.

The reference (``reference_objective``) is written from the formula, in plain PyTorch on the
one-process model's parameters: the main loss from the model's logits (the GPT path, tested
elsewhere), then for depth k = 1..K: the embeddings of the tokens k ahead (zero-filled past
the end), ``h_k = final_norm(layer(eh_proj([enorm(e); hnorm(h_{k-1})])))`` from h_0, the
decoder's normed output, the shared output weight, labels and mask shifted by k, and
S_k / max(N_k, 1) over the microbatch's whole sequences; the step objective is
(1/(D M)) sum over microbatches of main + (f / K) sum_k S_k / max(N_k, 1).

Our model runs through the schedule (and DDP and finalize_model_grads at several ranks);
every gradient must equal the reference's (its TP shard) to 1e-10. Negative control:
normalizing each CP shard by its own count (megatron-core 0.16.1, Megatron-LM #7452 item 3)
fails at cp2, where one shard holds no MTP target of depth 1.
"""

import functools
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.models.gpt.gpt_model import tp_shard
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import multi_token_prediction as mtp_module
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import Layout, assert_no_failures, use_layout
from tests.unit_tests.models.naming import reference_names

VOCAB, HIDDEN, HEADS, LAYERS, SEQ, DEPTHS, FACTOR = 32, 16, 4, 2, 8, 2, 0.3
ROWS, MICRO = 4, 2  # global batch rows, rows per microbatch
TOLERANCE = 1e-10


def _config(layout: Optional[Layout] = None, **extra) -> TransformerConfig:
    layout = layout or Layout()
    fields = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=24,
        mtp_num_layers=DEPTHS,
        mtp_loss_scaling_factor=FACTOR,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
        params_dtype=torch.float64,
        pipeline_dtype=torch.float64,
        tensor_model_parallel_size=layout.tp,
        expert_model_parallel_size=layout.ep,
        sequence_parallel=layout.sp,
        context_parallel_size=layout.cp,
        pipeline_model_parallel_size=layout.pp,
    )
    return TransformerConfig(**{**fields, **extra})


def _model(config, groups, pp_rank: int = 0, tied: bool = False, vp_stage=None) -> GPTModel:
    """Chunk ``vp_stage`` (None: the only one) of pipeline rank ``pp_rank`` (MoE layers, the
    MTP depths' too, when the config has experts)."""
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts)
    pp = config.pipeline_model_parallel_size
    stage = (vp_stage or 0) * pp + pp_rank
    last = stage == pp * (config.virtual_pipeline_model_parallel_size or 1) - 1
    return GPTModel(
        config,
        spec,
        VOCAB,
        SEQ,
        pre_process=stage == 0,
        post_process=last,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, False, vp_stage, pp_rank),
        pg_collection=groups,
        vp_stage=vp_stage,
        pp_rank=pp_rank,
    )


def batch() -> Dict[str, torch.Tensor]:
    """ROWS rows; uneven masks: rows 0-1 (microbatch 0) have targets only in positions 3-5,
    so at cp2 (rank 0 holds positions 0, 1, 6, 7) rank 0 has no main target and no MTP target
    of depth 1; row 2 is fully masked, row 3 full."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    labels = torch.roll(tokens, -1, 1)
    mask = torch.zeros(ROWS, SEQ, dtype=torch.float64)
    mask[0, 4:6] = 1
    mask[1, 3:6] = 1
    mask[3, :] = 1
    return dict(tokens=tokens, labels=labels, loss_mask=mask)


def _shift(tensor: torch.Tensor, k: int) -> torch.Tensor:
    """tensor[:, p + k], zero past the end."""
    out = torch.zeros_like(tensor)
    out[:, : tensor.shape[1] - k] = tensor[:, k:]
    return out


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def _masked_sum(logits, labels, mask) -> torch.Tensor:
    """sum(mask * CE) of logits [b, s, V]."""
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    return (losses * mask.reshape(-1)).sum()


def reference_sums(model: GPTModel, part: Dict[str, torch.Tensor], tied: bool) -> list:
    """[(S, N) of the main loss, then of each depth k] for rows ``part`` (sequences from
    position 0) from ``model``'s parameters; see the module docstring."""
    captured = {}
    hook = model.decoder.register_forward_hook(lambda m, i, o: captured.update(h=o))
    length = part["tokens"].shape[1]
    angles = model.rotary_pos_emb(length, packed_seq=True)
    words = model.embedding.word_embeddings.weight
    output = words if tied else model.output_layer.weight
    logits = model(part["tokens"], None)
    hook.remove()
    sums = [(_masked_sum(logits, part["labels"], part["loss_mask"]), part["loss_mask"].sum())]
    hidden = captured["h"]
    for k, depth in enumerate(model.mtp.layers, start=1):
        embedded = words[_shift(part["tokens"], k)].transpose(0, 1)
        combined = torch.cat(
            [_rms(embedded, depth.enorm.weight), _rms(hidden, depth.hnorm.weight)], -1
        )
        x, _ = depth.transformer_layer(combined @ depth.eh_proj.weight.t(), rotary_pos_emb=angles)
        hidden = _rms(x, depth.final_layernorm.weight)
        logits_k = (hidden @ output.t()).transpose(0, 1)
        mask_k = _shift(part["loss_mask"], k)
        sums.append((_masked_sum(logits_k, _shift(part["labels"], k), mask_k), mask_k.sum()))
    return sums


def objective_of(sums: list) -> tuple:
    """(main + (f / K) sum_k S_k / max(N_k, 1), [S_k / max(N_k, 1)]) of one microbatch."""
    ratios = [total / count.clamp(min=1) for total, count in sums]
    return ratios[0] + FACTOR / DEPTHS * sum(ratios[1:]), [r.item() for r in ratios[1:]]


def reference_objective(
    model: GPTModel, rows: Dict[str, torch.Tensor], tied: bool, per_token: bool = False
):
    """(objective of the whole batch: the mean over its microbatches, [depth k's
    S_k / max(N_k, 1) averaged over the microbatches]). ``per_token``
    (``calculate_per_token_loss``): (sum S + (f / K) sum_k S_k) / max(sum N, 1) over the
    whole batch, megatron-core's per-token MTP term."""
    microbatches = ROWS // MICRO
    total, logged, sums = 0.0, [0.0] * DEPTHS, []
    for m in range(microbatches):
        part = {key: value[m * MICRO : (m + 1) * MICRO] for key, value in rows.items()}
        sums.append(reference_sums(model, part, tied))
        objective, ratios = objective_of(sums[-1])
        total = total + objective / microbatches
        logged = [a + b / microbatches for a, b in zip(logged, ratios)]
    if per_token:
        main = sum(s[0][0] for s in sums)
        extra = sum(total_k for s in sums for total_k, _ in s[1:])
        total = (main + FACTOR / DEPTHS * extra) / sum(s[0][1] for s in sums).clamp(min=1)
    return total, logged


@functools.lru_cache(maxsize=None)
def _single_rank_groups() -> Optional[ProcessGroupCollection]:
    """Every group of this rank alone inside a launch (every rank creates every group);
    an empty collection (one process) outside one."""
    if not dist.is_initialized():
        return ProcessGroupCollection()
    single = None
    for rank in range(dist.get_world_size()):
        group = dist.new_group([rank])
        if rank == dist.get_rank():
            single = group
    names = ("tp", "pp", "cp", "dp", "dp_cp", "embd", "pos_embd", "mp", "tp_cp", "tp_dp_cp")
    return ProcessGroupCollection(**{name: single for name in names})


MOE = dict(num_moe_experts=4, moe_router_topk=2)


@functools.lru_cache(maxsize=None)
def reference(tied: bool = False, layers: int = LAYERS, moe: bool = False, per_token=False):
    """(one-process name -> reference gradient, logged MTP losses)."""
    extra = MOE if moe else {}
    model = _model(_config(num_layers=layers, **extra), _single_rank_groups(), tied=tied)
    objective, logged = reference_objective(model, batch(), tied, per_token)
    objective.backward()
    return {name: param.grad.clone() for name, param in reference_names(model)}, logged


def _forward_step(rows):
    def forward_step(data_iterator, model):
        part = next(data_iterator)
        output = model(part["tokens"], None, labels=part["labels"], loss_mask=part["loss_mask"])

        def loss_func(output_tensor):
            loss_sum = (output_tensor * part["loss_mask"]).sum()
            return loss_sum, part["loss_mask"].sum(), {}

        return output, loss_func

    return forward_step


def _global_expert(name: str, config, ep_rank: int) -> str:
    """A routed expert's name with its global index (local index + EP rank's first)."""
    if ".local_experts." not in name:
        return name
    head, tail = name.split(".local_experts.")
    local, rest = tail.split(".", 1)
    first = ep_rank * config.num_moe_experts // config.expert_model_parallel_size
    return f"{head}.local_experts.{first + int(local)}.{rest}"


def _mismatches(
    model: GPTModel, expected: dict, tp: int, tp_rank: int, attr: str, ep_rank: int = 0
) -> List[str]:
    bad = []
    for name, param in reference_names(model):
        name = _global_expert(name, model.config, ep_rank)
        want = tp_shard(expected[name], param, tp, tp_rank)
        got = getattr(param, attr)
        if got is None:
            bad.append(f"{name}: no gradient")
            continue
        err = (got - want).norm().item() / max(want.norm().item(), 1e-30)
        if not err <= TOLERANCE:
            bad.append(f"{name}: relative error {err:.2e}")
    return bad


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "tied, moe", [(False, False), (True, False), (False, True)], ids=["untied", "tied", "moe"]
)
def test_mtp_matches_reference_at_one_process(tied, moe):
    """Every gradient of a 2-microbatch step (uneven masks, a fully masked row) equals the
    reference's, and the logged "mtp_k loss" equal the reference's mean S_k / max(N_k, 1);
    with MoE layers (the MTP depths' too: DeepSeek-V3's)."""
    expected, logged = reference(tied, moe=moe)
    model = _model(_config(**(MOE if moe else {})), ProcessGroupCollection(), tied=tied)
    rows = batch()
    parts = [{k: v[m * MICRO : (m + 1) * MICRO] for k, v in rows.items()} for m in range(2)]
    MTPLossLoggingHelper.clean_loss_in_tracker()
    get_forward_backward_func()(
        forward_step_func=_forward_step(rows),
        data_iterator=iter(parts),
        model=model,
        num_microbatches=2,
        seq_length=SEQ,
        micro_batch_size=MICRO,
        pg_collection=ProcessGroupCollection(),
    )
    assert not _mismatches(model, expected, 1, 0, "grad")
    record = {}
    MTPLossLoggingHelper.track_mtp_metrics(0.5, 1, total_loss_dict=record)
    assert sorted(record) == ["mtp_1 loss", "mtp_2 loss"]
    assert record["mtp_1 loss"] == pytest.approx(logged[0], rel=1e-12)
    assert record["mtp_2 loss"] == pytest.approx(logged[1], rel=1e-12)


def distributed_step(layout: Layout, tied: bool = False, **extra) -> List[str]:
    """One step at ``layout`` (DDP, the schedule, finalize_model_grads; the global batch
    split over DP, MICRO rows per microbatch): main_grad mismatches against the reference."""
    moe = "num_moe_experts" in extra
    per_token = extra.get("calculate_per_token_loss", False)
    expected, _ = reference(tied, extra.get("num_layers", LAYERS), moe, per_token)
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    config = _config(layout, virtual_pipeline_model_parallel_size=layout.vpp, **extra)
    stages = [None] if layout.vpp is None else list(range(layout.vpp))
    gpts = [_model(config, groups, groups.pp.rank(), tied, vp) for vp in stages]
    chunks = [
        DistributedDataParallel(config, DistributedDataParallelConfig(), gpt, groups)
        for gpt in gpts
    ]
    config.finalize_model_grads_func = finalize_model_grads
    rows, dp_rank = batch(), groups.dp.rank()
    mine = {k: v.chunk(layout.dp)[dp_rank] for k, v in rows.items()}
    count = mine["tokens"].shape[0] // MICRO
    parts = [
        get_batch_on_this_cp_rank(
            {k: v[m * MICRO : (m + 1) * MICRO] for k, v in mine.items()}, groups.cp
        )
        for m in range(count)
    ]
    for chunk in chunks:
        chunk.zero_grad_buffer()
    get_forward_backward_func(layout.pp, layout.vpp)(
        forward_step_func=_forward_step(rows),
        data_iterator=iter(parts) if layout.vpp is None else [iter(parts) for _ in chunks],
        model=chunks[0] if layout.vpp is None else chunks,
        num_microbatches=count,
        seq_length=SEQ,
        micro_batch_size=MICRO,
        pg_collection=groups,
    )
    tp_rank, ep_rank = groups.tp.rank(), groups.ep.rank()
    return [
        bad
        for gpt in gpts
        for bad in _mismatches(gpt, expected, layout.tp, tp_rank, "main_grad", ep_rank)
    ]


LAYOUTS = [
    (Layout(tp=2, sp=True), False),
    (Layout(dp=2, ep=2), "moe"),
    (Layout(cp=2), False),
    (Layout(pp=2), False),
    (Layout(pp=2), True),
    (Layout(dp=2), False),
    (Layout(cp=2), "per-token"),
]


@pytest.mark.world(2)
@pytest.mark.parametrize(
    "layout, tied",
    LAYOUTS,
    ids=lambda c: c.id if isinstance(c, Layout) else ("tied" if c is True else c or ""),
)
def test_mtp_layouts_match_reference(layout, tied):
    """Every main_grad at tp2-sp, dp2 x ep2 (MoE layers), cp2 (uneven masks: a shard with no
    target; also in per-token mode), pp2 (MTP on the last stage; its embedding copy summed
    with the first stage's, tied or not), dp2 equals the reference's shard."""
    extra = {"moe": MOE, "per-token": dict(calculate_per_token_loss=True)}.get(tied, {})
    assert_no_failures(distributed_step(layout, tied is True, **extra))


@pytest.mark.slow
@pytest.mark.world(2)
def test_mtp_interleaved_pipeline_matches_reference():
    """pp2 x vpp2 (4 layers): the depths on the last chunk of the last rank (virtual stage
    3), its embedding copy summed with chunk 0's of rank 0."""
    assert_no_failures(distributed_step(Layout(pp=2, vpp=2), num_layers=4))


@pytest.mark.world(2)
def test_negative_control_mtp_normalized_per_cp_shard(monkeypatch):
    """Dividing each CP shard's MTP loss by its own count (megatron-core 0.16.1) fails at
    cp2: the shard without depth-1 targets and the other one are weighted wrongly."""
    monkeypatch.setattr(mtp_module, "all_reduce", lambda tensor, group: tensor)
    bad = distributed_step(Layout(cp=2))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, bad)
    assert any(everyone), "per-shard normalization went unnoticed"


@pytest.mark.slow
@pytest.mark.world(8)
def test_mtp_8_rank_layout_matches_reference():
    """tp2-sp x cp2 x pp2, tied embeddings, full recomputation."""
    recompute = dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    layout = Layout(tp=2, sp=True, cp=2, pp=2)
    assert_no_failures(distributed_step(layout, True, **recompute))


@pytest.mark.world(1)
def test_mtp_checkpoint_saved_at_pp1_loads_into_pp2_stages(tmp_path):
    """``mtp.layers.<k>.*`` (megatron-core's names) and the MTP stage's embedding copy are
    layout-free: a one-process checkpoint loads into the two stages of pp2 (built here in
    one process), every parameter equal to the saved one's; the copy is stored as the word
    embeddings with replica id (1, ...), never written twice."""
    from megatron.core import dist_checkpointing

    saved = _model(_config(), ProcessGroupCollection())
    state = saved.sharded_state_dict()
    assert "mtp.layers.1.transformer_layer.self_attention.linear_qkv.weight" in state
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.eh_proj.weight"} <= set(state)
    dist_checkpointing.save(state, str(tmp_path))
    config = _config(Layout(pp=2))
    expected = dict(reference_names(saved))
    for pp_rank in (0, 1):
        stage = GPTModel(  # another seed: the load must overwrite everything
            config,
            get_gpt_layer_local_spec(),
            VOCAB,
            SEQ,
            pre_process=pp_rank == 0,
            post_process=pp_rank == 1,
            position_embedding_type="rope",
            mtp_block_spec=get_gpt_mtp_block_spec(
                config, get_gpt_layer_local_spec(), False, pp_rank=pp_rank
            ),
            pg_collection=ProcessGroupCollection(),
            pp_rank=pp_rank,
            seed=99,
        )
        sharded = stage.sharded_state_dict()
        if pp_rank == 1:
            assert sharded["embedding.word_embeddings.weight"].replica_id[0] == 1
        stage.load_state_dict(dist_checkpointing.load(sharded, str(tmp_path)))
        for name, param in reference_names(stage):
            assert torch.equal(param, expected[name]), name


@pytest.mark.world(1)
def test_mtp_bad_arguments_are_refused_by_name():
    """Config values, a spec without MTP on the last stage, MTP off the last stage, learned
    positions on a later stage: each refused naming what and why."""
    with pytest.raises(ValueError, match=r"mtp_num_layers must be None or an int >= 1, got 0"):
        _config(mtp_num_layers=0)
    with pytest.raises(ValueError, match=r"mtp_loss_scaling_factor must be a finite number"):
        _config(mtp_loss_scaling_factor=float("inf"))
    config, spec = _config(), get_gpt_layer_local_spec()
    with pytest.raises(ValueError, match=r"config.mtp_num_layers=2 on the last .* needs mtp_"):
        GPTModel(config, spec, VOCAB, SEQ, pg_collection=ProcessGroupCollection())
    mtp = get_gpt_mtp_block_spec(config, spec, False, pp_rank=0)
    with pytest.raises(ValueError, match=r"mtp_block_spec on a chunk with post_process=False"):
        GPTModel(config, spec, VOCAB, SEQ, post_process=False, mtp_block_spec=mtp)
    later = _config(Layout(pp=2))
    assert get_gpt_mtp_block_spec(later, spec, False, pp_rank=0) is None
    with pytest.raises(NotImplementedError, match=r"position_embedding_type='learned_absolute'"):
        GPTModel(
            later,
            spec,
            VOCAB,
            SEQ,
            pre_process=False,
            mtp_block_spec=get_gpt_mtp_block_spec(later, spec, False, pp_rank=1),
            pg_collection=ProcessGroupCollection(),
            pp_rank=1,
        )


def _packed_reference(tied: bool = False):
    """(name -> gradient, row) of the packed row of ``test_gpt_packed`` through the reference,
    each document alone from position 0 (sums over the documents, one microbatch)."""
    from tests.unit_tests.models.test_gpt_packed import PADDED, REAL, packed_row

    row = {k: v.cpu() for k, v in packed_row().items()}
    row["loss_mask"] = torch.zeros_like(row["loss_mask"])
    start = 0
    for real, padded in zip(REAL, PADDED):  # every real token: a roll across documents shows
        row["loss_mask"][:, start : start + real] = 1
        start += padded
    model = _model(_config(), _single_rank_groups(), tied=tied)
    totals, start = None, 0
    for real, padded in zip(REAL, PADDED):
        if real:
            doc = {k: row[k][:, start : start + real] for k in ("tokens", "labels", "loss_mask")}
            sums = reference_sums(model, doc, tied)
            totals = (
                sums if totals is None else [(a + c, b + d) for (a, b), (c, d) in zip(totals, sums)]
            )
        start += padded
    objective_of(totals)[0].backward()
    return {name: param.grad for name, param in reference_names(model)}, row


def _packed_step(model: GPTModel, row, packed, total_tokens) -> None:
    """Backward of this shard's part of main + MTP (the MTP terms' gradient scale 1: the
    shards' gradients are summed, not averaged)."""
    MTPLossAutoScaler.set_loss_scale(torch.ones(1))
    out = model(
        row["tokens"],
        row["position_ids"],
        labels=row["labels"],
        loss_mask=row["loss_mask"],
        packed_seq_params=packed,
    )
    ((out * row["loss_mask"]).sum() / total_tokens).backward()


@pytest.mark.world(1)
def test_mtp_packed_row_equals_documents_alone():
    """A packed row (THD: padded documents, an empty one, trailing padding) rolls within
    each document: every gradient equals the reference's over the documents run alone."""
    from tests.unit_tests.models.test_gpt_packed import params_of

    expected, row = _packed_reference()
    model = _model(_config(), ProcessGroupCollection())
    _packed_step(model, row, params_of(row), row["loss_mask"].sum())
    assert not _mismatches(model, expected, 1, 0, "grad")


@pytest.mark.world(2)
def test_mtp_packed_row_under_cp2_equals_documents_alone():
    """The same packed row split over cp2 (each document's load-balanced chunks): the roll
    crosses the shards in each document's order; gradients summed over CP equal the
    reference's."""
    from megatron.core.utils import get_thd_batch_on_this_cp_rank
    from tests.unit_tests.models.test_gpt_packed import all_reduce_sum

    expected, row = _packed_reference()
    layout = Layout(cp=2)
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    local, packed = get_thd_batch_on_this_cp_rank(
        row, row["cu_seqlens"], row["cu_seqlens_padded"], row["max_seqlen"]
    )
    model = _model(_config(layout), groups)
    _packed_step(model, local, packed, row["loss_mask"].sum())
    grads = all_reduce_sum({n: p.grad for n, p in reference_names(model)}, groups.cp)
    for name, param in reference_names(model):
        param.grad = grads[name]
    assert_no_failures(_mismatches(model, expected, 1, 0, "grad"))


# megatron-core 0.16.1's parameters (read from its source), in order; ours may add
# keyword-only extras after them.
MCORE_SIGNATURES = {
    "MultiTokenPredictionLayer.__init__": "config submodules layer_number vp_stage pg_collection",
    "MultiTokenPredictionLayer.forward": "input_ids position_ids hidden_states attention_mask "
    "context context_mask rotary_pos_emb rotary_pos_cos rotary_pos_sin attention_bias "
    "inference_params packed_seq_params sequence_len_offset embedding",
    "MultiTokenPredictionBlock.__init__": "config spec vp_stage pg_collection",
    "MultiTokenPredictionBlock.forward": "input_ids position_ids hidden_states attention_mask "
    "context context_mask rotary_pos_emb rotary_pos_cos rotary_pos_sin attention_bias "
    "inference_params packed_seq_params sequence_len_offset extra_block_kwargs embedding",
    "MTPLossLoggingHelper.save_loss_to_tracker": "loss layer_number num_layers reduce_group "
    "avg_group",
    "MTPLossLoggingHelper.track_mtp_metrics": "loss_scale iteration writer wandb_writer "
    "total_loss_dict",
    "MTPLossAutoScaler.set_loss_scale": "scale",
    "get_mtp_layer_spec": "transformer_layer_spec use_transformer_engine",
    "get_mtp_num_layers_to_build": "config vp_stage pp_rank",
}


@pytest.mark.world(1)
def test_mtp_signatures_are_megatron_cores():
    """The MTP classes and functions take megatron-core 0.16.1's parameters in its order."""
    import inspect

    from megatron.core.models.gpt import gpt_layer_specs

    signatures = dict(MCORE_SIGNATURES)
    signatures["get_gpt_mtp_block_spec"] = "config spec use_transformer_engine vp_stage pp_rank"
    for path, expected in signatures.items():
        owner = gpt_layer_specs if path == "get_gpt_mtp_block_spec" else mtp_module
        function = owner
        for part in path.split("."):
            function = getattr(function, part)
        params = inspect.signature(function).parameters.values()
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert [p for p in positional if p != "self"] == expected.split(), path


@pytest.mark.world(1)
def test_mtp_all_masked_microbatch_gives_zero_not_nan():
    """A microbatch without any target (N_k = 0 at every depth) adds nothing: every MTP
    gradient is zero, none NaN (megatron-core 0.16.1 divides by the count unclamped)."""
    model = _model(_config(), ProcessGroupCollection())
    MTPLossAutoScaler.set_loss_scale(torch.ones(1))
    rows = batch()
    mask = torch.zeros_like(rows["loss_mask"])
    out = model(rows["tokens"], None, labels=rows["labels"], loss_mask=mask)
    ((out * mask).sum() / mask.sum().clamp(min=1)).backward()
    for name, param in model.named_parameters():
        assert torch.isfinite(param.grad).all(), name
        if name.startswith("mtp."):
            assert not param.grad.any(), name


@pytest.mark.world(1)
def test_mtp_forward_gathers_each_tensor_once_over_cp(monkeypatch):
    """One forward with K = 2 depths under a (simulated) CP group of 2: the roll gathers each
    per-token tensor it shifts (ids, padding mask, labels, loss mask) once, whatever K, and
    the depths' counts N_k take one all-reduce (not one gather per depth and use, and one
    all-reduce per depth)."""
    calls = {"gather": 0, "reduce": 0}

    def gather(tensor, group):
        calls["gather"] += 1
        return torch.cat([tensor, tensor])  # the other shard: values do not matter here

    def reduce(tensor, group):
        calls["reduce"] += 1
        return tensor

    monkeypatch.setattr(mtp_module, "get_pg_size", lambda group: 2)
    monkeypatch.setattr(mtp_module, "get_pg_rank", lambda group: 0)
    monkeypatch.setattr(mtp_module, "all_gather_along_first_dim", gather)
    monkeypatch.setattr(mtp_module, "all_reduce", reduce)
    model = _model(_config(), ProcessGroupCollection())
    rows = batch()
    padding = torch.zeros_like(rows["loss_mask"], dtype=torch.bool)
    model(
        rows["tokens"],
        None,
        labels=rows["labels"],
        loss_mask=rows["loss_mask"],
        padding_mask=padding,
    )
    assert calls == {"gather": 4, "reduce": 1}


@pytest.mark.world(1)
def test_mtp_padding_mask_sharded_by_the_models_helper(monkeypatch):
    """Each depth's rolled padding mask is sharded like the hidden states by the one helper
    GPTModel uses (``shard_per_token_tensor``, megatron.core.utils; still importable from
    gpt_model), with the depth's TP group and the config's sequence parallelism."""
    from megatron.core import utils
    from megatron.core.models.gpt import gpt_model

    assert gpt_model.shard_per_token_tensor is utils.shard_per_token_tensor
    seen = []

    def spy(tensor, tp_group, sequence_parallel):
        seen.append((tp_group, sequence_parallel))
        return utils.shard_per_token_tensor(tensor, tp_group, sequence_parallel)

    monkeypatch.setattr(mtp_module, "shard_per_token_tensor", spy)
    model = _model(_config(), ProcessGroupCollection())
    rows = batch()
    padding = torch.zeros_like(rows["loss_mask"], dtype=torch.bool)
    model(rows["tokens"], None, labels=rows["labels"], padding_mask=padding)
    assert seen == [(layer.tp_group, False) for layer in model.mtp.layers]
