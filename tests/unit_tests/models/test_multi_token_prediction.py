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
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
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
        sequence_parallel=layout.sp,
        context_parallel_size=layout.cp,
        pipeline_model_parallel_size=layout.pp,
    )
    return TransformerConfig(**{**fields, **extra})


def _model(config, groups, pp_rank: int = 0, tied: bool = False) -> GPTModel:
    spec = get_gpt_layer_local_spec()
    last = pp_rank == config.pipeline_model_parallel_size - 1
    return GPTModel(
        config,
        spec,
        VOCAB,
        SEQ,
        pre_process=pp_rank == 0,
        post_process=last,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, False, pp_rank=pp_rank),
        pg_collection=groups,
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
    out[:, : SEQ - k] = tensor[:, k:]
    return out


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def _masked_mean(logits, labels, mask) -> torch.Tensor:
    """sum(mask * CE) / max(sum(mask), 1) of logits [b, s, V]."""
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    return (losses * mask.reshape(-1)).sum() / mask.sum().clamp(min=1)


def reference_objective(model: GPTModel, rows: Dict[str, torch.Tensor], tied: bool):
    """(objective of the whole batch, [depth k's S_k / max(N_k, 1) averaged over the
    microbatches]) from ``model``'s parameters; see the module docstring."""
    captured = {}
    hook = model.decoder.register_forward_hook(lambda m, i, o: captured.update(h=o))
    angles = model.rotary_pos_emb(SEQ, packed_seq=True)
    words = model.embedding.word_embeddings.weight
    output = words if tied else model.output_layer.weight
    total, logged = 0.0, [0.0] * DEPTHS
    microbatches = ROWS // MICRO
    for m in range(microbatches):
        part = {key: value[m * MICRO : (m + 1) * MICRO] for key, value in rows.items()}
        logits = model(part["tokens"], None)
        objective = _masked_mean(logits, part["labels"], part["loss_mask"])
        hidden = captured["h"]
        for k, depth in enumerate(model.mtp.layers, start=1):
            embedded = words[_shift(part["tokens"], k)].transpose(0, 1)
            combined = torch.cat(
                [_rms(embedded, depth.enorm.weight), _rms(hidden, depth.hnorm.weight)], -1
            )
            x, _ = depth.transformer_layer(
                combined @ depth.eh_proj.weight.t(), rotary_pos_emb=angles
            )
            hidden = _rms(x, depth.final_layernorm.weight)
            logits_k = (hidden @ output.t()).transpose(0, 1)
            loss_k = _masked_mean(logits_k, _shift(part["labels"], k), _shift(part["loss_mask"], k))
            objective = objective + FACTOR / DEPTHS * loss_k
            logged[k - 1] += loss_k.item() / microbatches
        total = total + objective / microbatches
    hook.remove()
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


@functools.lru_cache(maxsize=None)
def reference(tied: bool = False):
    """(one-process name -> reference gradient, logged MTP losses)."""
    model = _model(_config(), _single_rank_groups(), tied=tied)
    objective, logged = reference_objective(model, batch(), tied)
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


def _mismatches(model: GPTModel, expected: dict, tp: int, tp_rank: int, attr: str) -> List[str]:
    bad = []
    for name, param in reference_names(model):
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
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mtp_matches_reference_at_one_process(tied):
    """Every gradient of a 2-microbatch step (uneven masks, a fully masked row) equals the
    reference's, and the logged "mtp_k loss" equal the reference's mean S_k / max(N_k, 1)."""
    expected, logged = reference(tied)
    model = _model(_config(), ProcessGroupCollection(), tied=tied)
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
    expected, _ = reference(tied)
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    config = _config(layout, **extra)
    pp_rank = groups.pp.rank()
    gpt = _model(config, groups, pp_rank, tied)
    chunk = DistributedDataParallel(config, DistributedDataParallelConfig(), gpt, groups)
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
    chunk.zero_grad_buffer()
    get_forward_backward_func(layout.pp)(
        forward_step_func=_forward_step(rows),
        data_iterator=iter(parts),
        model=chunk,
        num_microbatches=count,
        seq_length=SEQ,
        micro_batch_size=MICRO,
        pg_collection=groups,
    )
    return _mismatches(gpt, expected, layout.tp, groups.tp.rank(), "main_grad")


LAYOUTS = [
    (Layout(tp=2, sp=True), False),
    (Layout(cp=2), False),
    (Layout(pp=2), False),
    (Layout(pp=2), True),
    (Layout(dp=2), False),
]


@pytest.mark.world(2)
@pytest.mark.parametrize(
    "layout, tied", LAYOUTS, ids=lambda c: c.id if isinstance(c, Layout) else ("tied" if c else "")
)
def test_mtp_layouts_match_reference(layout, tied):
    """Every main_grad at tp2-sp, cp2 (uneven masks: a shard with no target), pp2 (MTP on the
    last stage; its embedding copy summed with the first stage's, tied or not), dp2 equals
    the reference's shard."""
    assert_no_failures(distributed_step(layout, tied))


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
