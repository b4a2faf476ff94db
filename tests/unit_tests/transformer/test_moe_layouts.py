"""The MoE GPT trains the same objective under expert, tensor (with SP), context, pipeline
and data parallelism as in one process: every ``main_grad`` after ``finalize_model_grads``
(experts matched by GLOBAL index), the logged router losses and the per-expert token loads
equal those of the one-process run of the same model on the whole global batch.

This is the layout-invariance check of the implementation against itself (float64, quick,
4 gloo ranks); the independent float64 per-token reference, the full matrix and the
negative controls are moe-parity's bucket (tests/unit_tests/models/test_moe_parity.py).
"""

import functools
from dataclasses import dataclass
from typing import Dict, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils
from tests.unit_tests.dist_utils import WORLD_SIZE, assert_no_failures, rel_error

SEQ, MICRO_BATCH, G, VOCAB, SEED = 8, 2, 4, 32, 5
EXPERTS = 4


@dataclass(frozen=True)
class MoELayout:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    dispatcher: str = "allgather"
    grouped: bool = False

    @property
    def dp(self) -> int:
        return WORLD_SIZE // (self.tp * self.cp * self.pp)

    @property
    def id(self) -> str:
        etp = self.etp if self.etp is not None else self.tp
        parts = [f"tp{self.tp}-sp" if self.tp > 1 else "", f"cp{self.cp}" if self.cp > 1 else ""]
        parts += [f"pp{self.pp}" if self.pp > 1 else "", f"ep{self.ep}", f"etp{etp}"]
        parts += [f"dp{self.dp}", self.dispatcher, "grouped" if self.grouped else "sequential"]
        return "-".join(p for p in parts if p)


SLOW = pytest.mark.slow


def _id(layout) -> str:
    return layout.id


LAYOUTS = [
    MoELayout(tp=2, ep=2, etp=1),
    pytest.param(MoELayout(tp=2, ep=1, etp=2), marks=SLOW),
    pytest.param(MoELayout(tp=2, ep=1, etp=1), marks=SLOW),  # expert DP spans TP (PR #1622)
    MoELayout(ep=4, dispatcher="alltoall", grouped=True),
    pytest.param(MoELayout(tp=2, ep=2, etp=2, dispatcher="alltoall"), marks=SLOW),
    pytest.param(MoELayout(cp=2, pp=2, ep=2, dispatcher="alltoall"), marks=SLOW),
]


def make_config(layout: MoELayout, per_token: bool) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=32,
        moe_ffn_hidden_size=16,
        num_moe_experts=EXPERTS,
        moe_router_topk=2,
        moe_aux_loss_coeff=0.1,
        moe_z_loss_coeff=0.01,
        moe_shared_expert_intermediate_size=16,
        moe_shared_expert_gate=True,
        moe_layer_freq=[1, 1],
        moe_token_dispatcher_type=layout.dispatcher,
        moe_grouped_gemm=layout.grouped,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
        params_dtype=torch.float64,
        pipeline_dtype=torch.float64,
        tensor_model_parallel_size=layout.tp,
        sequence_parallel=layout.tp > 1,
        context_parallel_size=layout.cp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        calculate_per_token_loss=per_token,
    )


def global_batch() -> Dict[str, torch.Tensor]:
    """G microbatches [b, s]; padding at the ends of some sequences, one all padding."""
    gen = torch.Generator().manual_seed(SEED)
    shape = (G, MICRO_BATCH, SEQ)
    lengths = torch.randint(1, SEQ + 1, shape[:2], generator=gen)
    lengths[2, 1] = 0
    padding = torch.arange(SEQ) >= lengths[..., None]
    return {
        "tokens": torch.randint(0, VOCAB, shape, generator=gen),
        "labels": torch.randint(0, VOCAB, shape, generator=gen),
        "loss_mask": (~padding).double(),
        "padding_mask": padding,
        "position_ids": torch.arange(SEQ).expand(shape).contiguous(),
    }


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        labels=batch["labels"],
        padding_mask=batch["padding_mask"],
    )

    def loss_func(output_tensor):
        loss_sum = (output_tensor * batch["loss_mask"]).sum()
        num_tokens = batch["loss_mask"].sum().to(torch.int)
        return loss_sum, num_tokens, {"lm loss": [loss_sum.detach(), num_tokens]}

    return output, loss_func


def train_step(config, groups, layout: MoELayout, microbatches, num_microbatches):
    """One step: {global name: main_grad} of this rank and the reduced MoE metrics."""
    pp_rank = 0 if groups.pp is None else groups.pp.rank()
    model = GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=pp_rank),
        VOCAB,
        SEQ,
        pre_process=pp_rank == 0,
        post_process=pp_rank == layout.pp - 1,
        position_embedding_type="rope",
        pg_collection=groups,
        seed=SEED,
        pp_rank=pp_rank,
    )
    chunk = DistributedDataParallel(
        config, DistributedDataParallelConfig(), model, pg_collection=groups
    )
    config.no_sync_func = chunk.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    moe_utils.clear_aux_losses_tracker()
    get_forward_backward_func(layout.pp, None)(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=chunk,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        pg_collection=groups,
    )
    metrics = moe_utils.reduced_moe_metrics(
        1.0 / num_microbatches, config.num_layers, config.moe_layer_freq, groups
    )
    moe_utils.clear_aux_losses_tracker()
    return global_grads(model, layout), metrics


