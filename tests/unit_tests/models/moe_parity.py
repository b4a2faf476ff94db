"""The MoE parity harness: one training step of a small MoE GPT under a parallel layout
(EP x ETP x TP(+SP) x CP x PP(+VPP) x DP) against the independent float64 reference
(``moe_reference.py``) on the whole global batch.

What is compared, on every rank (``check``):
- every ``main_grad`` after ``finalize_model_grads`` (experts by global expert index, each
  rank's expert-TP shard against the slice of the reference gradient; ``GroupedMLP``'s
  stacked weights through their per-expert views), and that every reference parameter is
  held by some rank;
- the parameters after one optimizer step (SGD, no momentum, no clipping: p - lr * grad),
  with or without the distributed optimizer, and the gradient norm the step reports;
- the expert bias after the step (sigmoid routing with aux-loss-free balancing);
- the logged router losses per MoE layer, (1/(D M)) sum_m loss_{m,l} / c (megatron-core
  logs them without the coefficient c), and the per-expert load (valid tokens of the
  dispatch map, summed over the global batch), exactly;
- the routing map of every token this rank routes (a forward hook on each router) against
  the reference's, whose top-k margins are checked first (``ROUTING_MARGIN``).

The model: Llama-style (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied),
4 layers, hidden 16, E = 4 experts of FFN 8; weights from the model's own seeded
initialization, read from a one-process model (so a layout-dependent initialization fails).
"""

import dataclasses
import functools
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.context_parallel import get_batch_on_this_cp_rank, slice_batch_for_cp_rank
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.loss_reporting import reduce_reported_losses
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils
from tests.unit_tests.dist_utils import rel_error
from tests.unit_tests.models.dense_gpt import Arch
from tests.unit_tests.models.moe_reference import (
    PER_TOKEN,
    MoEArch,
    check_margins,
    moe_gpt_forward,
    objective,
    updated_expert_bias,
)
from tests.unit_tests.models.naming import reference_names

SEQ, MICRO_BATCH, LR, SEED = 16, 2, 0.1, 23
TOLERANCE = 1e-5
ROUTING_MARGIN = 1e-4  # smallest top-k score gap the reference accepts (fp32 noise ~1e-6)
ARCH = Arch(
    "moe", layers=4, hidden=16, heads=4, groups=2, ffn=32, vocab=32, norm="RMSNorm",
    swiglu=True, rope=True, bias=False, tied=False,
)  # fmt: skip
EXPERTS, EXPERT_FFN, SHARED_FFN = 4, 8, 12
COEFF = {"aux": 0.05, "seq": 0.07, "z": 0.01}
ROUTERS = ("softmax", "presoftmax", "sigmoid-bias", "top1", "grouped")


@dataclass(frozen=True)
class MoECase:
    """One MoE parity case (``id`` reads like the spec)."""

    ep: int = 1
    etp: Optional[int] = None  # None: = TP (megatron-core's default)
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    dp: int = 1
    mb: int = 1
    mask: str = "full"  # full | uneven | single | empty
    mode: str = "averaged"  # averaged | per-token | legacy
    losses: str = "aux"  # aux | seq | z | none | all
    router: str = "softmax"  # see ROUTERS
    dispatcher: str = "alltoall"
    shared: bool = False
    mixed: bool = False  # dense and MoE layers
    grouped: bool = False  # GroupedMLP
    distopt: bool = False
    recompute: bool = False
    seed: int = 0  # data seed offset (a case whose reference has a near tie takes another)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def id(self) -> str:
        parts = [f"ep{self.ep}", f"etp{self.expert_tp}", f"tp{self.tp}"]
        parts += ["sp"] if self.tp > 1 else []
        parts += [f"cp{self.cp}", f"pp{self.pp}"] + ([f"vpp{self.vpp}"] if self.vpp else [])
        parts += [f"dp{self.dp}", f"mb{self.mb}", self.mask, self.mode, self.losses, self.router]
        parts += [self.dispatcher]
        for flag in ("shared", "mixed", "grouped", "distopt", "recompute"):
            if getattr(self, flag):
                parts.append(flag)
        parts += [f"seed{self.seed}"] if self.seed else []
        return "-".join(parts)

    def with_(self, **changes) -> "MoECase":
        return dataclasses.replace(self, **changes)

    def moe_arch(self) -> MoEArch:
        """The reference's description of this case's MoE."""
        r = self.router
        return MoEArch(
            experts=EXPERTS,
            topk=1 if r == "top1" else 2,
            ffn=EXPERT_FFN,
            layer_freq=(1, 0, 1, 1) if self.mixed else (),
            score="sigmoid" if r == "sigmoid-bias" else "softmax",
            pre_softmax=r in ("presoftmax", "top1", "grouped"),
            scaling=2.0 if r == "presoftmax" else None,
            num_groups=2 if r == "grouped" else None,
            group_topk=1 if r == "grouped" else None,
            expert_bias=r == "sigmoid-bias",
            aux=COEFF["aux"] if self.losses in ("aux", "all") else 0.0,
            seq_aux=COEFF["seq"] if self.losses in ("seq", "all") else 0.0,
            z=COEFF["z"] if self.losses in ("z", "all") else None,
            shared_ffn=SHARED_FFN if self.shared else None,
            shared_gate=self.shared,
        )

    def model_key(self) -> "MoECase":
        """The fields that define the reference (layout fields reset, G = D * M kept)."""
        return MoECase(
            mb=self.dp * self.mb,
            mask=self.mask,
            mode="per-token" if self.mode == PER_TOKEN else "averaged",
            losses=self.losses,
            router=self.router,
            shared=self.shared,
            mixed=self.mixed,
            seed=self.seed,
        )


