"""DPO trains the one-process preference objective at every layout (SPEC section 21).

The GPT of ``test_gpt_parity`` is the policy; a second GPT with other seeded weights is the
frozen reference (so the reference log-probs differ from the policy's from the first step).
Every ``main_grad`` after ``finalize_model_grads`` (first step), the logged objective and
TRL's metrics (every step of a few plain-SGD steps) equal an independent float64 computation:
the dense GPT of ``dense_gpt.py`` on the whole global batch, with the pair losses, the pair
mean and the pooled SFT term written out here from the issue's definitions (not from
``megatron.core.preference``).

Data: G = 4 micro-batches of 2 pairs (rows interleaved chosen / rejected, each pair sharing
its prompt) with very unequal completion lengths: a chosen completion covering most of the
sequence beside a rejected one of one token, so the CP shards hold very different parts of
each sequence's log-prob.

Negative controls (each must fail the bucket): per-shard log-probs (no sum over CP), the SFT
term pooled per micro-batch, a reference that moves with the policy.

Packed (``packed_global_batch``): each micro-batch's sequences are the documents of one THD
row (several pairs per row) as long as their data (rows of different lengths, the pipeline
with ``variable_seq_lengths``), compared with the same unpacked reference; controls: the
documents attending to each other, the sequence index not split over CP with the tokens.
The distributed optimizer (dp2 x cp2): compared through the parameters after its SGD steps.
"""

import dataclasses
import functools
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from megatron.core import preference
from megatron.core.context_parallel import get_batch_on_this_cp_rank, get_thd_batch_on_this_cp_rank
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.loss_reporting import reduce_reported_totals
from megatron.core.preference import PreferenceObjective, PreferenceStep
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.lora import LoRAConfig, apply_lora
from tests.unit_tests.dist_utils import (
    Layout,
    assert_no_failures,
    gather_failures,
    rel_error,
    reset_layout,
    use_layout,
)
from tests.unit_tests.models.dense_gpt import dense_gpt_losses
from tests.unit_tests.models.naming import reference_names
from tests.unit_tests.models.test_gpt_parity import ARCHS, SEQ, make_config, shard_like
from tests.unit_tests.models.test_lora_parity import ADAPTED, LORA

PAIRS_PER_MICROBATCH, MICROBATCHES = 2, 4  # b pairs (2b rows) per micro-batch, G = D * M
ROWS = 2 * PAIRS_PER_MICROBATCH
# packed: a micro-batch's 2b sequences in one row as long as their data, each padded to a
# multiple of 8 (a multiple of 2C for C <= 4: the zig-zag split), the row to 8 x TP under
# sequence parallelism (``pack_multiples``); rows differ in length (``variable_seq_lengths``
# over PP); PACKED_SEQ bounds them. (Unpadded documents train the same objective, within
# fp32: step 2's rewards_margins of llama-ipo is then 1.2e-5 from float64, 7e-6 unpacked.)
PACK_MULTIPLE = 8
PACKED_SEQ = ROWS * SEQ + 16
STEPS, LR = 2, 0.1
POLICY_SEED, REFERENCE_SEED, DATA_SEED = 11, 23, 5
TOLERANCE = 1e-5
# LoRA: the fp32 one-process run itself is up to ~9e-6 from float64 (test_lora_parity), so
# its tolerance is 3e-5 (step 1's rewards_margins at tp2-sp-cp2 differ by 1.4e-5 relative)
LORA_TOLERANCE = 3e-5
OBJECTIVES = {
    "sigmoid": PreferenceObjective(beta=0.5, loss_type="sigmoid"),
    "sigmoid-ls-sft": PreferenceObjective(
        beta=0.5, loss_type="sigmoid", label_smoothing=0.2, sft_weight=0.7
    ),
    "hinge": PreferenceObjective(beta=2.0, loss_type="hinge", sft_weight=0.3),
    "ipo": PreferenceObjective(beta=0.5, loss_type="ipo"),
}


def _case(layout: Layout, objective: str, arch: str = "gpt2", slow: bool = True):
    marks = [pytest.mark.world(layout.world)] + ([pytest.mark.slow] if slow else [])
    return pytest.param(layout, objective, arch, marks=marks, id=f"{layout.id}-{arch}-{objective}")


