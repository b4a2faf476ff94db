"""DPO with MoE layers (SPEC section 21, issue 40) against an independent float64 computation.

The policy is the MoE GPT of ``moe_parity`` (4 layers, 4 experts, top-2), the frozen reference
the same model with other seeded weights; ``moe_reference`` (a per-token routing loop in plain
torch) gives the float64 log-probs of both on the whole global batch, and the pair losses are
``test_dpo_parity``'s written-out formulas. Each micro-batch of 2 rows holds one pair (row 0
chosen, row 1 rejected; uneven lengths, padding at the tail, a prompt masked out).

How the router losses combine with DPO (as megatron-core combines them with any loss): each
MoE layer's router losses on micro-batch m (aux, seq-aux, z, with their coefficients) enter
the backward through the auxiliary-loss scaler with the schedule's 1 / M, and DDP averages
over D, so with R_m their sum over the layers and G = D * M micro-batches

    J = J_dpo + (1 / G) sum_m R_m,

J_dpo the pair mean over every pair of the global batch plus the pooled SFT term. Only the
policy pass adds router losses: the reference pass is forward-only (no gradient) and its
tracker entries are cleared (``dpo.PreferenceTraining``).

Compared at ep2 (dp2), with and without the distributed optimizer: every main_grad (experts
by global index), the parameters after one SGD step, the objective and TRL's metrics. Control:
the same run against J_dpo alone (the router losses left out of the reference) must fail, so
the comparison sees the router losses.
"""

import functools
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state, preference
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.loss_reporting import reduce_reported_totals
from megatron.core.preference import PreferenceStep
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe import moe_utils
from tests.unit_tests.dist_utils import assert_no_failures, gather_failures, rel_error
from tests.unit_tests.models.moe_parity import (
    ARCH,
    LR,
    MICRO_BATCH,
    ROUTING_MARGIN,
    SEQ,
    MoECase,
    build_gpt,
    build_model,
    expected_shard,
    expert_aware_names,
    global_batch,
    initial_params,
    make_config,
    use_moe_layout,
)
from tests.unit_tests.models.moe_reference import check_margins, moe_gpt_forward
from tests.unit_tests.models.naming import reference_names
from tests.unit_tests.models.test_dpo_parity import OBJECTIVES, dense_pair_losses

pytestmark = [pytest.mark.world(2), pytest.mark.slow]
REFERENCE_SEED = 43
TOLERANCE = 1e-5
CASES = [
    pytest.param(
        MoECase(ep=2, dp=2, mb=2, mask="uneven", losses="aux"), "sigmoid-ls-sft", id="aux"
    ),
    pytest.param(
        MoECase(ep=2, dp=2, mb=2, mask="uneven", losses="all", distopt=True),
        "hinge",
        id="aux-seq-z-distopt",
    ),
]