# ----------------------------------------------------------------------------- config


def make_config(case: MoECase) -> TransformerConfig:
    moe = case.moe_arch()
    kinds, coeffs = [], []
    if moe.aux:
        kinds, coeffs = kinds + ["aux_loss"], coeffs + [moe.aux]
    if moe.seq_aux:
        kinds, coeffs = kinds + ["seq_aux_loss"], coeffs + [moe.seq_aux]
    if not kinds:
        balancing, aux_coeff = "none", 0.0
    elif len(kinds) == 1:
        balancing, aux_coeff = kinds[0], coeffs[0]
    else:
        balancing, aux_coeff = kinds, coeffs
    recompute = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if case.recompute
        else {}
    )
    return TransformerConfig(
        num_layers=ARCH.layers,
        hidden_size=ARCH.hidden,
        num_attention_heads=ARCH.heads,
        num_query_groups=ARCH.groups,
        ffn_hidden_size=ARCH.ffn,
        normalization=ARCH.norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
        tensor_model_parallel_size=case.tp,
        sequence_parallel=case.tp > 1,
        context_parallel_size=case.cp,
        pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=case.vpp,
        pipeline_dtype=torch.float32,
        calculate_per_token_loss=case.mode == PER_TOKEN,
        expert_model_parallel_size=case.ep,
        expert_tensor_parallel_size=case.expert_tp,
        num_moe_experts=moe.experts,
        moe_ffn_hidden_size=moe.ffn,
        moe_router_topk=moe.topk,
        moe_router_pre_softmax=moe.pre_softmax,
        moe_router_score_function=moe.score,
        moe_router_topk_scaling_factor=moe.scaling,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=moe.bias_rate,
        moe_router_load_balancing_type=balancing,
        moe_aux_loss_coeff=aux_coeff,
        moe_z_loss_coeff=moe.z,
        moe_shared_expert_intermediate_size=moe.shared_ffn,
        moe_shared_expert_gate=moe.shared_gate,
        moe_layer_freq=list(moe.layer_freq) if moe.layer_freq else 1,
        moe_token_dispatcher_type=case.dispatcher,
        moe_grouped_gemm=case.grouped,
        **recompute,
    )


def build_gpt(
    config, case: MoECase, groups, stage=0, stages=1, vp_stage=None, pp_rank=None, seed=SEED
):
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, vp_stage=vp_stage, pp_rank=pp_rank
    )
    return GPTModel(
        config,
        spec,
        ARCH.vocab,
        SEQ,
        pre_process=stage == 0,
        post_process=stage == stages - 1,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        vp_stage=vp_stage,
        pg_collection=groups,
        seed=seed,
        pp_rank=pp_rank,
    )


# ----------------------------------------------------------------------------- data


