"""The collectives of one dense GPT training step at CP=2 x PP=2 (issue 43), counted, so that
their number cannot grow silently.

The step is the benchmark's (``tests/benchmarks/bench_framework_step.py``): ``GPTModel`` with
the local spec, DDP, ``finalize_model_grads``, 1F1B over M microbatches, groups from
``parallel_state``. Every call of ``torch.distributed``'s collectives is counted by wrapping
the module's functions (``isend``/``irecv`` are counted inside ``batch_isend_irecv``, since
``P2POp`` checks their identity). Per microbatch and layer the all-gather CP attention makes
two all-gathers (K|V forward, again in the backward) and one all-reduce (the K/V gradient:
gloo's reduce-scatter), the last stage one count all-reduce (SPEC section 4), DDP one
bucket all-reduce per step. docs/performance.md has the table this is checked against.
"""

import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import get_batch_on_this_cp_rank
from tests.unit_tests.dist_utils import Layout, use_layout

pytestmark = pytest.mark.world(4)

LAYERS, SEQ, VOCAB, MICROBATCHES = 4, 16, 32, 3
COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")
COUNTED += ("all_to_all_single", "broadcast", "barrier", "batch_isend_irecv")


def _expected(last_stage: bool) -> Counter:
    """The collectives of one step on one rank (layers per stage L = LAYERS / 2)."""
    per_mb = LAYERS // 2 * MICROBATCHES
    return Counter(
        all_gather=2 * per_mb,
        all_reduce=per_mb + (MICROBATCHES if last_stage else 0) + 1,
        batch_isend_irecv=MICROBATCHES + 1,
        p2p_ops=2 * MICROBATCHES,
    )


def _count(fn) -> Counter:
    """Calls of ``torch.distributed``'s collectives during ``fn()`` (p2p ops within
    ``batch_isend_irecv`` as ``p2p_ops``)."""
    counts: Counter = Counter()

    def wrap(name, original):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            counts[name] += 1
            if name == "batch_isend_irecv":
                counts["p2p_ops"] += len(args[0] if args else kwargs["p2p_op_list"])
            return original(*args, **kwargs)

        return counted

    originals = {name: getattr(dist, name) for name in COUNTED}
    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    try:
        fn()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return counts


def _dense_step():
    """A function running one training step of a tiny dense GPT on this rank's stage."""
    use_layout(Layout(cp=2, pp=2))
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=16,
        num_attention_heads=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    torch.manual_seed(0)
    gpt = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pp_rank == 0,
        post_process=pp_rank == 1,
    )
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), gpt)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    tokens = torch.arange(SEQ).view(1, -1) % VOCAB
    batch = {"tokens": tokens, "labels": tokens, "position_ids": torch.arange(SEQ).view(1, -1)}
    shard = get_batch_on_this_cp_rank(batch)

    def forward_step(data_iterator, model):
        next(data_iterator)
        output = model(shard["tokens"], shard["position_ids"], None, labels=shard["labels"])
        return output, lambda out: (out.sum(), torch.tensor(out.numel(), dtype=torch.int), {})

    def step():
        ddp.zero_grad_buffer()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(range(MICROBATCHES)),
            model=ddp,
            num_microbatches=MICROBATCHES,
            seq_length=SEQ,
            micro_batch_size=1,
        )

    return step, pp_rank == 1


def test_a_dense_cp2_pp2_step_makes_the_recorded_collectives():
    step, last_stage = _dense_step()
    step()  # the first step may set things up
    counts = _count(step)
    assert counts == _expected(last_stage), (
        f"collectives of one dense CP2 x PP2 step on rank {dist.get_rank()}: {dict(counts)}, "
        f"recorded {dict(_expected(last_stage))} (update docs/performance.md and this test "
        "if the change is intended)"
    )


def test_the_count_sees_one_more_collective(monkeypatch):
    """Negative control: an extra all-reduce on the loss path is counted."""
    step, last_stage = _dense_step()
    shipped = schedules.reduce_loss_across_cp

    def with_extra(loss_sum, num_tokens, cp_group):
        dist.all_reduce(torch.zeros(1), group=cp_group)
        return shipped(loss_sum, num_tokens, cp_group)

    monkeypatch.setattr(schedules, "reduce_loss_across_cp", with_extra)
    counts = _count(step)
    extra = Counter(all_reduce=MICROBATCHES if last_stage else 0)
    assert counts == _expected(last_stage) + extra