CASES = [
    _case(Layout(), "sigmoid-ls-sft", slow=False),
    _case(Layout(), "ipo", "llama"),
    _case(Layout(cp=2, pp=2), "sigmoid-ls-sft", slow=False),
    _case(Layout(tp=2, sp=True), "hinge", "llama"),
    _case(Layout(cp=2), "sigmoid-ls-sft"),
    _case(Layout(cp=2), "ipo", "llama"),
    _case(Layout(pp=2), "hinge"),
    _case(Layout(pp=2, vpp=2), "sigmoid-ls-sft", "llama"),
    _case(Layout(dp=2), "ipo"),
    _case(Layout(cp=2, dp=2), "sigmoid-ls-sft", "llama"),
    _case(Layout(tp=2, sp=True, cp=2, pp=2), "sigmoid-ls-sft", "llama"),
    _case(Layout(tp=2, cp=2), "hinge", "gpt2-untied"),
    # LoRA (adapters starting non-zero): the reference is the base, the adapters' gradients
    _case(Layout(), "sigmoid-ls-sft", "llama+lora"),
    _case(Layout(tp=2, sp=True, cp=2), "sigmoid-ls-sft", "llama+lora"),
    _case(Layout(cp=2, pp=2, vpp=2), "ipo", "gpt2+lora"),
]


@pytest.mark.parametrize("layout, objective, arch", CASES)
def test_dpo_main_grads_equal_dense_reference(layout: Layout, objective: str, arch: str):
    """Every main_grad on every rank (first step), the objective and the metrics (every
    step) match the float64 reference."""
    reference = dense_reference(objective, arch)
    groups = _groups(layout)
    steps = distributed_training(layout, objective, arch, groups)
    tolerance = LORA_TOLERANCE if _arch(arch)[1] else TOLERANCE
    failures = compare(layout, steps, reference, groups, tolerance)
    if dist.is_initialized():
        names: List[Optional[List[str]]] = [None] * dist.get_world_size()
        dist.all_gather_object(names, sorted(steps[0][0]))
        held = {n for rank_names in names for n in rank_names}
    else:
        held = set(steps[0][0])
    if set(reference[0][0]) - held:
        failures.append(f"no rank holds {sorted(set(reference[0][0]) - held)}")
    assert_no_failures(failures)