def global_batch(case: MoECase) -> Dict[str, torch.Tensor]:
    """G = D * M micro-batches ``[G, b, s]``: tokens, labels, loss_mask, position_ids and
    (unless ``full``) padding_mask (True = padding, a tail of each sequence).

    uneven: sequence lengths in [2, s], a prompt of random length masked from the loss;
    single: micro-batch 0 holds one valid token (the others uneven); empty: the last
    micro-batch is all padding (the others uneven)."""
    G = case.dp * case.mb
    mask_index = ("full", "uneven", "single", "empty").index(case.mask)
    gen = torch.Generator().manual_seed(SEED + 101 * G + 7 * mask_index + 1009 * case.seed)
    shape = (G, MICRO_BATCH, SEQ)
    tokens = torch.randint(0, ARCH.vocab, shape, generator=gen)
    labels = torch.randint(0, ARCH.vocab, shape, generator=gen)
    positions = torch.arange(SEQ)
    batch = {"tokens": tokens, "labels": labels, "position_ids": positions.expand(shape).clone()}
    if case.mask == "full":
        batch["loss_mask"] = torch.ones(shape)
        return batch
    length = torch.randint(2, SEQ + 1, shape[:2], generator=gen)
    if case.mask == "single":
        length[0] = torch.tensor([1, 0])
    if case.mask == "empty":
        length[-1] = 0
    prompt = (torch.rand(shape[:2], generator=gen) * (length - 1).clamp(min=0)).long()
    valid = positions < length[..., None]
    batch["padding_mask"] = ~valid
    batch["loss_mask"] = (valid & (positions >= prompt[..., None])).float()
    return batch


# ----------------------------------------------------------------------------- reference


@dataclass
class Reference:
    grads: Dict[str, torch.Tensor]
    stepped: Dict[str, torch.Tensor]
    grad_norm: float
    expert_bias: Dict[str, torch.Tensor]  # after the step (reference names)
    logged: Dict[str, List[float]]  # tracker name -> per MoE layer
    load: List[List[int]]  # per MoE layer, per expert
    routing: List[Dict[int, List[List[Tuple[int, ...]]]]]  # [g][layer][b][s] -> experts
    moe_layers: List[int]
    lm_loss: float  # sum S / sum N


def initial_params(case: MoECase) -> Dict[str, torch.Tensor]:
    """The one-process model's weights in reference names (float64)."""
    parallel_state.destroy_model_parallel()
    single = case.model_key()
    config = make_config(single)
    model = build_gpt(config, single, ProcessGroupCollection())
    params = {n: p.detach().double().clone() for n, p in reference_names(model)}
    for name, _ in model.named_buffers():
        if name.endswith("expert_bias"):
            params[_renumber(model, name)] = initial_expert_bias().double()
    return params


def initial_expert_bias() -> torch.Tensor:
    """The expert bias both sides start from (nonzero, so it takes part in the routing)."""
    return torch.linspace(-0.05, 0.05, EXPERTS)


@functools.lru_cache(maxsize=None)
def reference(key: MoECase) -> Reference:
    """The float64 reference step (``reference_step``), computed once per model-defining
    fields: by rank 0 and broadcast in a launch (an error there is raised on every rank)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return reference_step(key)
    box: List[object] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = reference_step(key)
        except Exception as error:  # noqa: BLE001 - re-raised on every rank below
            box[0] = f"{type(error).__name__}: {error}"
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise AssertionError(f"the reference failed on rank 0: {box[0]}")
    return box[0]


def reference_step(key: MoECase) -> Reference:
    """The float64 reference step of the case's model on its global batch."""
    moe = key.moe_arch()
    init = initial_params(key)
    biases = {n: v for n, v in init.items() if n.endswith("expert_bias")}
    params = {n: v.clone().requires_grad_() for n, v in init.items() if n not in biases}
    batch = global_batch(key)
    sums, counts, totals, routed, stats = [], [], [], [], []
    for g in range(key.mb):
        padding = batch["padding_mask"][g] if "padding_mask" in batch else None
        losses, per_layer = moe_gpt_forward(
            {**params, **biases}, ARCH, moe, batch["tokens"][g], batch["labels"][g], padding
        )
        mask = batch["loss_mask"][g].double()
        sums.append((losses * mask).sum())
        counts.append(mask.sum())
        totals.append(
            sum((st.total for st in per_layer.values()), torch.zeros((), dtype=torch.float64))
        )
        routed.append(int((~padding).sum()) if padding is not None else MICRO_BATCH * SEQ)
        stats.append(per_layer)
    near = check_margins(stats, ROUTING_MARGIN)
    if near:
        raise AssertionError(
            "routing guard: near ties in the reference (pick another SEED):\n" + "\n".join(near[:5])
        )
    J = objective(key.mode, sums, counts, totals, routed)
    names = list(params)
    grads = dict(zip(names, torch.autograd.grad(J, [params[n] for n in names])))
    stepped = {n: (params[n] - LR * grads[n]).detach() for n in names}
    norm = float(torch.sqrt(sum((g * g).sum() for g in grads.values())))
    moe_layers = sorted(stats[0])
    G = key.mb
    # megatron-core logs each router loss divided by its coefficient
    logged = {
        "load_balancing_loss": [
            sum(float(s[i].aux) for s in stats) / G / (moe.aux or 1.0) for i in moe_layers
        ],
        "seq_load_balancing_loss": [
            sum(float(s[i].seq_aux) for s in stats) / G / (moe.seq_aux or 1.0) for i in moe_layers
        ],
        "z_loss": [sum(float(s[i].z) for s in stats) / G / (moe.z or 1.0) for i in moe_layers],
    }
    load = [
        [sum(s[i].valid_counts[e] for s in stats) for e in range(moe.experts)] for i in moe_layers
    ]
    new_bias = {}
    for name, bias in biases.items():
        layer = int(name.split(".")[2])
        new_bias[name] = updated_expert_bias(bias, load[moe_layers.index(layer)], moe.bias_rate)
    routing = [
        {i: [[r.experts for r in row] for row in s[i].routing] for i in moe_layers} for s in stats
    ]
    lm_loss = float(sum(sums) / max(float(sum(counts)), 1.0))
    return Reference(grads, stepped, norm, new_bias, logged, load, routing, moe_layers, lm_loss)