def global_grads(model: GPTModel, layout: MoELayout) -> Dict[str, torch.Tensor]:
    """main_grads by one-process name; expert weights by global expert index (full ETP
    tensor gathered), TP-split dense weights gathered."""
    out = {}
    for name, param, grad in _per_expert(model):
        name = model._reference_name(name)
        if ".local_experts." in name:
            parts = name.split(".")
            at = parts.index("local_experts") + 1
            first = model.decoder.layers[0].mlp.local_expert_indices[0]
            parts[at] = str(first + int(parts[at]))
            name = ".".join(parts)
            group = model.decoder.layers[0].mlp.experts.tp_group
        else:
            group = model.tp_group
        if getattr(param, "tensor_model_parallel", False) and group is not None:
            size = group.size()
            if size > 1:
                pieces = [torch.empty_like(grad) for _ in range(size)]
                dist.all_gather(pieces, grad.contiguous(), group=group)
                dim, stride = param.partition_dim, param.partition_stride
                blocks = [p.chunk(stride, dim=dim) for p in pieces]
                grad = torch.cat([b[s] for s in range(stride) for b in blocks], dim=dim)
        out[name] = grad.clone()
    return out


def _per_expert(model: GPTModel):
    """(name, param-like, main_grad) with GroupedMLP's stacked weights split into
    SequentialMLP's per-expert names and layouts."""
    for name, param in model.named_parameters():
        grad = param.main_grad.detach()
        if not name.endswith(("experts.weight1", "experts.weight2")):
            yield name, param, grad
            continue
        experts = model.get_submodule(name.rsplit(".", 1)[0])
        prefix = name.rsplit(".", 1)[0]
        if name.endswith("weight1"):
            views = grad.view(experts.num_local_experts, experts.config.hidden_size, -1)
            proj, dim, stride = "linear_fc1", 0, 2 if experts.config.gated_linear_unit else 1
        else:
            views = grad.view(experts.num_local_experts, -1, experts.config.hidden_size)
            proj, dim, stride = "linear_fc2", 1, 1
        for i in range(experts.num_local_experts):
            like = _Like(dim, stride)
            yield f"{prefix}.local_experts.{i}.{proj}.weight", like, views[i].t().contiguous()


class _Like:
    tensor_model_parallel = True

    def __init__(self, dim, stride):
        self.partition_dim, self.partition_stride = dim, stride


def _groups() -> ProcessGroupCollection:
    return ProcessGroupCollection.use_mpu_process_groups()


@functools.lru_cache(maxsize=None)
def one_process(per_token: bool):
    """The same model and global batch in one process (singleton groups; no parallel_state
    layout, so no group the collection leaves out falls back to an earlier test's)."""
    parallel_state.destroy_model_parallel()
    single = dist.new_subgroups(group_size=1)[0]
    groups = ProcessGroupCollection(dp_cp=single, expt_dp=single, pp=single, dp=single)
    config = make_config(MoELayout(), per_token)
    batch = global_batch()
    microbatches = [{k: v[g] for k, v in batch.items()} for g in range(G)]
    return train_step(config, groups, MoELayout(), microbatches, G)


@pytest.mark.world(4)
@pytest.mark.parametrize(
    "per_token", [False, pytest.param(True, marks=SLOW)], ids=["averaged", "per-token"]
)
@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
def test_moe_layout_matches_one_process(layout: MoELayout, per_token: bool):
    expected_grads, expected_metrics = one_process(per_token)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    try:
        groups = _groups()
        config = make_config(layout, per_token)
        m = G // layout.dp
        first = groups.dp.rank() * m
        batch = global_batch()
        microbatches = [
            get_batch_on_this_cp_rank({k: v[first + i] for k, v in batch.items()}, groups.cp)
            for i in range(m)
        ]
        grads, metrics = train_step(config, groups, layout, microbatches, m)
    finally:
        parallel_state.destroy_model_parallel()
    failures = []
    for name, grad in grads.items():
        err = rel_error(grad, expected_grads[name])
        if not err <= 1e-10:
            failures.append(f"{layout.id} main_grad {name}: relative error {err:.2e}")
    for name, value in expected_metrics.items():
        if name == "tokens_per_expert":
            if not torch.equal(metrics[name], value):
                failures.append(f"{layout.id} {name}: {metrics[name].tolist()} != {value.tolist()}")
        elif not rel_error(metrics[name], value) <= 1e-10:
            failures.append(f"{layout.id} {name}: {metrics[name].tolist()} != {value.tolist()}")
    assert_no_failures(failures)
