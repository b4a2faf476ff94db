"""LoRA on routed experts trains the one-process objective at every layout (issue 42).

The MoE GPT of ``moe_parity`` gets adapters on ``linear_qkv`` and on every routed expert's
``linear_fc1`` / ``linear_fc2`` (one A, B per expert). Every adapter gradient (experts by
global index, each rank's expert-TP shard) equals the gradient of the independent float64
reference of ``moe_reference.py`` (a per-token Python loop, no dispatcher) run on the merged
weights W_g + (alpha/dim) B_g A_g, with A and B the leaves autograd differentiates. A and B
both start non-zero (``lora_B_init_method="xavier"``), so neither gradient is trivially zero.

One process (``SequentialMLP`` and ``GroupedMLP``) runs in-process in the default run; EP 2,
ETP 2 (TP 2 with SP) and EP 2 x ETP 2 go through the schedule, DDP and
``finalize_model_grads`` (slow). Negative controls: the ETP sum of the fc2 adapter's
rank-space activations dropped (its B shards see a partial input), and the expert adapters
reduced over data parallelism instead of expert data parallelism; both are caught.
"""

import functools
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.loss_reporting import reduce_reported_losses
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.lora import LoRAConfig, apply_lora
from megatron.core.transformer.moe import expert_lora
from tests.unit_tests.dist_utils import assert_no_failures, gather_failures, rel_error
from tests.unit_tests.models import moe_parity
from tests.unit_tests.models.moe_parity import (
    ARCH,
    MICRO_BATCH,
    ROUTING_MARGIN,
    SEQ,
    MoECase,
    _renumber,
    build_gpt,
    forward_step,
    global_batch,
    make_config,
    use_moe_layout,
)
from tests.unit_tests.models.moe_reference import check_margins, moe_gpt_forward, objective

C = MoECase
LORA = dict(
    dim=4,
    alpha=8.0,
    lora_B_init_method="xavier",
    seed=5,
    target_modules=("linear_qkv", "linear_fc1", "linear_fc2"),
)
# one process runs in float64 (megatron keeps some fp32 islands, e.g. the router: ~6e-7 seen);
# the distributed runs are float32 (the dense LoRA tests' 3e-5)
TOLERANCE_64, TOLERANCE, LOSS_TOLERANCE = 2e-6, 3e-5, 1e-5


# ----------------------------------------------------------------------------- names


def adapter_params(gpt) -> List[Tuple[str, torch.nn.Parameter, Optional[int]]]:
    """(reference name, parameter, local expert or None) of every adapter tensor of a chunk:
    an expert adapter's stacked weight gives one name per local expert (global index)."""
    out = []
    for name, param in gpt.named_parameters():
        if not param.requires_grad:
            continue
        ref = _renumber(gpt, name)
        if ".mlp.experts.adapter." not in ref:
            out.append((ref, param, None))
            continue
        layer, rest = ref.split(".mlp.experts.adapter.")
        proj, part = rest.split(".")[:2]
        experts = moe_parity._experts_module(gpt, name.split(".adapter.")[0] + ".x")
        for i in range(param.shape[0]):
            g = experts.first_expert + i
            expert = f"{layer}.mlp.experts.local_experts.{g}.{proj}"
            out.append((f"{expert}.adapter.{part}.weight", param, i))
    return out


# How each expert adapter's [out, in] matrix is split over expert TP, written out here (not
# read from the parameter under test): fc1 (column-parallel, gated [gate; up] halves strided):
# A split on its rank rows, B on its output rows with the gated stride; fc2 (row-parallel): A
# on its input columns, B on its output rows.
EXPERT_ADAPTER_SPLITS = {
    ("linear_fc1", "linear_in"): (0, 1),
    ("linear_fc1", "linear_out"): (0, 2),  # the cases' experts are gated (SwiGLU)
    ("linear_fc2", "linear_in"): (1, 1),
    ("linear_fc2", "linear_out"): (0, 1),
}


def expected_shard(full: torch.Tensor, name: str, param, groups) -> torch.Tensor:
    """The slice of a reference gradient this rank's (per-expert view of a) parameter holds."""
    expert = ".local_experts." in name
    group = getattr(groups, "expt_tp" if expert else "tp", None)
    size, rank = (1, 0) if group is None else (group.size(), group.rank())
    if expert and ".adapter." in name:
        proj = "linear_fc1" if ".linear_fc1." in name else "linear_fc2"
        part = "linear_in" if ".linear_in." in name else "linear_out"
        dim, stride = EXPERT_ADAPTER_SPLITS[(proj, part)]
        return moe_parity.shard(full, dim, stride, size, rank)
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim - (1 if expert else 0)  # a stacked tensor's expert axis removed
    return moe_parity.shard(full, dim, param.partition_stride, size, rank)


