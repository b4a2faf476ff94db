"""The GPT under tensor (with and without sequence parallelism), context, pipeline,
virtual-pipeline and data parallelism trains the one-process objective exactly: every
``main_grad`` after ``finalize_model_grads`` equals the gradient of an independent dense
float64 GPT on the whole global batch, and the logged loss equals the reference's at every
one of a few plain-SGD steps. Two architectures: GPT-2 style (LayerNorm, gelu, learned
absolute positions, biases, tied embeddings) and Llama style (RMSNorm, SwiGLU, RoPE,
grouped-query attention, no biases, untied).

Data are prompt-masked (SFT-like): each sequence's loss covers a response after a prompt of
random length, so valid tokens fall unevenly on the CP shards; one microbatch has valid
tokens on a single quarter of the sequence, one sequence has none. Objectives (SPEC
section 4), over the G = D * M microbatches of the global batch, S_g and N_g the masked
loss sum and valid-token count of microbatch g:

    averaged:   J = (1 / G) * sum_g S_g / max(N_g, 1)
    per-token:  J = sum_g S_g / max(sum_g N_g, 1)

The reference (``dense_gpt.py``) is plain torch ops on the full weights, with no schedule,
DDP, TP, CP or pipeline; it starts from the same seeded weights. The distributed step uses
the package's public API as a training script would. Launch:
``torchrun --nproc-per-node 4 -m pytest tests/unit_tests/models`` (and 8); the full matrix
is marked ``slow``.
"""

import dataclasses
import functools
from typing import Dict, Iterator, List, Optional, Tuple

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
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.loss_reporting import reduce_reported_losses
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.transformer import TransformerConfig, torch_norm
from megatron.core.transformer.module import Float16Module
from tests.unit_tests.dist_utils import (
    Layout,
    assert_no_failures,
    gather_failures,
    rel_error,
    reset_layout,
    use_layout,
)
from tests.unit_tests.models.dense_gpt import Arch, dense_gpt_losses
from tests.unit_tests.models.naming import reference_names

SEQ, MICRO_BATCH = 16, 2
GLOBAL_MICROBATCHES = 4  # G = D * M, the same for every layout
STEPS, LR = 3, 0.1  # plain SGD on main_grad
SEED = 11
TOLERANCE = 1e-5

GPT2 = Arch(
    "gpt2", layers=4, hidden=16, heads=4, groups=4, ffn=32, vocab=32, norm="LayerNorm",
    swiglu=False, rope=False, bias=True, tied=True,
)  # fmt: skip
LLAMA = Arch(
    "llama", layers=4, hidden=32, heads=8, groups=4, ffn=32, vocab=32, norm="RMSNorm",
    swiglu=True, rope=True, bias=False, tied=False,
)  # fmt: skip
# Gemma 2 / 3 in one: zero-centred sandwich norms and q/k norms, scaled embeddings, GeGLU,
# an attention scale, both soft-caps, a window of 3 keys on layers 1 and 3 with a local RoPE
# base (layers 2 and 4 full, the default base with positions / 4)
GEMMA = dataclasses.replace(
    LLAMA, name="gemma", swiglu=False, tied=True, qk_norm=True, one_p=True, sandwich=True,
    embed_scale=True, softmax_scale=0.4, geglu=True, attn_softcap=1.0, final_softcap=2.0,
    window=3, skip_freq=2, local_base=100.0, rope_factor=4.0,
)  # fmt: skip
ARCHS = {
    a.name: a
    for a in (
        GPT2,
        LLAMA,
        dataclasses.replace(GPT2, name="gpt2-untied", tied=False),
        dataclasses.replace(LLAMA, name="llama-qknorm", qk_norm=True),
        dataclasses.replace(LLAMA, name="llama-qknorm-whole", qk_norm=True, qk_norm_whole=True),
        GEMMA,
        dataclasses.replace(GEMMA, name="gemma-full", window=None, skip_freq=None, local_base=None),
    )
}


