"""Parity harness: one training step under a parallel layout versus a dense reference.

The model is a token-wise network (no attention, so any context-parallel split is exact):

    h_0 = E[token];  h_{l+1} = h_l + tanh(h_l W_l + b_l);  logits = h_L O  (O = E^T if tied)
    loss_t = cross_entropy(logits_t, label_t)

with ``NUM_LAYERS`` layers whatever the layout, so the reference is the same model for every
case. The reference (``reference_step``) is written directly on a dict of float64 tensors
and knows nothing of chunks, shards, schedules or DDP. ``run_step`` builds this rank's
chunks, wraps them in our DDP, runs our schedule and ``finalize_model_grads``, and returns
what the comparison needs.
"""

import functools
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.context_parallel import slice_batch_for_cp_rank
from megatron.core.device import comm_device
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.loss_reporting import reduce_reported_losses
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

NUM_LAYERS, HIDDEN, VOCAB, SEQ, MICRO_BATCH = 8, 8, 13, 16, 2
LR = 0.1
MASKS = ("full", "uneven", "single", "empty", "varying")
MODES = ("averaged", "per-token", "legacy")


@dataclass(frozen=True)
class Case:
    """One parity case: layout sizes, microbatches, mask kind, loss mode, DDP options."""

    cp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    dp: int = 1
    microbatches: int = 1
    mask: str = "full"
    mode: str = "averaged"
    overlap: bool = False
    average_in_collective: bool = False
    bucket_size: Optional[int] = None
    batch_p2p: bool = True
    tie: bool = False
    groups: str = "explicit"  # "explicit" pg_collection, or "mpu" (none passed: fallback)
    seed: int = 0

    @property
    def id(self) -> str:
        vpp = f"-vpp{self.vpp}" if self.vpp else ""
        extra = "".join(
            [
                "-overlap" if self.overlap else "",
                "-avgcoll" if self.average_in_collective else "",
                f"-bucket{self.bucket_size}" if self.bucket_size else "",
                "-nobatchp2p" if not self.batch_p2p else "",
                "-tied" if self.tie else "",
                "-mpu" if self.groups == "mpu" else "",
            ]
        )
        return (
            f"cp{self.cp}-pp{self.pp}{vpp}-dp{self.dp}-mb{self.microbatches}-{self.mask}-"
            f"{self.mode}{extra}"
        )

    @property
    def world(self) -> int:
        return self.cp * self.pp * self.dp

    def with_(self, **changes) -> "Case":
        return replace(self, **changes)


# ----------------------------------------------------------------------------- data


def initial_params(tie: bool) -> Dict[str, torch.Tensor]:
    """Layout-independent float64 initial weights, each from its own seeded generator."""

    def normal(index: int, *shape: int, std: float) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 + index)
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * std

    params = {"embedding": normal(0, VOCAB, HIDDEN, std=1.0)}
    for layer in range(NUM_LAYERS):
        params[f"layer{layer}.weight"] = normal(10 + 2 * layer, HIDDEN, HIDDEN, std=0.5)
        params[f"layer{layer}.bias"] = normal(11 + 2 * layer, HIDDEN, std=0.1)
    if not tie:
        params["output"] = normal(1, HIDDEN, VOCAB, std=0.5)
    return params