# ----------------------------------------------------------------------------- reference


@functools.lru_cache(maxsize=None)
def reference(key: MoECase) -> Tuple[Dict[str, torch.Tensor], float]:
    """{adapter name: gradient of J} (float64, merged weights, whole global batch) and the
    logged LM loss."""
    parallel_state.destroy_model_parallel()
    model = build_gpt(make_config(key), key, ProcessGroupCollection())
    apply_lora(model, LoRAConfig(**LORA))
    every = {n: p.detach().double() for n, p in model.named_parameters()}
    adapters = {}
    for name, param, i in adapter_params(model):
        value = param.detach().double()
        adapters[name] = (value if i is None else value[i]).clone().requires_grad_()
    base = {_renumber(model, n): v for n, v in every.items() if ".adapter" not in n}
    scale = LORA["alpha"] / LORA["dim"]
    merged = dict(base)
    for name in base:
        layer = name.rsplit(".", 1)[0]
        if f"{layer}.adapter.linear_in.weight" in adapters:
            a = adapters[f"{layer}.adapter.linear_in.weight"]
            b = adapters[f"{layer}.adapter.linear_out.weight"]
            merged[name] = base[name] + scale * b @ a
    moe, batch = key.moe_arch(), global_batch(key)
    sums, counts, totals, routed, stats = [], [], [], [], []
    for g in range(key.mb):
        padding = batch["padding_mask"][g] if "padding_mask" in batch else None
        losses, per_layer = moe_gpt_forward(
            merged, ARCH, moe, batch["tokens"][g], batch["labels"][g], padding
        )
        mask = batch["loss_mask"][g].double()
        sums.append((losses * mask).sum())
        counts.append(mask.sum())
        totals.append(sum(st.total for st in per_layer.values()))
        routed.append(int((~padding).sum()) if padding is not None else MICRO_BATCH * SEQ)
        stats.append(per_layer)
    near = check_margins(stats, ROUTING_MARGIN)
    assert not near, "routing guard: near ties in the reference:\n" + "\n".join(near[:5])
    J = objective(key.mode, sums, counts, totals, routed)
    grads = dict(zip(adapters, torch.autograd.grad(J, list(adapters.values()))))
    return grads, float(sum(sums).detach()) / max(float(sum(counts)), 1.0)


def compare(grads, ref, groups, tolerance: float = TOLERANCE) -> List[str]:
    """Failures of {name: (gradient, parameter)} against the reference gradients."""
    failures = []
    for name, (grad, param) in grads.items():
        if name not in ref:
            failures.append(f"{name}: not in the reference")
            continue
        error = rel_error(grad, expected_shard(ref[name], name, param, groups))
        if not error <= tolerance:
            failures.append(f"{name}: rel error {error:.2e}")
    return failures


# ----------------------------------------------------------------------------- one process


ONE = C(mask="uneven", losses="none")


@pytest.mark.world(1)
def test_adapters_take_the_grouped_gemm_where_the_experts_do_with_aligned_rows(monkeypatch):
    """The adapters' grouped-GEMM rule is the experts' (``grouped_gemm.use_grouped_mm``) and rows
    of a multiple of 8 elements (a rank of 4 falls back to the per-expert loop)."""
    x = torch.zeros(3, 16)
    monkeypatch.setattr(expert_lora, "use_grouped_mm", lambda x, w: True)
    assert expert_lora._grouped_mm_applies(x, torch.zeros(2, 8, 16))
    assert not expert_lora._grouped_mm_applies(x, torch.zeros(2, 4, 16))
    monkeypatch.setattr(expert_lora, "use_grouped_mm", lambda x, w: False)
    assert not expert_lora._grouped_mm_applies(x, torch.zeros(2, 8, 16))