def _case(layout: Layout, mode: str, arch: str = "gpt2", fused: bool = False, slow=False):
    marks = [pytest.mark.world(layout.world)] + ([pytest.mark.slow] if slow else [])
    tag = "-fused" if fused else ""
    return pytest.param(
        layout, mode, arch, fused, marks=marks, id=f"{layout.id}-{arch}-{mode}{tag}"
    )


CASES = [
    # context, pipeline, virtual pipeline and data parallelism (TP = 1)
    _case(Layout(cp=2, pp=2), "averaged"),
    _case(Layout(cp=2, pp=2), "per-token"),
    _case(Layout(cp=2, pp=2, vpp=2), "averaged"),
    _case(Layout(cp=2, pp=2, vpp=2), "per-token", slow=True),
    _case(Layout(cp=2, pp=2, vpp=2), "averaged", "gpt2-untied"),
    _case(Layout(cp=2, pp=2, vpp=2, dp=2), "averaged"),
    _case(Layout(cp=2, pp=2, vpp=2, dp=2), "per-token", slow=True),
    _case(Layout(cp=4, pp=2), "averaged", slow=True),
    _case(Layout(cp=4, pp=2), "per-token"),
    # gradient_accumulation_fusion: weight gradients added into main_grad by the GEMM
    _case(Layout(cp=2, pp=2), "per-token", fused=True),
    _case(Layout(cp=2, pp=2, vpp=2), "averaged", "gpt2-untied", fused=True, slow=True),
    _case(Layout(cp=2, pp=2, vpp=2, dp=2), "averaged", fused=True),
    # tensor parallelism, with and without sequence parallelism: default-run subset
    _case(Layout(tp=2, sp=True, cp=2), "averaged", "gpt2"),
    _case(Layout(tp=2, cp=2), "per-token", "llama"),
    _case(Layout(tp=2, sp=True, pp=2), "per-token", "llama", fused=True),
    _case(Layout(tp=2, sp=True, cp=2, pp=2), "averaged", "gpt2"),
    _case(Layout(tp=2, sp=True, cp=2, pp=2, vpp=2), "averaged", "llama"),
    _case(Layout(tp=4, cp=2), "per-token", "gpt2"),
    # q/k norms see only this rank's heads: summed over TP even without SP
    _case(Layout(tp=2, cp=2), "averaged", "llama-qknorm"),
    _case(Layout(tp=2, sp=True, cp=2, pp=2), "per-token", "llama-qknorm", slow=True),
    # whole-projection q/k norms (OLMoE): the sum of squares all-reduced over TP, the weights
    # TP-split
    _case(Layout(tp=2, sp=True), "averaged", "llama-qknorm-whole"),
    _case(Layout(tp=2, sp=True, cp=2), "per-token", "llama-qknorm-whole", slow=True),
    _case(Layout(tp=4), "per-token", "llama-qknorm-whole", slow=True),
    _case(Layout(tp=2, cp=2, pp=2), "per-token", "llama-qknorm-whole", slow=True),
    _case(Layout(tp=2, sp=True, dp=2, pp=2), "averaged", "gpt2-untied"),
    # Gemma: TP with SP, CP (a2a: the windows; prompt masks fall unevenly on the shards), PP
    _case(Layout(tp=2, sp=True), "averaged", "gemma", slow=True),
    _case(Layout(cp=2), "per-token", "gemma", slow=True),
    _case(Layout(pp=2), "averaged", "gemma", slow=True),
    _case(Layout(tp=2, sp=True, cp=2, pp=2), "per-token", "gemma", slow=True),
    _case(Layout(cp=2), "averaged", "gemma-full", slow=True),  # soft-caps through all_gather
]
# the full tensor-parallel matrix (slow): TP in {2, 4} x SP on/off x both architectures
for _tp, _sp, _arch in [
    (t, s, a) for t in (2, 4) for s in (True, False) for a in ("gpt2", "llama")
]:
    for _layout in [
        Layout(tp=_tp, sp=_sp, cp=4 // _tp),
        Layout(tp=_tp, sp=_sp, pp=4 // _tp),
        Layout(tp=2, sp=_sp, cp=2, pp=2) if _tp == 2 else Layout(tp=4, sp=_sp, cp=2),
        Layout(tp=2, sp=_sp, cp=2, pp=2, vpp=2) if _tp == 2 else Layout(tp=4, sp=_sp, pp=2),
        Layout(tp=2, sp=_sp, cp=2, dp=2) if _tp == 2 else Layout(tp=4, sp=_sp, dp=2),
        Layout(tp=2, sp=_sp, pp=2, vpp=2, dp=2) if _tp == 2 else Layout(tp=4, sp=_sp, pp=2, vpp=2),
    ]:
        for _mode in ("averaged", "per-token"):
            _id = f"{_layout.id}-{_arch}-{_mode}"
            if not any(c.id == _id for c in CASES):
                CASES.append(_case(_layout, _mode, _arch, slow=True))


@pytest.mark.parametrize("layout, mode, arch, fused", CASES)
def test_gpt_main_grads_equal_dense_reference(layout: Layout, mode: str, arch: str, fused: bool):
    """Every main_grad on every rank, and the logged loss, match the float64 reference at
    each SGD step."""
    reference = dense_reference(mode, arch)
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    steps = distributed_training(layout, mode, ARCHS[arch], groups, fused)
    failures = compare(layout, mode, steps, reference, groups)
    names: List[Optional[List[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(steps[0][0]))
    missing = set(reference[0][0]) - {n for rank_names in names for n in rank_names}
    if missing:
        failures.append(f"no rank holds {sorted(missing)}")
    assert_no_failures(failures)


@pytest.mark.world(4)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_negative_control_without_the_tp_sum_of_sequence_parallel_grads(arch: str):
    """Rule 3's control: with no parameter marked ``sequence_parallel`` (so finalize does
    not sum their gradients over TP), the norm gradients no longer match the reference."""
    layout = Layout(tp=2, sp=True, cp=2)
    reference = dense_reference("averaged", arch)
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    steps = distributed_training(layout, "averaged", ARCHS[arch], groups, unmark_sp=True)
    failures = compare(layout, "averaged", steps, reference, groups)
    flat = gather_failures(failures)
    assert any("layernorm.weight" in f for f in flat), "the bucket did not catch the bug"


@pytest.mark.world(2)
@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(lambda x, group: x, id="local-sum-of-squares"),
        pytest.param(reduce_from_tensor_model_parallel_region, id="unsummed-gradient"),
    ],
)
def test_negative_control_whole_projection_qk_norm(broken, monkeypatch):
    """The whole-projection q/k norm's controls: each rank normalizing by its own heads'
    sum of squares, or the sum all-reduced with the identity backward of
    ``reduce_from_tensor_model_parallel_region`` (right in the forward, each rank then
    missing the other heads' share of d(sum)), fail the bucket."""
    layout = Layout(tp=2)
    reference = dense_reference("averaged", "llama-qknorm-whole")
    monkeypatch.setattr(torch_norm, "all_reduce_with_summed_grad", broken)
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    arch = ARCHS["llama-qknorm-whole"]
    steps = distributed_training(layout, "averaged", arch, groups)
    failures = compare(layout, "averaged", steps, reference, groups)
    flat = gather_failures(failures)
    assert any("linear_qkv.weight" in f for f in flat), "the bucket did not catch the bug"


def compare(layout, mode, steps, reference, groups) -> List[str]:
    """Failure messages: the first step's main_grads (TP shards against the slice of the
    reference gradient), and the logged loss of every step (later gradients are taken at
    weights that carry the fp32 rounding of the updates)."""
    failures = []
    tp_size, tp_rank = groups.tp.size(), groups.tp.rank()
    for step, ((grads, logged), (ref_grads, ref_loss)) in enumerate(zip(steps, reference)):
        for name, (grad, param) in grads.items() if step == 0 else ():
            expected = shard_like(ref_grads[name], param, tp_size, tp_rank)
            error = rel_error(grad, expected)
            if not error <= TOLERANCE:
                failures.append(f"{layout.id} {mode} step {step}: {name}: rel error {error:.2e}")
        if logged is not None and abs(logged - ref_loss) > TOLERANCE * ref_loss:
            failures.append(f"step {step}: logged loss {logged} != reference {ref_loss}")
    return failures


def shard_like(full: torch.Tensor, param: torch.Tensor, tp_size: int, tp_rank: int):
    """This TP rank's part of a full tensor: along ``partition_dim``, blocks r, r + T, ... of
    T * ``partition_stride`` equal blocks (whole tensor for a replicated parameter)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    blocks = full.chunk(tp_size * getattr(param, "partition_stride", 1), dim=param.partition_dim)
    return torch.cat(blocks[tp_rank::tp_size], dim=param.partition_dim)


# ----------------------------------------------------------------------------- data


def global_batch(vocab: int) -> Dict[str, torch.Tensor]:
    """G microbatches of prompt-masked sequences: ``[G, b, s]`` tensors.

    Sequence (g, i) keeps the labels in [prompt, end) with a random prompt length; microbatch
    1 keeps only positions [s/4, s/2) (one CP chunk pair at C = 2, a quarter at C = 4);
    sequence (2, 1) has no valid token.
    """
    gen = torch.Generator().manual_seed(SEED)
    shape = (GLOBAL_MICROBATCHES, MICRO_BATCH, SEQ)
    tokens = torch.randint(0, vocab, shape, generator=gen)
    labels = torch.randint(0, vocab, shape, generator=gen)
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
def dense_reference(mode: str, arch_name: str) -> List[Tuple[Dict[str, torch.Tensor], float]]:
    """Per SGD step: the gradient of J (float64, dense model, whole global batch) by
    parameter name, and the logged loss sum(S) / sum(N); then p <- p - LR * grad."""
    arch = ARCHS[arch_name]
    reset_layout()  # one process's model: no parallel_state groups
    model = build_gpt(make_config(Layout(), mode, arch), arch, ProcessGroupCollection(), 0)
    params = {n: p.detach().cpu().double().requires_grad_() for n, p in reference_names(model)}
    batch = global_batch(arch.vocab)
    steps = []
    for _ in range(STEPS):
        objective, logged = dense_objective(params, arch, batch, mode)
        grads = dict(zip(params, torch.autograd.grad(objective, list(params.values()))))
        steps.append((grads, logged))
        with torch.no_grad():
            for name, param in params.items():
                param -= LR * grads[name]
    return steps


def dense_objective(params, arch: Arch, batch, mode: str) -> Tuple[torch.Tensor, float]:
    """(J over the global batch for ``mode`` (module docstring), the logged loss
    sum(S) / sum(N)) of the dense float64 model with ``params``."""
    sums, counts = [], []
    for g in range(GLOBAL_MICROBATCHES):
        losses = dense_gpt_losses(params, arch, batch["tokens"][g], batch["labels"][g])
        mask = batch["loss_mask"][g].double()
        sums.append((losses * mask).sum())
        counts.append(mask.sum())
    sums, counts = torch.stack(sums), torch.stack(counts)
    if mode == "per-token":
        objective = sums.sum() / counts.sum().clamp(min=1)
    else:
        objective = (sums / counts.clamp(min=1)).mean()
    return objective, (sums.sum() / counts.sum()).item()


# ----------------------------------------------------------------------------- distributed


def distributed_training(
    layout: Layout,
    mode: str,
    arch: Arch,
    groups: ProcessGroupCollection,
    fused: bool = False,
    unmark_sp: bool = False,
    bf16: bool = False,
) -> List[Tuple[Dict[str, Tuple[torch.Tensor, torch.Tensor]], Optional[float]]]:
    """STEPS plain-SGD steps of this rank's chunks with the schedule, DDP and
    finalize_model_grads (``fused``: with ``gradient_accumulation_fusion``; ``unmark_sp``:
    the negative control, no parameter marked ``sequence_parallel``).

    Returns per step {reference name: (main_grad, parameter)} and, on the last pipeline
    stage, the logged loss.
    """
    config = make_config(layout, mode, arch)
    config.gradient_accumulation_fusion = fused
    if bf16:  # megatron-core's mixed precision: bf16 weights and messages, fp32 main_grad
        config.bf16, config.pipeline_dtype = True, torch.bfloat16
    pp_rank, vpp = groups.pp.rank(), layout.vpp
    stages = layout.pp * (vpp or 1)
    chunks, gpts = [], []
    for v in range(vpp or 1):
        stage = v * layout.pp + pp_rank
        gpt = build_gpt(config, arch, groups, None, stage, stages, v if vpp else None)
        if unmark_sp:
            for param in gpt.parameters():
                param.sequence_parallel = False
        gpts.append(gpt)
        module = Float16Module(config, gpt) if bf16 else gpt
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        chunks.append(DistributedDataParallel(config, ddp_config, module, pg_collection=groups))
    config.no_sync_func = [c.no_sync for c in chunks] if vpp else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads

    num_microbatches = GLOBAL_MICROBATCHES // layout.dp
    first = groups.dp.rank() * num_microbatches
    batch = global_batch(arch.vocab)
    microbatches = [
        get_batch_on_this_cp_rank({k: v[first + m] for k, v in batch.items()}, groups.cp)
        for m in range(num_microbatches)
    ]
    steps = []
    for _ in range(1 if unmark_sp else STEPS):
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
        for gpt in gpts:
            for name, param in reference_names(gpt):
                grads[name] = (param.main_grad.detach().clone(), param)
        steps.append((grads, logged))
        with torch.no_grad():
            for chunk in chunks:
                for param in chunk.module.parameters():
                    param -= LR * param.main_grad.to(param.dtype)
    return steps


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


def make_config(layout: Layout, mode: str, arch: Arch) -> TransformerConfig:
    """The test model (weights std 0.3, so gradients are far from zero) on ``layout``."""
    return TransformerConfig(
        num_layers=arch.layers,
        hidden_size=arch.hidden,
        num_attention_heads=arch.heads,
        num_query_groups=arch.groups,
        ffn_hidden_size=arch.ffn,
        normalization=arch.norm,
        gated_linear_unit=arch.swiglu or arch.geglu,
        activation_func=F.silu if arch.swiglu else _gelu_tanh if arch.geglu else F.gelu,
        layernorm_zero_centered_gamma=arch.one_p,
        sandwich_layernorm=arch.sandwich,
        embedding_scale_sqrt_hidden=arch.embed_scale,
        softmax_scale=arch.softmax_scale,
        attn_logit_softcapping=arch.attn_softcap,
        final_logit_softcapping=arch.final_softcap,
        window_size=None if arch.window is None else (arch.window, 0),
        window_attn_skip_freq=arch.skip_freq,
        local_rotary_base=arch.local_base,
        cp_comm_type="a2a" if arch.window is not None and layout.cp > 1 else None,
        add_bias_linear=arch.bias,
        layernorm_epsilon=arch.eps,
        qk_layernorm=arch.qk_norm,
        qk_layernorm_whole_projection=arch.qk_norm_whole,
        label_smoothing=arch.label_smoothing,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
        tensor_model_parallel_size=layout.tp,
        sequence_parallel=layout.sp,
        context_parallel_size=layout.cp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        pipeline_dtype=torch.float32,
        calculate_per_token_loss=mode == "per-token",
    )


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def build_gpt(config, arch, groups, pp_rank, stage=0, stages=1, vp_stage=None) -> GPTModel:
    """Virtual stage ``stage`` of ``stages`` of the test GPT."""
    return GPTModel(
        config,
        get_gpt_layer_local_spec(normalization=arch.norm, qk_layernorm=arch.qk_norm),
        arch.vocab,
        SEQ,
        pre_process=stage == 0,
        post_process=stage == stages - 1,
        share_embeddings_and_output_weights=arch.tied,
        position_embedding_type="rope" if arch.rope else "learned_absolute",
        seq_len_interpolation_factor=None if arch.rope_factor == 1.0 else arch.rope_factor,
        vp_stage=vp_stage,
        pg_collection=groups,
        seed=SEED,
        pp_rank=pp_rank,
    )
