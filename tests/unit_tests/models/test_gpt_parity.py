"""The small GPT under context, pipeline, virtual-pipeline and data parallelism trains the
one-process objective exactly: every ``main_grad`` after ``finalize_model_grads`` equals the
gradient of a dense float64 GPT on the whole global batch.

Data are prompt-masked (SFT-like): each sequence's loss covers a response after a prompt of
random length, so valid tokens fall unevenly on the CP shards; one microbatch has valid
tokens on a single quarter of the sequence, one sequence has none. Objectives (SPEC
section 4), over the G = D * M microbatches of the global batch, S_g and N_g the masked
loss sum and valid-token count of microbatch g:

    averaged:   J = (1 / G) * sum_g S_g / max(N_g, 1)
    per-token:  J = sum_g S_g / max(sum_g N_g, 1)

The reference calls the GPT model directly, with no schedule, DDP, CP or pipeline; the
distributed step uses the package's public API as a training script would. Launch:
``torchrun --nproc-per-node 4 -m pytest tests/unit_tests/models`` (and 8).
"""

import functools
from typing import Dict, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.loss_reporting import reduce_reported_losses
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.dist_utils import Layout, assert_no_failures, rel_error, use_layout
from tests.unit_tests.models.naming import reference_names

VOCAB, HIDDEN, HEADS, LAYERS, SEQ, MICRO_BATCH = 32, 16, 2, 4, 16, 2
GLOBAL_MICROBATCHES = 4  # G = D * M, the same for every layout
SEED = 11
TOLERANCE = 1e-5


def _case(layout: Layout, mode: str, tied: bool = True, fused: bool = False):
    tag = ("tied" if tied else "untied") + ("-fused" if fused else "")
    return pytest.param(
        layout,
        mode,
        tied,
        fused,
        marks=pytest.mark.world(layout.world),
        id=f"{layout.id}-{mode}-{tag}",
    )


CASES = [
    _case(Layout(cp=2, pp=2), "averaged"),
    _case(Layout(cp=2, pp=2), "per-token"),
    _case(Layout(cp=2, pp=2, vpp=2), "averaged"),
    _case(Layout(cp=2, pp=2, vpp=2), "per-token"),
    _case(Layout(cp=2, pp=2, vpp=2), "averaged", tied=False),
    _case(Layout(cp=2, pp=2, vpp=2, dp=2), "averaged"),
    _case(Layout(cp=2, pp=2, vpp=2, dp=2), "per-token"),
    _case(Layout(cp=4, pp=2), "averaged"),
    _case(Layout(cp=4, pp=2), "per-token"),
    # gradient_accumulation_fusion: weight gradients added into main_grad by the GEMM
    _case(Layout(cp=2, pp=2), "per-token", fused=True),
    _case(Layout(cp=2, pp=2, vpp=2), "averaged", tied=False, fused=True),
    _case(Layout(cp=2, pp=2, vpp=2, dp=2), "averaged", fused=True),
]