@pytest.mark.world(1)
def test_one_adapted_forward_builds_the_grouped_gemm_offsets_once(monkeypatch):
    """The adapted forward of ``GroupedMLP`` is its forward with the adapters' terms: its six
    grouped GEMMs (fc1, fc2 and each adapter's A and B) share one offsets tensor (it was
    rebuilt on the device for each of them), and without adapters fc1 and fc2 share it too."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import experts

    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=2,
        moe_ffn_hidden_size=16, params_dtype=torch.bfloat16,
    )  # fmt: skip
    module = experts.GroupedMLP(2, config)
    torch.nn.init.normal_(module.weight1, generator=torch.Generator().manual_seed(0))
    torch.nn.init.normal_(module.weight2, generator=torch.Generator().manual_seed(1))
    lora = LoRAConfig(dim=8, lora_B_init_method="normal", params_dtype=torch.bfloat16)
    adapters = {
        proj: expert_lora.ExpertLoRAAdapter(module, proj, lora, proj, lambda g: f"e{g}")
        for proj in ("linear_fc1", "linear_fc2")
    }
    for target in (experts, expert_lora):  # torch._grouped_mm runs on the CPU for these shapes
        monkeypatch.setattr(target, "use_grouped_mm", lambda x, w: True)
    offsets, grouped_mm = [], torch._grouped_mm

    def recording(x, w, offs):
        offsets.append(offs)
        return grouped_mm(x, w, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", recording)
    x = torch.randn(5, 16).to(torch.bfloat16)
    probs, counts = torch.rand(5), torch.tensor([2, 3])
    out, _ = module.adapted_forward(x, counts, probs, adapters)
    assert len(offsets) == 6 and all(o is offsets[0] for o in offsets)
    assert offsets[0].tolist() == [2, 5]
    plain, _ = module(x, counts, probs)
    assert len(offsets) == 8 and offsets[7] is offsets[6]
    assert not torch.equal(out, plain)  # the adapters' terms are there


@pytest.mark.world(1)
@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_one_process_expert_adapter_grads_equal_reference(grouped: bool):
    case = ONE.with_(grouped=grouped)
    ref, ref_loss = reference(case.model_key())
    parallel_state.destroy_model_parallel()
    config = make_config(case)
    config.params_dtype = torch.float64
    model = build_gpt(config, case, ProcessGroupCollection())
    added = apply_lora(model, LoRAConfig(**LORA, params_dtype=torch.float64))
    assert "decoder.layers.3.mlp.experts.local_experts.3.linear_fc2" in added
    batch = global_batch(case)
    total, count = 0.0, 0.0
    for g in range(case.mb):
        losses = model(
            batch["tokens"][g],
            batch["position_ids"][g],
            None,
            labels=batch["labels"][g],
            padding_mask=batch["padding_mask"][g],
        )
        mask = batch["loss_mask"][g]
        loss = (losses * mask).sum() / mask.sum().clamp(min=1)
        (loss / case.mb).backward()
        total, count = total + float((losses * mask).sum().detach()), count + float(mask.sum())
    grads = {n: ((p.grad if i is None else p.grad[i]), p) for n, p, i in adapter_params(model)}
    assert_no_failures(compare(grads, ref, ProcessGroupCollection(), TOLERANCE_64))
    assert set(grads) == set(ref)
    assert abs(total / count - ref_loss) <= TOLERANCE_64 * ref_loss
    assert all(p.grad is None for n, p in model.named_parameters() if ".adapter" not in n)


# ----------------------------------------------------------------------------- distributed


def distributed_grads(case: MoECase, groups, sabotage=None):
    """One schedule pass (DDP, finalize_model_grads) of the case's LoRA model: {adapter
    name: (main_grad of this rank's view, parameter)} and the logged loss."""
    config = make_config(case)
    gpt = build_gpt(config, case, groups)
    apply_lora(gpt, LoRAConfig(**LORA))
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt, pg_collection=groups
    )
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    batch = global_batch(case)
    first = groups.dp.rank() * case.mb
    microbatches = [
        get_batch_on_this_cp_rank({k: v[first + m] for k, v in batch.items()}, groups.cp)
        for m in range(case.mb)
    ]
    ddp.zero_grad_buffer()
    store = get_forward_backward_func(1, None)(
        forward_step_func=functools.partial(forward_step, case, groups.cp),
        data_iterator=iter(microbatches),
        model=ddp,
        num_microbatches=case.mb,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        pg_collection=groups,
    )
    logged = reduce_reported_losses(store, groups.dp_cp).get("lm loss")
    grads = {}
    for name, param, i in adapter_params(gpt):
        grad = param.main_grad.detach().clone()
        grads[name] = (grad if i is None else grad[i], param)
    return grads, logged