# ----------------------------------------------------------------------------- distributed


def use_moe_layout(case: MoECase) -> ProcessGroupCollection:
    """parallel_state for the case (expert groups included) and its groups as a collection."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=case.vpp,
        context_parallel_size=case.cp,
        expert_model_parallel_size=case.ep,
        expert_tensor_parallel_size=case.expert_tp,
    )
    return ProcessGroupCollection.use_mpu_process_groups()


@dataclass
class Run:
    """What this rank saw in its step."""

    grads: Dict[str, torch.Tensor]  # reference name -> main_grad (local shard, as param)
    params: Dict[str, Tuple[torch.Tensor, torch.nn.Parameter]]  # after the step
    layouts: Dict[str, Tuple[str, torch.nn.Parameter]]  # reference name -> (kind, param)
    grad_norm: float
    expert_bias: Dict[str, torch.Tensor]
    metrics: Dict[str, torch.Tensor]
    routing: List[Tuple[int, int, torch.Tensor]]  # (micro-batch on this rank, layer, [T, k])
    count_problems: List[str]
    lm_loss: Optional[float]  # logged: sum S / sum N over the global batch (not legacy)
    num_zeros: Optional[float] = None  # the step's zero count (log_num_zeros_in_grad)


@dataclass
class Model:
    """This rank's chunks of the case's model: the GPTs, their DDP wrappers, the optimizer."""

    config: TransformerConfig
    gpts: List[GPTModel]
    chunks: List[DistributedDataParallel]
    optimizer: object


def build_model(
    case: MoECase,
    groups: ProcessGroupCollection,
    seed: int = SEED,
    configure=None,
    optimizer_overrides: Optional[Dict[str, object]] = None,
):
    """This rank's chunks (DDP-wrapped) and an SGD optimizer (no momentum, no clipping;
    ``optimizer_overrides``: other ``OptimizerConfig`` fields, e.g. Adam)."""
    config = make_config(case)
    if configure is not None:
        configure(config)
    pp_rank, vpp = groups.pp.rank(), case.vpp
    stages = case.pp * (vpp or 1)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=case.distopt
    )
    gpts, chunks = [], []
    for v in range(vpp or 1):
        gpt = build_gpt(
            config, case, groups, v * case.pp + pp_rank, stages, v if vpp else None, pp_rank, seed
        )
        for name, buf in gpt.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(initial_expert_bias())
        gpts.append(gpt)
        chunks.append(DistributedDataParallel(config, ddp_config, gpt, pg_collection=groups))
    config.no_sync_func = [c.no_sync for c in chunks] if vpp else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            **{
                "optimizer": "sgd",
                "lr": LR,
                "sgd_momentum": 0.0,
                "weight_decay": 0.0,
                "clip_grad": 1e9,  # never clips; the step then reports the gradient norm
                "use_distributed_optimizer": case.distopt,
                **(optimizer_overrides or {}),
            }
        ),
        chunks,
        pg_collection=groups,
    )
    return Model(config, gpts, chunks, optimizer)


def run_step(
    case: MoECase, groups: ProcessGroupCollection, configure=None, model: Optional[Model] = None
) -> Run:
    """One optimizer step of this rank's chunks (our schedule, DDP, finalize, optimizer)."""
    model = model or build_model(case, groups, configure=configure)
    config, gpts, chunks, optimizer = model.config, model.gpts, model.chunks, model.optimizer
    vpp = case.vpp
    routing: List[Tuple[int, int, torch.Tensor]] = []
    calls: Dict[int, int] = {}

    def capture(layer: int):
        def hook(module, inputs, output):
            if case.recompute and not torch.is_grad_enabled():
                return  # full recomputation: the pass that counts is the recomputed one
            k = calls.get(layer, 0)
            calls[layer] = k + 1
            topk = module.last_topk_indices.detach().sort(dim=-1).values.cpu()
            routing.append((k, layer, topk))

        return hook

    handles = []
    for gpt in gpts:
        for name, module in gpt.named_modules():
            if name.endswith("mlp.router"):
                layer = int(_renumber(gpt, name + ".x").split(".")[2])
                handles.append(module.register_forward_hook(capture(layer)))

    M = case.mb
    batch = global_batch(case)
    first = groups.dp.rank() * M
    microbatches = [
        get_batch_on_this_cp_rank({k: v[first + m] for k, v in batch.items()}, groups.cp)
        for m in range(M)
    ]
    # a fresh process's tracker: no entry left by another model of this launch (a z-loss
    # entry of a 2-layer model would be reported for this one, which tracks none)
    moe_utils.reset_aux_losses_tracker()
    count_problems: List[str] = []
    counts_fn = moe_utils.micro_batch_token_counts

    def spied_counts(routing_map, valid, group):
        """The count function must be pure: its inputs unchanged, the local counts local."""
        before = (routing_map.clone(), None if valid is None else valid.clone())
        counts = counts_fn(routing_map, valid, group)
        own = routing_map.shape[0] if valid is None else int(valid.sum())
        if not torch.equal(before[0], routing_map) or (
            valid is not None and not torch.equal(before[1], valid)
        ):
            count_problems.append("count function modified its inputs")
        if int(counts.local_tokens) != own:
            count_problems.append(f"local token count {int(counts.local_tokens)} != own {own}")
        return counts

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    iterators: List[Iterator] = [iter(microbatches) for _ in chunks]
    moe_utils.micro_batch_token_counts = spied_counts
    try:
        store = get_forward_backward_func(case.pp, vpp)(
            forward_step_func=functools.partial(forward_step, case, groups.cp),
            data_iterator=iterators if vpp else iterators[0],
            model=chunks if vpp else chunks[0],
            num_microbatches=M,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            pg_collection=groups,
        )
    finally:
        moe_utils.micro_batch_token_counts = counts_fn
        for h in handles:
            h.remove()
    grads, layouts = {}, {}
    for gpt in gpts:
        for name, kind, param, grad in expert_aware_names(gpt, groups):
            grads[name] = grad.detach().clone()
            layouts[name] = (kind, param)
    success, norm, num_zeros = optimizer.step()
    assert success
    for chunk in chunks:
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()
    params = {}
    for gpt in gpts:
        for name, _, value, _ in expert_aware_names(gpt, groups, values=True):
            params[name] = value
    biases = {}
    for gpt in gpts:
        for name, buf in gpt.named_buffers():
            if name.endswith("expert_bias"):
                biases[_renumber(gpt, name)] = buf.detach().double().clone()
    metrics = moe_utils.reduced_moe_metrics(
        1.0 / M, num_layers=ARCH.layers, moe_layer_freq=config.moe_layer_freq, pg_collection=groups
    )
    moe_utils.clear_aux_losses_tracker()
    lm_loss = None
    if case.mode != "legacy":
        lm_loss = reduce_reported_losses(store, groups.dp_cp).get("lm loss")
    return Run(
        grads,
        params,
        layouts,
        float(norm),
        biases,
        metrics,
        routing,
        count_problems,
        lm_loss,
        None if num_zeros is None else float(num_zeros),
    )