def global_batch(case: Case) -> Dict[str, torch.Tensor]:
    """Tokens, labels and loss mask for all D*M microbatches: ``[D*M, b, s]`` each.

    Microbatch g = d*M + m belongs to data-parallel replica d. Masks: full; uneven
    (prompt-masked: a prompt of random length is excluded); single (one valid token,
    anywhere); empty (as uneven, but the last microbatch has no valid token); varying
    (microbatch g keeps about (g+1)/(D*M) of its tokens, at random places).
    """
    n = case.dp * case.microbatches
    gen = torch.Generator().manual_seed(7919 * case.seed + 17 * n + MASKS.index(case.mask))
    tokens = torch.randint(0, VOCAB, (n, MICRO_BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (n, MICRO_BATCH, SEQ), generator=gen)
    mask = torch.ones(n, MICRO_BATCH, SEQ)
    if case.mask in ("uneven", "empty"):
        prompt = torch.randint(2, SEQ - 1, (n, MICRO_BATCH), generator=gen)
        mask = (torch.arange(SEQ) >= prompt[..., None]).float()
        if case.mask == "empty":
            mask[-1] = 0.0
    elif case.mask == "single":
        mask = torch.zeros(n, MICRO_BATCH, SEQ)
        for g in range(n):
            flat = int(torch.randint(0, MICRO_BATCH * SEQ, (1,), generator=gen))
            mask[g].view(-1)[flat] = 1.0
    elif case.mask == "varying":
        keep = torch.rand(n, MICRO_BATCH, SEQ, generator=gen)
        mask = (keep < ((torch.arange(n) + 1.0) / n)[:, None, None]).float()
    return {"tokens": tokens, "labels": labels, "loss_mask": mask}


# ----------------------------------------------------------------------------- reference


def reference_step(
    case: Case,
) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor], torch.Tensor]:
    """Dense float64 gradient of the case's objective on the whole global batch.

    averaged / legacy:  J = 1/(D*M) * sum_g S_g / max(N_g, 1)
    per-token:          J = sum_g S_g / max(sum_g N_g, 1)
    with S_g = sum_t mask_t * loss_t and N_g = sum_t mask_t over microbatch g.
    Returns (gradients, parameters after one SGD step, per-token losses ``[D*M, b, s]``).
    """
    params = {k: v.clone().requires_grad_(True) for k, v in initial_params(case.tie).items()}
    batch = global_batch(case)
    h = params["embedding"][batch["tokens"]]
    for layer in range(NUM_LAYERS):
        h = h + torch.tanh(h @ params[f"layer{layer}.weight"] + params[f"layer{layer}.bias"])
    out = params["embedding"].t() if case.tie else params["output"]
    logits = h @ out
    losses = F.cross_entropy(
        logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), reduction="none"
    ).view(batch["labels"].shape)
    mask = batch["loss_mask"].double()
    sums, counts = (losses * mask).sum(dim=(1, 2)), mask.sum(dim=(1, 2))
    if case.mode == "per-token":
        objective = sums.sum() / counts.sum().clamp(min=1)
    else:
        objective = (sums / counts.clamp(min=1)).sum() / len(sums)
    names = list(params)
    grads = dict(zip(names, torch.autograd.grad(objective, [params[n] for n in names])))
    stepped = {n: (params[n] - LR * grads[n]).detach() for n in names}
    return grads, stepped, losses.detach()


# ----------------------------------------------------------------------------- model


class TokenwiseChunk(torch.nn.Module):
    """The layers ``layer_ids`` of the token-wise model, as one pipeline chunk.

    Hidden states between chunks are ``[s, b, h]``; the last chunk returns per-token
    losses ``[b, s]``. With tied weights the last stage keeps its own copy of E.
    """

    def __init__(self, config, layer_ids, pre_process, post_process, tie, init):
        super().__init__()
        self.config, self.layer_ids = config, list(layer_ids)
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = tie
        device = comm_device()  # CPU with gloo, the current GPU with nccl
        as_param = lambda name: torch.nn.Parameter(  # noqa: E731
            init[name].to(device=device, dtype=torch.float32)
        )
        if pre_process:
            self.embedding = as_param("embedding")
        self.weights = torch.nn.ParameterList([as_param(f"layer{i}.weight") for i in layer_ids])
        self.biases = torch.nn.ParameterList([as_param(f"layer{i}.bias") for i in layer_ids])
        if post_process and not (tie and pre_process):
            self.output = as_param("embedding" if tie else "output")
        self.input_tensor = None

    def set_input_tensor(self, input_tensor) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter:
        return self.embedding if self.pre_process else self.output

    def global_names(self) -> Dict[str, torch.nn.Parameter]:
        """Reference names of this chunk's parameters (the tied copy maps to E)."""
        names = {}
        if self.pre_process:
            names["embedding"] = self.embedding
        for layer, w, b in zip(self.layer_ids, self.weights, self.biases):
            names[f"layer{layer}.weight"], names[f"layer{layer}.bias"] = w, b
        if hasattr(self, "output"):
            names["embedding" if self.share_embeddings_and_output_weights else "output"] = (
                self.output
            )
        return names

    def forward(self, tokens, labels):
        h = self.embedding[tokens].transpose(0, 1) if self.pre_process else self.input_tensor
        for w, b in zip(self.weights, self.biases):
            h = h + torch.tanh(h @ w + b)
        if not self.post_process:
            return h
        if self.share_embeddings_and_output_weights:
            weight = (self.embedding if self.pre_process else self.output).t()
        else:
            weight = self.output
        logits = (h @ weight).transpose(0, 1)
        return F.cross_entropy(
            logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none"
        ).view(labels.shape)


# ----------------------------------------------------------------------------- the step


@dataclass
class StepResult:
    """What one rank saw: its parameters' main_grads and stepped values (reference names),
    the reported entries with the values the loss callback produced, and the counts."""

    grads: Dict[str, torch.Tensor] = field(default_factory=dict)
    stepped: Dict[str, torch.Tensor] = field(default_factory=dict)
    reported: List[dict] = field(default_factory=list)
    produced: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    finalize_tokens: Optional[torch.Tensor] = None
    finalize_calls: int = 0
    logged: Dict[str, float] = field(default_factory=dict)
    local_counts: List[float] = field(default_factory=list)
    local_sums: List[float] = field(default_factory=list)
    microbatch_ids: List[int] = field(default_factory=list)
    positions: Optional[torch.Tensor] = None