@pytest.mark.world(4)
@pytest.mark.slow
@pytest.mark.parametrize("objective, arch", [("sigmoid-ls-sft", "llama"), ("ipo", "gpt2")])
def test_dpo_with_the_distributed_optimizer_at_dp2_cp2(objective: str, arch: str):
    """dp2 x cp2 with the distributed optimizer (each rank's SGD step on its shard, then the
    parameters gathered): the parameters after every step, the objective and the metrics
    match the float64 reference."""
    layout = Layout(cp=2, dp=2)
    reference = dense_reference(objective, arch)
    groups = _groups(layout)
    steps = distributed_training(layout, objective, arch, groups, distopt=True)
    failures = compare(layout, steps, reference, groups)
    names: List[Optional[List[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(steps[0][2]))
    missing = set(reference[0][2]) - {n for rank_names in names for n in rank_names}
    if missing:
        failures.append(f"no rank holds {sorted(missing)}")
    assert_no_failures(failures)


PACKED_CASES = [
    _case(Layout(), "sigmoid-ls-sft", slow=False),
    _case(Layout(), "ipo", "llama"),
    _case(Layout(cp=2), "sigmoid-ls-sft", "llama"),
    _case(Layout(cp=2), "hinge"),
    _case(Layout(pp=2), "ipo", "llama"),
    _case(Layout(tp=2, sp=True), "sigmoid-ls-sft"),
    _case(Layout(cp=2, pp=2, vpp=2), "sigmoid-ls-sft", "llama"),
    _case(Layout(cp=2, dp=2), "ipo"),
    _case(Layout(tp=2, sp=True, cp=2), "sigmoid-ls-sft", "llama+lora"),
]


@pytest.mark.parametrize("layout, objective, arch", PACKED_CASES)
def test_packed_pairs_equal_the_unpacked_dense_reference(layout: Layout, objective: str, arch):
    """Each micro-batch's pairs packed into one THD row (several pairs per row, the
    sequences as documents): every main_grad, the objective and the metrics equal the
    float64 reference on the unpacked pairs."""
    reference = dense_reference(objective, arch)
    groups = _groups(layout)
    steps = distributed_training(layout, objective, arch, groups, packed=True)
    tolerance = LORA_TOLERANCE if _arch(arch)[1] else TOLERANCE
    assert_no_failures(compare(layout, steps, reference, groups, tolerance))


@pytest.mark.parametrize(
    "breaks, layout",
    [
        # the documents of a row attend to each other (no packed_seq_params)
        pytest.param(
            "no_thd", Layout(), marks=[pytest.mark.world(1), pytest.mark.slow], id="no-thd"
        ),
        # the sequence index not split over CP with the tokens
        pytest.param("unsharded_index", Layout(cp=2), marks=pytest.mark.world(2), id="index"),
    ],
)
def test_packed_negative_controls_fail_the_bucket(breaks: str, layout: Layout):
    reference = dense_reference("sigmoid-ls-sft", "gpt2")
    groups = _groups(layout)
    steps = distributed_training(layout, "sigmoid-ls-sft", "gpt2", groups, breaks, packed=True)
    flat = gather_failures(compare(layout, steps, reference, groups))
    assert any("weight" in f for f in flat), "the bucket did not catch the bug"


CONTROLS = {
    # each CP shard's own partial log-probs, never summed over CP
    "per-shard-logps": dict(layout=Layout(cp=2), breaks="per_shard", expect="weight"),
    # the SFT term's NLL over each micro-batch's own chosen tokens, micro-batch means averaged
    "sft-per-microbatch": dict(layout=Layout(cp=2), breaks="sft_per_mb", expect="weight"),
    # the reference log-probs taken from the policy's current weights
    "moving-reference": dict(layout=Layout(cp=2), breaks="moving_ref", expect="weight"),
}


@pytest.mark.world(2)
@pytest.mark.parametrize("control", list(CONTROLS))
def test_negative_controls_fail_the_bucket(control: str, monkeypatch):
    spec = CONTROLS[control]
    reference = dense_reference("sigmoid-ls-sft", "gpt2")
    if spec["breaks"] == "per_shard":
        monkeypatch.setattr(preference, "sum_over_cp", lambda value, group: value)
    groups = _groups(spec["layout"])
    steps = distributed_training(
        spec["layout"], "sigmoid-ls-sft", "gpt2", groups, breaks=spec["breaks"]
    )
    flat = gather_failures(compare(spec["layout"], steps, reference, groups))
    assert any(spec["expect"] in f for f in flat), "the bucket did not catch the bug"


# ----------------------------------------------------------------------------- data


def global_batch(vocab: int) -> Dict[str, torch.Tensor]:
    """[G, 2b, s] tensors: pair i of micro-batch g is rows 2i (chosen) and 2i + 1
    (rejected) after one prompt; completion lengths very unequal (the first pair's chosen
    fills the sequence, its rejected has one token; the others random)."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.zeros(MICROBATCHES, ROWS, SEQ + 1, dtype=torch.long)
    mask = torch.zeros(MICROBATCHES, ROWS, SEQ)
    for g in range(MICROBATCHES):
        for pair in range(PAIRS_PER_MICROBATCH):
            prompt = int(torch.randint(1, 5, (1,), generator=gen))
            room = SEQ - prompt + 1  # completion tokens that fit (labels up to position s-1)
            if g == 0 and pair == 0:
                lengths = (room, 1)
            else:
                lengths = tuple(int(x) for x in torch.randint(1, room + 1, (2,), generator=gen))
            head = torch.randint(1, vocab, (prompt,), generator=gen)
            for side, length in enumerate(lengths):
                row = 2 * pair + side
                body = torch.randint(1, vocab, (length,), generator=gen)
                sequence = torch.cat([head, body])
                tokens[g, row, : sequence.numel()] = sequence
                mask[g, row, prompt - 1 : prompt - 1 + length] = 1.0
    positions = torch.arange(SEQ).expand(MICROBATCHES, ROWS, SEQ).contiguous()
    return {
        "tokens": tokens[..., :-1].contiguous(),
        "labels": tokens[..., 1:].contiguous(),
        "loss_mask": mask,
        "position_ids": positions,
    }


# ----------------------------------------------------------------------------- reference


def dense_pair_losses(objective: PreferenceObjective, ratios, counts) -> torch.Tensor:
    """The issue's formulas, written independently of ``megatron.core.preference``."""
    beta, eps = objective.beta, objective.label_smoothing
    if objective.loss_type == "ipo":
        ratios = ratios / counts
    chosen, rejected = ratios[0::2], ratios[1::2]
    h = chosen - rejected
    if objective.loss_type == "sigmoid":
        return -(1 - eps) * torch.log(torch.sigmoid(beta * h)) - eps * torch.log(
            torch.sigmoid(-beta * h)
        )
    if objective.loss_type == "hinge":
        return torch.clamp(1 - beta * h, min=0)
    return (h - 1 / (2 * beta)) ** 2


def dense_logps(params, arch, batch) -> Tuple[torch.Tensor, torch.Tensor]:
    """(summed completion log-probs, completion token counts) of every row, [2P]."""
    logps, counts = [], []
    for g in range(MICROBATCHES):
        nll = dense_gpt_losses(params, arch, batch["tokens"][g], batch["labels"][g])
        mask = batch["loss_mask"][g].double()
        logps.append(-(nll * mask).sum(-1))
        counts.append(mask.sum(-1))
    return torch.cat(logps), torch.cat(counts)


@functools.lru_cache(maxsize=None)
def dense_reference(objective_name: str, arch_name: str):
    """Per SGD step: {name: gradient of J} and {metric: value} (float64, dense model, whole
    global batch, the reference model's log-probs fixed); then p <- p - LR * grad."""
    objective, (arch, lora) = OBJECTIVES[objective_name], _arch(arch_name)
    reset_layout()
    config = make_config(Layout(), "averaged", arch)
    policy = build(config, arch, None, POLICY_SEED)
    if lora:  # the reference is the base: the policy's weights with no adapter
        apply_lora(policy, LoRAConfig(**LORA))
    every = {n: p.detach().double() for n, p in reference_names(policy)}
    params = {n: v.requires_grad_() for n, v in every.items() if not lora or ".adapter." in n}
    base = {n: v for n, v in every.items() if ".adapter." not in n}
    ref_params = (
        base
        if lora
        else {
            n: p.detach().double()
            for n, p in reference_names(build(config, arch, None, REFERENCE_SEED))
        }
    )

    batch = global_batch(arch.vocab)
    with torch.no_grad():
        ref, _ = dense_logps(ref_params, arch, batch)
    steps = []
    for _ in range(STEPS):
        logps, counts = dense_logps(merged(base, params) if lora else params, arch, batch)
        losses = dense_pair_losses(objective, logps - ref, counts)
        chosen_nll = -logps[0::2].sum() / counts[0::2].sum()
        objective_value = losses.mean() + objective.sft_weight * chosen_nll
        grads = dict(zip(params, torch.autograd.grad(objective_value, list(params.values()))))
        rewards = objective.beta * (logps - ref).detach()
        metrics = {
            "loss": objective_value.item(),
            "rewards_chosen": rewards[0::2].mean().item(),
            "rewards_rejected": rewards[1::2].mean().item(),
            "rewards_accuracies": (rewards[0::2] > rewards[1::2]).double().mean().item(),
            "rewards_margins": (rewards[0::2] - rewards[1::2]).mean().item(),
            "logps_chosen": logps[0::2].mean().item(),
            "logps_rejected": logps[1::2].mean().item(),
        }
        with torch.no_grad():
            for name, param in params.items():
                param -= LR * grads[name]
        steps.append((grads, metrics, {n: p.detach().clone() for n, p in params.items()}))
    return steps


def _arch(name: str):
    """(the architecture, whether the policy has LoRA adapters) of ``gpt2``, ``llama+lora``."""
    arch, _, lora = name.partition("+")
    return ARCHS[arch], lora == "lora"


def merged(base, adapters):
    """The base weights with each adapted layer's W + (alpha/dim) B A (float64 leaves)."""
    scale = LORA["alpha"] / LORA["dim"]
    weights = dict(base)
    for name in base:
        layer = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and layer.rsplit(".", 1)[-1] in ADAPTED:
            a = adapters[f"{layer}.adapter.linear_in.weight"]
            b = adapters[f"{layer}.adapter.linear_out.weight"]
            weights[name] = base[name] + scale * b @ a
    return weights


def compare(layout, steps, reference, groups, tolerance: float = TOLERANCE) -> List[str]:
    """The first step's main_grads (TP shards against the slice of the reference) and every
    step's objective and metrics (on the last pipeline stage)."""
    failures = []
    tp = groups.tp if groups is not None else None
    tp_size, tp_rank = (tp.size(), tp.rank()) if tp is not None else (1, 0)
    for step, ((grads, metrics, stepped), (ref_grads, ref_metrics, ref_stepped)) in enumerate(
        zip(steps, reference)
    ):
        for name, (grad, param) in grads.items() if step == 0 else ():
            error = rel_error(grad, shard_like(ref_grads[name], param, tp_size, tp_rank))
            if not error <= tolerance:
                failures.append(f"{layout.id} step {step}: {name}: rel error {error:.2e}")
        for name, (value, param) in stepped.items():
            error = rel_error(value, shard_like(ref_stepped[name], param, tp_size, tp_rank))
            if not error <= tolerance:
                failures.append(f"{layout.id} step {step}: {name} after the step: {error:.2e}")
        for key, value in (metrics or {}).items():
            expected = ref_metrics[key]
            if abs(value - expected) > tolerance * max(1.0, abs(expected)):
                failures.append(f"{layout.id} step {step}: {key} {value} != {expected}")
    return failures


# ----------------------------------------------------------------------------- distributed


def _groups(layout: Layout) -> Optional[ProcessGroupCollection]:
    """The layout's groups (None at one process without torch.distributed)."""
    if layout.world == 1 and not dist.is_initialized():
        reset_layout()
        return None
    use_layout(layout)
    return ProcessGroupCollection.use_mpu_process_groups()


def build(config, arch, groups, seed, pp_rank=None, stage=0, stages=1, vp_stage=None):
    """Virtual stage ``stage`` of ``stages`` of the test GPT with weights seeded by ``seed``."""
    return GPTModel(
        config,
        get_gpt_layer_local_spec(normalization=arch.norm, qk_layernorm=arch.qk_norm),
        arch.vocab,
        SEQ,
        pre_process=stage == 0,
        post_process=stage == stages - 1,
        share_embeddings_and_output_weights=arch.tied,
        position_embedding_type="rope" if arch.rope else "learned_absolute",
        vp_stage=vp_stage,
        pg_collection=groups if groups is not None else ProcessGroupCollection(),
        seed=seed,
        pp_rank=pp_rank,
    )


def distributed_training(
    layout: Layout,
    objective_name: str,
    arch_name: str,
    groups,
    breaks="",
    distopt=False,
    packed=False,
):
    """STEPS plain-SGD steps: per step the reference model's forward-only pass, then the
    policy's forward-backward (schedule, DDP, finalize_model_grads). Returns per step
    {reference name: (main_grad, parameter)}, the metrics (None off the last stage) and
    {reference name: (value after the step, parameter)} (``distopt`` only: the distributed
    optimizer's SGD step, whose main_grads only hold this rank's shard of the sum, so the
    gradients are compared through the stepped parameters; without it, {}).
    ``packed``: each micro-batch's sequences packed into one THD row (``packed_global_batch``).
    ``breaks``: a negative control (``sft_per_mb``, ``moving_ref``, ``no_thd``,
    ``unsharded_index``)."""
    objective, (arch, lora) = OBJECTIVES[objective_name], _arch(arch_name)
    config = make_config(layout, "averaged", arch)
    config.variable_seq_lengths = packed and layout.pp > 1
    vpp = layout.vpp
    pp_rank = groups.pp.rank() if groups is not None else 0
    stages = layout.pp * (vpp or 1)
    chunks, gpts, references = [], [], []
    for v in range(vpp or 1):
        stage = v * layout.pp + pp_rank
        vp = v if vpp else None
        gpt = build(config, arch, groups, POLICY_SEED, None, stage, stages, vp)
        if lora:  # the reference: the same base, no adapter
            apply_lora(gpt, LoRAConfig(**LORA))
        seed = POLICY_SEED if lora else REFERENCE_SEED
        references.append(build(config, arch, groups, seed, None, stage, stages, vp))
        gpts.append(gpt)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distopt
        )
        chunks.append(DistributedDataParallel(config, ddp_config, gpt, pg_collection=groups))
    if breaks == "moving_ref":
        references = gpts
    config.no_sync_func = [c.no_sync for c in chunks] if vpp else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = _sgd(chunks, groups) if distopt else None
    cp = groups.cp if groups is not None else None
    num_microbatches = MICROBATCHES // layout.dp
    batch = global_batch(arch.vocab)
    if packed:
        batch = packed_global_batch(batch, *pack_multiples(layout))
        stacked = _stacked(batch)
        step = PreferenceStep.of_global_batch(
            stacked["loss_mask"], MICROBATCHES, sequence_index=stacked["sequence_index"]
        )
    else:
        step = PreferenceStep.of_global_batch(batch["loss_mask"].flatten(0, 1), MICROBATCHES)
    microbatches = _microbatches(batch, layout, groups, packed, breaks)
    schedule = get_forward_backward_func(layout.pp, vpp)
    run = functools.partial(
        schedule,
        num_microbatches=num_microbatches,
        seq_length=PACKED_SEQ if packed else SEQ,
        micro_batch_size=1 if packed else ROWS,
        pg_collection=groups,
    )
    steps = []
    for _ in range(STEPS):
        store = run(
            forward_step_func=functools.partial(reference_step, cp),
            data_iterator=[iter(microbatches) for _ in references] if vpp else iter(microbatches),
            model=references if vpp else references[0],
            forward_only=True,
        )
        for microbatch, reported in zip(microbatches, store):
            microbatch["reference_logps"] = reported[preference.REFERENCE_KEY][0]
        for chunk in chunks:
            chunk.zero_grad_buffer()
        store = run(
            forward_step_func=functools.partial(policy_step, objective, step, cp, breaks),
            data_iterator=[iter(microbatches) for _ in chunks] if vpp else iter(microbatches),
            model=chunks if vpp else chunks[0],
        )
        metrics = None
        if store:
            totals = reduce_reported_totals(store, groups.dp_cp if groups is not None else None)
            metrics = {
                key: s / n for key, (s, n) in totals.items() if key.startswith(("rew", "lo"))
            }
            metrics["loss"] = preference.objective_value(totals, objective)
        trained = [(n, p) for gpt in gpts for n, p in reference_names(gpt) if p.requires_grad]
        if optimizer is not None:
            assert optimizer.step()[0]
            for chunk in chunks:
                chunk.finish_param_sync()
            stepped = {name: (param.detach().clone(), param) for name, param in trained}
            steps.append(({}, metrics, stepped))
            continue
        grads = {name: (param.main_grad.detach().clone(), param) for name, param in trained}
        steps.append((grads, metrics, {}))
        with torch.no_grad():
            for _, param in trained:
                param -= LR * param.main_grad.to(param.dtype)
    return steps


def _microbatches(batch, layout: Layout, groups, packed: bool, breaks: str) -> List[dict]:
    """This rank's micro-batches, CP-sharded (packed: THD rows with their
    ``packed_seq_params``; ``unsharded_index``: the control whose ``sequence_index`` is not
    split with the tokens)."""
    cp = groups.cp if groups is not None else None
    dp_rank = groups.dp.rank() if groups is not None else 0
    num_microbatches = MICROBATCHES // layout.dp
    if not packed:
        mine = [
            {k: v[dp_rank * num_microbatches + m] for k, v in batch.items()}
            for m in range(num_microbatches)
        ]
        return [get_batch_on_this_cp_rank(microbatch, cp) for microbatch in mine]
    mine = batch[dp_rank * num_microbatches : (dp_rank + 1) * num_microbatches]
    cp_size, cp_rank = (cp.size(), cp.rank()) if cp is not None else (1, 0)
    out = []
    for row in mine:
        shard, params = get_thd_batch_on_this_cp_rank(
            row, row["cu_seqlens"][0], row["cu_seqlens_padded"][0], row["max_seqlen"][0],
            cp_size=cp_size, cp_rank=cp_rank,
        )  # fmt: skip
        if breaks == "unsharded_index":
            shard["sequence_index"] = row["sequence_index"][:, : shard["tokens"].shape[1]]
        shard["packed_seq_params"] = None if breaks == "no_thd" else params
        out.append(shard)
    return out


def pack_multiples(layout: Layout) -> Tuple[int, int]:
    """(each document's, each row's) length multiple: PACK_MULTIPLE (2C divides it), the
    row x TP under sequence parallelism."""
    return PACK_MULTIPLE, PACK_MULTIPLE * (layout.tp if layout.sp else 1)


def packed_global_batch(
    batch: Dict[str, torch.Tensor], multiple: int, row_multiple: int
) -> List[Dict[str, torch.Tensor]]:
    """``global_batch`` packed: micro-batch g's 2b sequences as the documents of one [1, T_g]
    row in their order (each up to its last completion label, padded to a multiple of
    ``multiple``, the last one further to make T_g a multiple of ``row_multiple``; positions
    from 0, at most SEQ - 1); ``sequence_index`` the document of each position and the THD
    offsets."""
    rows = []
    for g in range(MICROBATCHES):
        lengths = [int(batch["loss_mask"][g, r].nonzero().max()) + 1 for r in range(ROWS)]
        spans = [-(-n // multiple) * multiple for n in lengths]
        spans[-1] += -sum(spans) % row_multiple
        t = sum(spans)
        row = {
            "tokens": torch.zeros(1, t, dtype=torch.long),
            "labels": torch.zeros(1, t, dtype=torch.long),
            "loss_mask": torch.zeros(1, t),
            "position_ids": torch.zeros(1, t, dtype=torch.long),
            "sequence_index": torch.full((1, t), -1, dtype=torch.long),
        }
        real, padded = [0], [0]
        for r, (length, span) in enumerate(zip(lengths, spans)):
            start = padded[-1]
            for key in ("tokens", "labels", "loss_mask"):
                row[key][0, start : start + length] = batch[key][g, r, :length]
            row["position_ids"][0, start : start + span] = torch.arange(span).clamp(max=SEQ - 1)
            row["sequence_index"][0, start : start + span] = r
            real.append(real[-1] + length)
            padded.append(start + span)
        row["cu_seqlens"] = torch.tensor([real], dtype=torch.int32)
        row["cu_seqlens_padded"] = torch.tensor([padded], dtype=torch.int32)
        row["max_seqlen"] = torch.tensor([[max(spans)]], dtype=torch.int32)
        rows.append(row)
    return rows


def _stacked(rows: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """The rows' ``loss_mask`` and ``sequence_index`` as [G, PACKED_SEQ] (-1 / 0 after each
    row's end) for the global batch's counts."""
    out = {}
    for key, fill in (("loss_mask", 0), ("sequence_index", -1)):
        out[key] = torch.full((len(rows), PACKED_SEQ), fill, dtype=rows[0][key].dtype)
        for g, row in enumerate(rows):
            out[key][g, : row[key].shape[1]] = row[key][0]
    return out


def _sgd(chunks, groups):
    """The distributed optimizer's plain SGD at LR (no momentum, decay or clipping)."""
    config = OptimizerConfig(
        optimizer="sgd",
        lr=LR,
        sgd_momentum=0.0,
        weight_decay=0.0,
        clip_grad=1e9,  # never clips
        use_distributed_optimizer=True,
    )
    return get_megatron_optimizer(config, chunks, pg_collection=groups)


def _forward(batch, model) -> torch.Tensor:
    """The per-token NLLs of a micro-batch (a packed row with its ``packed_seq_params``)."""
    extra = {}
    if batch.get("packed_seq_params") is not None:
        extra["packed_seq_params"] = batch["packed_seq_params"]
    return model(batch["tokens"], batch["position_ids"], labels=batch["labels"], **extra)


def _packing(batch) -> dict:
    """The loss functions' packed-row arguments (none for unpacked rows)."""
    if "sequence_index" not in batch:
        return {}
    return {"sequence_index": batch["sequence_index"]}


def reference_step(cp, data_iterator, model):
    """The reference pass's forward step: per-sequence log-probs, no gradient."""
    batch = next(data_iterator)
    output = _forward(batch, model)
    packing = _packing(batch)
    if packing:
        packing["num_sequences"] = preference.packed_sequence_count(batch["cu_seqlens_padded"])
    loss_func = functools.partial(
        preference.reference_log_probs_loss, batch["loss_mask"], cp, **packing
    )
    return output, loss_func


def policy_step(objective, step, cp, breaks, data_iterator, model):
    """The policy pass's forward step (``sft_per_mb``: the control pooling the SFT term per
    micro-batch, a count of G times the micro-batch's own chosen tokens)."""
    batch = next(data_iterator)
    output = _forward(batch, model)
    if breaks == "sft_per_mb":
        own = int(sum_cp(batch["loss_mask"][0::2].sum(), cp).item())
        step = dataclasses.replace(step, chosen_tokens=step.microbatches * own)
    loss_func = functools.partial(
        preference.preference_loss,
        objective,
        step,
        batch.get("reference_logps"),  # on the last stage only
        batch["loss_mask"],
        cp,
        **_packing(batch),
    )
    return output, loss_func


def sum_cp(value: torch.Tensor, cp) -> torch.Tensor:
    """``value`` summed over CP (no gradient)."""
    value = value.detach().clone()
    if cp is not None and cp.size() > 1:
        dist.all_reduce(value, group=cp)
    return value