def forward_step(case: MoECase, cp_group, data_iterator, model):
    """The user's forward step: per-token losses; three-value (or legacy) callback."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        padding_mask=batch.get("padding_mask"),
    )
    mask = batch["loss_mask"]

    def three_values(output_tensor):
        loss_sum = (output_tensor * mask).sum()
        num_tokens = mask.sum().to(torch.int)
        return loss_sum, num_tokens, {"lm loss": [loss_sum.detach(), num_tokens]}

    def legacy(output_tensor):
        local = (output_tensor * mask).sum()
        totals = torch.stack([local.detach(), mask.sum()])
        if cp_group is not None and cp_group.size() > 1:
            dist.all_reduce(totals, group=cp_group)
        loss = (local + (totals[0] - local.detach())) / totals[1].clamp(min=1)
        return loss, {"lm loss": [loss.detach(), totals[1]]}

    return output, legacy if case.mode == "legacy" else three_values


# ----------------------------------------------------------------------------- names


def _renumber(gpt: GPTModel, name: str) -> str:
    """A chunk's parameter or buffer name with the global layer number."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(gpt.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def expert_aware_names(gpt: GPTModel, groups, values: bool = False):
    """(reference name, kind, tensor to compare, main_grad) for every parameter of a chunk:
    routed experts renamed to the global expert index (``SequentialMLP``'s names);
    ``GroupedMLP``'s weight1 / weight2 split into per-expert transposed views. ``kind`` says
    how the tensor is sharded: "tp" (the model's TP attributes), "etp" (expert TP), "full"."""
    ep_rank = groups.ep.rank() if groups.ep is not None else 0
    for name, param in gpt.named_parameters():
        value = param.detach() if values else None
        grad = getattr(param, "main_grad", None)
        ref = _renumber(gpt, name)
        if ".mlp.experts." not in ref:
            yield ref, "tp", (value if values else param), grad
            continue
        layer_prefix = ref.split(".mlp.experts.")[0] + ".mlp.experts.local_experts."
        experts = _experts_module(gpt, name)
        local = experts.num_local_experts
        first = ep_rank * local
        if ".local_experts." in ref:  # SequentialMLP
            i = int(ref.split(".local_experts.")[1].split(".")[0])
            rest = ref.split(".local_experts.")[1].split(".", 1)[1]
            yield f"{layer_prefix}{first + i}.{rest}", "etp", (value if values else param), grad
            continue
        proj = "linear_fc1" if ref.endswith("weight1") else "linear_fc2"
        vs = _per_expert(param.detach(), proj, local) if values else None
        gs = _per_expert(grad, proj, local) if grad is not None else None
        for i in range(local):
            yield (
                f"{layer_prefix}{first + i}.{proj}.weight",
                "etp-" + proj,
                vs[i] if values else param,
                None if gs is None else gs[i],
            )