def explicit_groups(groups: Optional[ProcessGroupCollection] = None) -> ProcessGroupCollection:
    """The parallel_state groups as an explicit collection (overridable per field)."""
    return groups or ProcessGroupCollection.use_mpu_process_groups()


def run_step(
    case: Case,
    pg_collection: Optional[ProcessGroupCollection] = None,
    dp_rank: Optional[int] = None,
    cp_group: Optional[dist.ProcessGroup] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    configure: Optional[Callable] = None,
) -> StepResult:
    """One training step of ``case`` on this rank with our schedule, DDP and finalize.

    Groups come from ``pg_collection`` (given, or parallel_state's as an explicit
    collection), or nowhere at all when ``case.groups == "mpu"`` (the fallback path).
    """
    if not dist.is_initialized():  # one process, no groups anywhere: C = PP = D = 1
        pp_rank, pp_size, cp_size, cp_rank, dp_rank = 0, 1, 1, 0, 0
    else:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        pp_rank, pp_size = pp_group.rank(), pp_group.size()
        if case.groups == "explicit":
            pg_collection = explicit_groups(pg_collection)
            cp_group = pg_collection.cp
        else:
            pg_collection, cp_group = None, parallel_state.get_context_parallel_group()
        if dp_rank is None:
            dp_rank = parallel_state.get_data_parallel_rank()
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
    vpp = case.vpp or 1
    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=case.vpp,
        context_parallel_size=case.cp,
        pipeline_dtype=torch.float32,
        calculate_per_token_loss=case.mode == "per-token",
        batch_p2p_comm=case.batch_p2p,
        deallocate_pipeline_outputs=True,
        finalize_model_grads_func=finalize_model_grads,
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=case.overlap,
        average_in_collective=case.average_in_collective,
        bucket_size=case.bucket_size,
    )
    init = initial_params(case.tie)
    if NUM_LAYERS % (pp_size * vpp):
        raise ValueError(f"{NUM_LAYERS} layers do not split into {pp_size * vpp} chunks")
    per_chunk = NUM_LAYERS // (pp_size * vpp)
    chunks = []
    for v in range(vpp):
        stage = v * pp_size + pp_rank
        chunk = TokenwiseChunk(
            config,
            range(stage * per_chunk, (stage + 1) * per_chunk),
            stage == 0,
            stage == pp_size * vpp - 1,
            case.tie,
            init,
        )
        chunks.append(
            DistributedDataParallel(config, ddp_config, chunk, pg_collection=pg_collection)
        )
    config.no_sync_func = [c.no_sync for c in chunks] if vpp > 1 else chunks[0].no_sync
    if case.overlap:
        config.grad_sync_func = (
            [c.start_grad_sync for c in chunks] if vpp > 1 else (chunks[0].start_grad_sync)
        )

    batch = global_batch(case)
    result = StepResult(positions=_positions(cp_size, cp_rank))
    microbatches = []
    for m in range(case.microbatches):
        g = dp_rank * case.microbatches + m
        shard = slice_batch_for_cp_rank({k: v[g] for k, v in batch.items()}, cp_size, cp_rank)
        microbatches.append({k: v.to(comm_device()) for k, v in shard.items()})
        result.microbatch_ids.append(g)
    loss_fn = _loss_function(case, cp_group, result)

    def forward_step_func(data_iterator, model):
        mb = next(data_iterator)
        return model(mb["tokens"], mb["labels"]), functools.partial(loss_fn, mb["loss_mask"])

    def capture_finalize(model, num_tokens=None, **kwargs):
        result.finalize_calls += 1
        result.finalize_tokens = None if num_tokens is None else num_tokens.clone()
        finalize_model_grads(model, num_tokens, **kwargs)

    config.finalize_model_grads_func = capture_finalize
    if configure is not None:
        configure(config)
    for c in chunks:
        c.zero_grad_buffer()
    iterators = [iter(microbatches) for _ in chunks]
    schedule = get_forward_backward_func(pp_size, case.vpp)
    store = schedule(
        forward_step_func=forward_step_func,
        data_iterator=iterators if vpp > 1 else iterators[0],
        model=chunks if vpp > 1 else chunks[0],
        num_microbatches=case.microbatches,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        pg_collection=pg_collection,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )
    result.reported = store
    if case.mode != "legacy":
        dp_cp = None
        if dist.is_initialized():
            dp_cp = (
                pg_collection.dp_cp
                if pg_collection is not None
                else parallel_state.get_data_parallel_group(with_context_parallel=True)
            )
        result.logged = reduce_reported_losses(store, dp_cp)
    for c in chunks:
        for name, param in c.module.global_names().items():
            result.grads[name] = param.main_grad.detach().clone()
            result.stepped[name] = (param.detach() - LR * param.main_grad).clone()
    return result