@pytest.mark.parametrize("case, objective", CASES)
def test_moe_dpo_equals_the_float64_reference(case: MoECase, objective: str):
    expected = dense_dpo_reference(case, objective)
    without = dense_dpo_reference(case, objective, router_losses=False)
    run = distributed_dpo_step(case, objective)
    failures = compare(case, run, expected)
    held: List[Optional[List[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(run["params"]))
    missing = set(expected["grads"]) - {n for names in held for n in names}
    if missing:
        failures.append(f"no rank holds {sorted(missing)}")
    assert_no_failures(failures)
    # the control: J_dpo without the router losses is not what was trained
    assert gather_failures(compare(case, run, without)), "the router losses were not seen"


# ----------------------------------------------------------------------------- reference


def seeded_params(case: MoECase, seed: int) -> Dict[str, torch.Tensor]:
    """The one-process model's weights seeded by ``seed`` (float64, reference names)."""
    parallel_state.destroy_model_parallel()
    single = case.model_key()
    model = build_gpt(make_config(single), single, ProcessGroupCollection(), seed=seed)
    return {n: p.detach().double().clone() for n, p in reference_names(model)}


@functools.lru_cache(maxsize=None)
def dense_dpo_reference(case: MoECase, objective_name: str, router_losses: bool = True):
    """{grads, stepped, metrics} of one SGD step on J (module docstring), float64."""
    objective, moe = OBJECTIVES[objective_name], case.moe_arch()
    params = {n: v.clone().requires_grad_() for n, v in initial_params(case).items()}
    reference = seeded_params(case, REFERENCE_SEED)
    batch = global_batch(case)
    logps, ref_logps, counts, routers, stats = [], [], [], [], []
    for g in range(case.dp * case.mb):
        padding, mask = batch["padding_mask"][g], batch["loss_mask"][g].double()
        tokens, labels = batch["tokens"][g], batch["labels"][g]
        losses, per_layer = moe_gpt_forward(params, ARCH, moe, tokens, labels, padding)
        with torch.no_grad():
            ref_losses, ref_layers = moe_gpt_forward(reference, ARCH, moe, tokens, labels, padding)
        logps.append(-(losses * mask).sum(-1))
        ref_logps.append(-(ref_losses * mask).sum(-1))
        counts.append(mask.sum(-1))
        routers.append(sum(st.total for st in per_layer.values()))
        stats += [per_layer, ref_layers]
    near = check_margins(stats, ROUTING_MARGIN)
    assert not near, "routing guard: near ties in the reference:\n" + "\n".join(near[:5])
    logps, ref, counts = torch.cat(logps), torch.cat(ref_logps), torch.cat(counts)
    dpo = dense_pair_losses(objective, logps - ref, counts).mean()
    dpo = dpo + objective.sft_weight * (-logps[0::2].sum() / counts[0::2].sum())
    total = dpo + (sum(routers) / len(routers) if router_losses else 0.0)
    grads = dict(zip(params, torch.autograd.grad(total, list(params.values()))))
    rewards = objective.beta * (logps - ref).detach()
    metrics = {
        "loss": dpo.item(),  # the logged objective: J_dpo (router losses are logged apart)
        "rewards_chosen": rewards[0::2].mean().item(),
        "rewards_margins": (rewards[0::2] - rewards[1::2]).mean().item(),
        "logps_rejected": logps[1::2].mean().item(),
    }
    stepped = {n: (p - LR * grads[n]).detach() for n, p in params.items()}
    return {"grads": grads, "stepped": stepped, "metrics": metrics}


# ----------------------------------------------------------------------------- distributed


def distributed_dpo_step(case: MoECase, objective_name: str) -> dict:
    """One step at the case's layout: the reference model's forward-only pass (its router
    statistics cleared), then the policy's forward-backward and the optimizer's SGD step."""
    objective = OBJECTIVES[objective_name]
    groups = use_moe_layout(case)
    policy = build_model(case, groups)
    reference = build_model(case, groups, seed=REFERENCE_SEED)
    batch = global_batch(case)
    step = PreferenceStep.of_global_batch(batch["loss_mask"].flatten(0, 1), case.dp * case.mb)
    first = groups.dp.rank() * case.mb
    microbatches = [{k: v[first + m] for k, v in batch.items()} for m in range(case.mb)]
    run = functools.partial(
        get_forward_backward_func(1, None),
        num_microbatches=case.mb,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        pg_collection=groups,
    )
    moe_utils.reset_aux_losses_tracker()
    with torch.no_grad():
        store = run(
            forward_step_func=reference_step,
            data_iterator=iter(microbatches),
            model=reference.chunks[0],
            forward_only=True,
        )
    for microbatch, reported in zip(microbatches, store):
        microbatch["reference_logps"] = reported[preference.REFERENCE_KEY][0]
    moe_utils.clear_aux_losses_tracker()
    policy.chunks[0].zero_grad_buffer()
    policy.optimizer.zero_grad()
    store = run(
        forward_step_func=functools.partial(policy_step, objective, step),
        data_iterator=iter(microbatches),
        model=policy.chunks[0],
    )
    moe_utils.clear_aux_losses_tracker()
    totals = reduce_reported_totals(store, groups.dp_cp)
    metrics = {k: s / n for k, (s, n) in totals.items() if k.startswith(("rew", "logps"))}
    metrics["loss"] = preference.objective_value(totals, objective)
    gpt = policy.gpts[0]
    grads = {n: (g.detach().clone(), k, p) for n, k, p, g in expert_aware_names(gpt, groups)}
    assert policy.optimizer.step()[0]
    policy.chunks[0].finish_param_sync()
    params = {n: v.clone() for n, _, v, _ in expert_aware_names(gpt, groups, values=True)}
    return {"grads": grads, "params": params, "metrics": metrics, "groups": groups}


def _forward(batch, model) -> torch.Tensor:
    tokens, positions = batch["tokens"], batch["position_ids"]
    padding = batch["padding_mask"]
    return model(tokens, positions, None, labels=batch["labels"], padding_mask=padding)


def reference_step(data_iterator, model):
    batch = next(data_iterator)
    loss_func = functools.partial(preference.reference_log_probs_loss, batch["loss_mask"], None)
    return _forward(batch, model), loss_func


def policy_step(objective, step, data_iterator, model):
    batch = next(data_iterator)
    loss_func = functools.partial(
        preference.preference_loss,
        objective,
        step,
        batch["reference_logps"],
        batch["loss_mask"],
        None,
    )
    return _forward(batch, model), loss_func


def compare(case: MoECase, run: dict, expected: dict) -> List[str]:
    """This rank's main_grads (not with the distributed optimizer: only its shard of each is
    reduced), parameters after the step and metrics against ``expected``."""
    failures, groups = [], run["groups"]
    for name, (grad, kind, param) in run["grads"].items() if not case.distopt else ():
        err = rel_error(
            grad, expected_shard(expected["grads"][name], name, kind, param, groups, case)
        )
        if not err <= TOLERANCE:
            failures.append(f"main_grad {name}: rel error {err:.2e}")
    for name, value in run["params"].items():
        kind, param = run["grads"][name][1:]
        err = rel_error(
            value, expected_shard(expected["stepped"][name], name, kind, param, groups, case)
        )
        if not err <= TOLERANCE:
            failures.append(f"stepped {name}: rel error {err:.2e}")
    for key, value in expected["metrics"].items():
        got = run["metrics"][key]
        if abs(got - value) > TOLERANCE * max(1.0, abs(value)):
            failures.append(f"{key} {got} != {value}")
    return failures