def _per_expert(stacked: torch.Tensor, proj: str, local: int) -> torch.Tensor:
    """``GroupedMLP``'s weight1 [h, E_local F1] / weight2 [E_local F, h] (or their grads) as
    [E_local, out, in] views: expert i's fc1 / fc2 weight as ``SequentialMLP`` holds it.
    megatron-core's storage: expert i's W1^T is ``weight1.view(E_local, h, F1)[i]`` (the
    memory reinterpreted, not a column block) and W2^T is ``weight2.view(E_local, F, h)[i]``."""
    if proj == "linear_fc1":
        return stacked.view(local, ARCH.hidden, -1).transpose(1, 2)
    return stacked.view(local, -1, ARCH.hidden).transpose(1, 2)


def _experts_module(gpt: GPTModel, param_name: str):
    module = gpt
    for part in param_name.split(".mlp.experts.")[0].split(".") + ["mlp", "experts"]:
        module = getattr(module, part) if not part.isdigit() else module[int(part)]
    return module


def shard(full: torch.Tensor, dim: int, stride: int, size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full``: ``size * stride`` blocks along ``dim``, blocks
    rank, rank + size, ... (megatron's strided split)."""
    if size == 1:
        return full
    blocks = full.chunk(size * stride, dim=dim)
    return torch.cat(blocks[rank::size], dim=dim)


def expected_shard(full: torch.Tensor, name: str, kind: str, param, groups, case) -> torch.Tensor:
    """The slice of a reference tensor this rank's parameter (or view) holds."""
    if kind == "tp":
        if not getattr(param, "tensor_model_parallel", False):
            return full
        return shard(
            full,
            param.partition_dim,
            getattr(param, "partition_stride", 1),
            groups.tp.size(),
            groups.tp.rank(),
        )
    etp, rank = groups.expt_tp.size(), groups.expt_tp.rank()
    fc1 = "linear_fc1" in name
    stride = 2 if fc1 else 1  # the gated fc1 keeps its slices of both halves
    return shard(full, 0 if fc1 else 1, stride, etp, rank)


# ----------------------------------------------------------------------------- comparison


def check(case: MoECase, run: Run, groups) -> List[str]:
    """Failure messages of this rank's step against the reference."""
    ref = reference(case.model_key())
    failures = sorted(set(run.count_problems))
    for name, grad in run.grads.items():
        kind, param = run.layouts[name]
        if name not in ref.grads:
            failures.append(f"{name}: not in the reference")
            continue
        expected = expected_shard(ref.grads[name], name, kind, param, groups, case)
        err = rel_error(grad, expected)
        if not err <= TOLERANCE:
            failures.append(f"main_grad {name}: rel error {err:.2e}")
    for name, value in run.params.items():
        kind, param = run.layouts[name]
        expected = expected_shard(ref.stepped[name], name, kind, param, groups, case)
        err = rel_error(value, expected)
        if not err <= TOLERANCE:
            failures.append(f"stepped {name}: rel error {err:.2e}")
    if run.lm_loss is not None and abs(run.lm_loss - ref.lm_loss) > TOLERANCE * ref.lm_loss:
        failures.append(f"logged lm loss {run.lm_loss} != reference {ref.lm_loss}")
    if abs(run.grad_norm - ref.grad_norm) > TOLERANCE * ref.grad_norm:
        failures.append(f"grad norm {run.grad_norm} != reference {ref.grad_norm}")
    for name, bias in run.expert_bias.items():
        if not torch.allclose(bias, ref.expert_bias[name], rtol=0, atol=1e-7):
            failures.append(
                f"{name} after the step {bias.tolist()} != {ref.expert_bias[name].tolist()}"
            )
    for name, values in ref.logged.items():
        if all(v == 0 for v in values) and name not in run.metrics:
            continue
        got = run.metrics.get(name)
        if got is None:
            failures.append(f"logged {name}: missing")
            continue
        got = [float(x) for x in got]
        if len(got) != len(values) or any(
            abs(a - b) > TOLERANCE * max(abs(b), 1e-3) for a, b in zip(got, values)
        ):
            failures.append(f"logged {name} {got} != reference {values}")
    load = run.metrics.get("tokens_per_expert")
    if load is None or load.tolist() != ref.load:
        failures.append(
            f"per-expert load {None if load is None else load.tolist()} != reference {ref.load}"
        )
    failures += check_routing(case, run, groups, ref)
    held: List[Optional[List[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(run.grads))
    missing = set(ref.grads) - {n for names in held for n in names}
    if missing:
        failures.append(f"no rank holds {sorted(missing)}")
    return failures


def check_routing(case: MoECase, run: Run, groups, ref: Reference) -> List[str]:
    """Every routed token's experts equal the reference's (tokens this rank holds: its CP
    positions, then its SP block of them; rows s-major as [s, b])."""
    positions = slice_batch_for_cp_rank(
        {"p": torch.arange(SEQ).view(1, SEQ)}, groups.cp.size(), groups.cp.rank()
    )["p"].view(-1)
    if case.tp > 1:
        positions = positions.chunk(groups.tp.size())[groups.tp.rank()]
    first = groups.dp.rank() * case.mb
    failures = []
    seen = set()
    for m, layer, topk in run.routing:
        seen.add((m, layer))
        expected = torch.tensor(
            [
                sorted(ref.routing[first + m][layer][b][int(s)])
                for s in positions
                for b in range(MICRO_BATCH)
            ]
        )
        if topk.shape != expected.shape or not torch.equal(topk, expected):
            bad = int((topk != expected).any(-1).sum()) if topk.shape == expected.shape else -1
            failures.append(
                f"routing map of micro-batch {first + m} layer {layer}: {bad} tokens differ"
            )
    mine = {
        i
        for i in ref.moe_layers
        if any(name.startswith(f"decoder.layers.{i}.mlp.router") for name in run.grads)
    }
    expected_calls = {(m, i) for m in range(case.mb) for i in mine}
    if seen != expected_calls:
        failures.append(f"routing maps seen for {sorted(seen)}, expected {sorted(expected_calls)}")
    return failures