def check_step(case: Case, result: StepResult, tol: float = 1e-5) -> List[str]:
    """Failure messages comparing one rank's step with the dense reference."""
    from tests.unit_tests.dist_utils import compare_tensors

    grads, stepped, losses = reference_step(case)
    failures = compare_tensors(result.grads, grads, tol, "main_grad")
    failures += compare_tensors(result.stepped, stepped, tol, "SGD-stepped parameter")
    if result.produced:  # last pipeline stage: reported aliases and local counts
        failures += _check_reports(case, result, losses)
    return failures


def _check_reports(case: Case, result: StepResult, losses: torch.Tensor) -> List[str]:
    """Reported entries still hold what the callback produced; counts and sums are local."""
    failures = []
    if len(result.reported) != case.microbatches:
        failures.append(
            f"{len(result.reported)} reported dicts for {case.microbatches} microbatches"
        )
    batch = global_batch(case)
    for i, (entry, (loss_value, count_value)) in enumerate(zip(result.reported, result.produced)):
        reported_loss, reported_count = entry["lm loss"]
        if not (
            torch.equal(reported_loss, loss_value) and torch.equal(reported_count, count_value)
        ):
            failures.append(
                f"microbatch {i}: reported entries changed after the step: "
                f"{reported_loss.item()}, {reported_count.item()} vs produced "
                f"{loss_value.item()}, {count_value.item()}"
            )
        g = result.microbatch_ids[i]
        mask = batch["loss_mask"][g][:, result.positions].double()
        local_count = mask.sum().item()
        if case.mode != "legacy":
            local_sum = (losses[g][:, result.positions] * mask).sum()
            if abs(count_value.item() - local_count) > 0:
                failures.append(
                    f"microbatch {i}: count {count_value.item()} != local {local_count}"
                )
            if abs(loss_value.double().cpu() - local_sum).item() > 1e-5 * max(
                1.0, abs(local_sum.item())
            ):
                failures.append(
                    f"microbatch {i}: loss sum {loss_value.item()} != {local_sum.item()}"
                )
    if case.mode != "legacy":
        mask = batch["loss_mask"].double()
        total = mask.sum().item()
        expected_loss = (losses * mask).sum().item() / total if total else 0.0
        logged = result.logged.get("lm loss")
        if logged is None or abs(logged - expected_loss) > 1e-5 * max(1.0, abs(expected_loss)):
            failures.append(f"logged loss {logged} != global sum/count {expected_loss}")
    if case.mode == "per-token":
        expected = sum(
            batch["loss_mask"][g][:, result.positions].sum().item() for g in result.microbatch_ids
        )
        got = None if result.finalize_tokens is None else result.finalize_tokens.item()
        if got != expected:
            failures.append(f"finalize_model_grads got num_tokens={got}, local total {expected}")
    return failures


def _loss_function(case: Case, cp_group, result: StepResult) -> Callable:
    """The user's loss callback for the case's mode (three values, or legacy two)."""
    count_dtype = torch.float32 if case.mask == "varying" else torch.int64

    def three_values(mask, output, non_loss_data=False):
        if non_loss_data:
            return {"per_token_loss": output.detach()}
        loss_sum = (output * mask).sum()
        num_tokens = mask.sum().to(count_dtype)
        result.produced.append((loss_sum.detach().clone(), num_tokens.clone()))
        return loss_sum, num_tokens, {"lm loss": [loss_sum.detach(), num_tokens]}

    def legacy(mask, output, non_loss_data=False):
        if non_loss_data:
            return {"per_token_loss": output.detach()}
        local = (output * mask).sum()
        totals = torch.stack([local.detach(), mask.sum()])
        if cp_group is not None:
            dist.all_reduce(totals, group=cp_group)
        loss = (local + (totals[0] - local.detach())) / totals[1].clamp(min=1)
        result.produced.append((loss.detach().clone(), totals[1].clone()))
        return loss, {"lm loss": [loss.detach(), totals[1]]}

    return legacy if case.mode == "legacy" else three_values


def _positions(cp_size: int, cp_rank: int) -> torch.Tensor:
    """Sequence positions this CP rank holds (via the package's own slicing of an index)."""
    index = torch.arange(SEQ).view(1, SEQ)
    return slice_batch_for_cp_rank({"p": index}, cp_size, cp_rank)["p"].view(-1)