@pytest.mark.parametrize("layout, mode, tied, fused", CASES)
def test_gpt_main_grads_equal_dense_reference(layout: Layout, mode: str, tied: bool, fused: bool):
    """Every main_grad on every rank, and the logged loss, match the float64 reference."""
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    grads, logged = distributed_step(layout, mode, tied, groups, fused)
    reference_grads, reference_loss = dense_reference(mode, tied)

    failures = []
    for name, grad in grads.items():
        error = rel_error(grad, reference_grads[name])
        if not error <= TOLERANCE:
            failures.append(f"{layout.id} {mode}: main_grad {name}: rel error {error:.2e}")
    if logged is not None and abs(logged - reference_loss) > TOLERANCE * reference_loss:
        failures.append(f"logged loss {logged} != reference sum(S)/sum(N) {reference_loss}")
    names: List[Optional[List[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(grads))
    missing = set(reference_grads) - {n for rank_names in names for n in rank_names}
    if missing:
        failures.append(f"no rank holds {sorted(missing)}")
    assert_no_failures(failures)


# ----------------------------------------------------------------------------- data


def global_batch() -> Dict[str, torch.Tensor]:
    """G microbatches of prompt-masked sequences: ``[G, b, s]`` tensors.

    Sequence (g, i) keeps the labels in [prompt, end) with a random prompt length; microbatch
    1 keeps only positions [s/4, s/2) (one CP chunk pair at C = 2, a quarter at C = 4);
    sequence (2, 1) has no valid token.
    """
    gen = torch.Generator().manual_seed(SEED)
    shape = (GLOBAL_MICROBATCHES, MICRO_BATCH, SEQ)
    tokens = torch.randint(0, VOCAB, shape, generator=gen)
    labels = torch.randint(0, VOCAB, shape, generator=gen)
    prompt = torch.randint(1, SEQ - 2, shape[:2], generator=gen)
    end = prompt + 1 + torch.randint(1, SEQ, shape[:2], generator=gen)
    positions = torch.arange(SEQ)
    mask = ((positions >= prompt[..., None]) & (positions < end[..., None])).float()
    mask[1] = 0.0
    mask[1, :, SEQ // 4 : SEQ // 2] = 1.0
    mask[2, 1] = 0.0
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": mask,
        "position_ids": positions.expand(shape).contiguous(),
    }


# ----------------------------------------------------------------------------- reference


@functools.lru_cache(maxsize=None)
def dense_reference(mode: str, tied: bool) -> Tuple[Dict[str, torch.Tensor], float]:
    """Gradient of J (float64, one model, whole global batch) by parameter name, and the
    logged loss sum(S) / sum(N)."""
    config = make_config(Layout(), mode)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        VOCAB,
        SEQ,
        share_embeddings_and_output_weights=tied,
        pg_collection=ProcessGroupCollection(),
        seed=SEED,
        pp_rank=0,
    ).double()
    batch = global_batch()
    sums, counts = [], []
    for g in range(GLOBAL_MICROBATCHES):
        losses = model(batch["tokens"][g], batch["position_ids"][g], labels=batch["labels"][g])
        mask = batch["loss_mask"][g].double()
        sums.append((losses * mask).sum())
        counts.append(mask.sum())
    sums, counts = torch.stack(sums), torch.stack(counts)
    if mode == "per-token":
        objective = sums.sum() / counts.sum().clamp(min=1)
    else:
        objective = (sums / counts.clamp(min=1)).mean()
    named = dict(model.named_parameters())
    grads = torch.autograd.grad(objective, list(named.values()))
    logged = (sums.sum() / counts.sum()).item()
    return dict(zip(named, grads)), logged


# ----------------------------------------------------------------------------- distributed


def distributed_step(
    layout: Layout,
    mode: str,
    tied: bool,
    groups: ProcessGroupCollection,
    fused: bool = False,
) -> Tuple[Dict[str, torch.Tensor], Optional[float]]:
    """One step of this rank's chunks with the schedule, DDP and finalize_model_grads
    (``fused``: with ``gradient_accumulation_fusion``).

    Returns {reference name: main_grad} and, on the last pipeline stage, the logged loss.
    """
    config = make_config(layout, mode)
    config.gradient_accumulation_fusion = fused
    pp_rank, vpp = groups.pp.rank(), layout.vpp
    stages = layout.pp * (vpp or 1)
    chunks = []
    for v in range(vpp or 1):
        stage = v * layout.pp + pp_rank
        gpt = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            VOCAB,
            SEQ,
            pre_process=stage == 0,
            post_process=stage == stages - 1,
            share_embeddings_and_output_weights=tied,
            vp_stage=v if vpp else None,
            pg_collection=groups,
            seed=SEED,
        )
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        chunks.append(DistributedDataParallel(config, ddp_config, gpt, pg_collection=groups))
    config.no_sync_func = [c.no_sync for c in chunks] if vpp else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads

    num_microbatches = GLOBAL_MICROBATCHES // layout.dp
    first = groups.dp.rank() * num_microbatches
    batch = global_batch()
    microbatches = [
        get_batch_on_this_cp_rank({k: v[first + m] for k, v in batch.items()}, groups.cp)
        for m in range(num_microbatches)
    ]
    iterators: List[Iterator] = [iter(microbatches) for _ in chunks]
    for chunk in chunks:
        chunk.zero_grad_buffer()
    store = get_forward_backward_func(layout.pp, vpp)(
        forward_step_func=forward_step,
        data_iterator=iterators if vpp else iterators[0],
        model=chunks if vpp else chunks[0],
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        pg_collection=groups,
    )
    logged = reduce_reported_losses(store, groups.dp_cp).get("lm loss")
    grads = {}
    for chunk in chunks:
        for name, param in reference_names(chunk.module):
            grads[name] = param.main_grad.detach().clone()
    return grads, logged


def forward_step(data_iterator, model):
    """The user's forward step: per-token losses, then the three-value loss callback."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])

    def loss_func(output_tensor):
        loss_sum = (output_tensor * batch["loss_mask"]).sum()
        num_tokens = batch["loss_mask"].sum().to(torch.int)
        return loss_sum, num_tokens, {"lm loss": [loss_sum.detach(), num_tokens]}

    return output, loss_func


# ----------------------------------------------------------------------------- helpers


def make_config(layout: Layout, mode: str) -> TransformerConfig:
    """The test model (weights std 0.3, so gradients are far from zero) on ``layout``."""
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
        context_parallel_size=layout.cp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        pipeline_dtype=torch.float32,
        calculate_per_token_loss=mode == "per-token",
    )