def _distributed_failures(case: MoECase, monkeypatch=None) -> List[str]:
    ref, ref_loss = reference(case.with_(grouped=False, dp=1, mb=case.dp * case.mb).model_key())
    groups = use_moe_layout(case)
    grads, logged = distributed_grads(case, groups)
    failures = compare(grads, ref, groups)
    if logged is not None and abs(logged - ref_loss) > LOSS_TOLERANCE * ref_loss:
        failures.append(f"logged loss {logged} != reference {ref_loss}")
    held: List[Optional[List[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(grads))
    missing = set(ref) - {n for names in held for n in names}
    if missing:
        failures.append(f"no rank holds {sorted(missing)[:4]}")
    return failures


def _case(case: MoECase, world: int):
    marks = [pytest.mark.world(world), pytest.mark.slow]
    return pytest.param(case, marks=marks, id=case.id)


# fmt: off
CASES = [
    _case(C(ep=2, etp=1, dp=2, mask="uneven", losses="aux"), 2),
    _case(C(ep=2, etp=1, dp=2, mask="uneven", losses="aux", grouped=True), 2),
    _case(C(ep=1, etp=2, tp=2, mask="uneven", losses="aux"), 2),
    _case(C(ep=1, etp=2, tp=2, mask="uneven", losses="aux", grouped=True), 2),
    _case(C(ep=2, etp=2, tp=2, dp=2, mask="uneven", mode="per-token", losses="aux"), 4),
    _case(C(ep=2, etp=2, tp=2, dp=2, mask="uneven", losses="aux", grouped=True), 4),
]
# fmt: on


@pytest.mark.parametrize("case", CASES)
def test_expert_adapter_main_grads_equal_reference(case: MoECase):
    assert_no_failures(_distributed_failures(case))


@pytest.mark.slow
@pytest.mark.world(2)
def test_negative_control_fc2_adapter_not_summed_over_etp(monkeypatch):
    case = C(ep=1, etp=2, tp=2, mask="uneven", losses="aux")
    reference(case.model_key())
    monkeypatch.setattr(expert_lora, "all_reduce_with_summed_grad", lambda h, group: h)
    failures = gather_failures(_distributed_failures(case))
    assert any("linear_fc2.adapter" in f for f in failures), failures[:5]


@pytest.mark.slow
@pytest.mark.world(2)
def test_negative_control_expert_adapters_reduced_over_data_parallel(monkeypatch):
    """Expert adapters marked as dense parameters (``allreduce`` True): at EP 2 over DP 2
    DDP averages each rank's experts' gradients with the other rank's (other experts)."""
    case = C(ep=2, etp=1, dp=2, mask="uneven", losses="aux")
    reference(case.with_(dp=1, mb=2).model_key())
    init = expert_lora._Stacked.__init__

    def dense(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.weight.allreduce = True

    monkeypatch.setattr(expert_lora._Stacked, "__init__", dense)
    failures = gather_failures(_distributed_failures(case))
    assert any("local_experts" in f and ".adapter." in f for f in failures), failures[:5]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [pytest.param(C(ep=2, etp=1, dp=2), marks=pytest.mark.world(2), id="ep2"),
     pytest.param(C(ep=1, etp=2, tp=2), marks=pytest.mark.world(2), id="etp2")],
)  # fmt: skip
def test_full_expert_adapters_load_into_their_ep_and_etp_shards(case: MoECase):
    """``--hf-adapter``'s loader (``peft._load_expert_adapter``) puts every global expert's
    full A and B (here another seed's, so not the values already there) into the rank that
    holds the expert, each ETP rank its shard."""
    from megatron.training.hf import peft

    parallel_state.destroy_model_parallel()
    single = build_gpt(make_config(C()), C(), ProcessGroupCollection())
    apply_lora(single, LoRAConfig(**dict(LORA, seed=99)))
    full = {}
    for name, param, i in adapter_params(single):
        full[name] = param.detach() if i is None else param.detach()[i]
    groups = use_moe_layout(case)
    gpt = build_gpt(make_config(case), case, groups)
    apply_lora(gpt, LoRAConfig(**LORA))
    for module in gpt.modules():
        if isinstance(module, expert_lora.ExpertLoRAAdapter):
            peft._load_expert_adapter(module, full)
    failures = []
    for name, param, i in adapter_params(gpt):
        if i is not None and not torch.equal(
            param.detach()[i], expected_shard(full[name], name, param, groups)
        ):
            failures.append(f"{name}: not its shard of the full adapter")
    assert_no_failures(gather_failures(failures))
