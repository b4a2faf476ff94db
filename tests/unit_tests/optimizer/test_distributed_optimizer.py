"""The distributed optimizer (ZeRO-1) trains the one-process run: after STEPS Adam steps with
gradient clipping, the parameters on every rank equal the one-process model's (a GPT in one
process, whole global batch, ``torch.optim.AdamW`` and ``clip_grad_norm_`` used directly,
nothing from the package's optimizer) within 1e-6 relative over all of the rank's parameters
together and 1e-5 per tensor (biases start at zero, so a tensor's own norm is small and its
relative error is the per-element fp32 rounding of its gradient), in both loss modes, with
prompt-masked (uneven) data; the first step's gradient norm equals the reference's within
1e-6. At the same layout and without clipping, the distributed and the non-distributed
optimizer give bitwise the same parameters (on gloo both reduce with the same all-reduce;
Adam is elementwise), the same zero counts and norms within 1e-12 at every step.

The clipping threshold is half the reference's first gradient norm, so clipping is active and
a wrong norm changes the parameters. Negative controls (monkeypatched mutations, each must
make the comparison fail): a shard boundary off by one (each rank steps the elements
[lo + 1, hi + 1) of its bucket piece, so the first element of every piece is never updated)
and a norm that counts one shard twice.
"""

import functools
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.distributed.param_and_grad_buffer import GradBucket
from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.dist_utils import (
    Layout,
    assert_no_failures,
    rel_error,
    reset_layout,
    use_layout,
)
from tests.unit_tests.models.naming import reference_names
from tests.unit_tests.models.test_gpt_parity import (
    ARCHS,
    GLOBAL_MICROBATCHES,
    MICRO_BATCH,
    SEQ,
    build_gpt,
    forward_step,
    global_batch,
    make_config,
    shard_like,
)

pytestmark = pytest.mark.timeout(300)

STEPS, LR, WEIGHT_DECAY = 3, 1e-3, 0.1
# Adam's eps well above fp32 noise: a gradient that is zero in exact arithmetic (the key
# bias: softmax is shift-invariant) holds rounding noise whose sign would decide a full
# lr-sized update; with eps = 1e-3 such noise moves a parameter by ~1e-8.
ADAM_EPS = 1e-3
TOLERANCE, PER_TENSOR_TOLERANCE = 1e-6, 1e-5
BUCKET = 600  # elements: several buckets per chunk


def _case(layout: Layout, mode: str, arch: str, overlap: bool = False, slow: bool = False):
    marks = [pytest.mark.world(layout.world)] + ([pytest.mark.slow] if slow else [])
    tag = "-overlap" if overlap else ""
    return pytest.param(
        layout, mode, arch, overlap, marks=marks, id=f"{layout.id}-{arch}-{mode}{tag}"
    )


CASES = [
    _case(Layout(dp=2), "averaged", "gpt2", overlap=True),
    _case(Layout(dp=2), "per-token", "llama", slow=True),
    _case(Layout(cp=2), "per-token", "gpt2"),
    _case(Layout(dp=4), "per-token", "gpt2", overlap=True),
    _case(Layout(cp=2, dp=2), "averaged", "llama", slow=True),
    _case(Layout(tp=2, sp=True, dp=2), "averaged", "llama", overlap=True),
    _case(Layout(pp=2, vpp=2, dp=2), "averaged", "gpt2", overlap=True),
    _case(Layout(pp=2, dp=2), "per-token", "gpt2", slow=True),
    _case(Layout(cp=2, pp=2), "per-token", "llama", slow=True),
    _case(Layout(tp=2, cp=2), "per-token", "gpt2", slow=True),
    _case(Layout(tp=2, sp=True, pp=2), "averaged", "gpt2", overlap=True, slow=True),
    _case(Layout(dp=4), "averaged", "llama", slow=True),
]


@pytest.mark.parametrize("layout, mode, arch, overlap", CASES)
def test_distributed_optimizer_matches_one_process_adam(layout, mode, arch, overlap):
    reference = one_process_adam(mode, arch)
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    params, norms, zeros = distributed_adam(layout, mode, arch, groups, overlap)
    failures = compare(params, norms, zeros, reference, groups)
    reset_layout()
    assert_no_failures(failures)


@pytest.mark.world(2, 4)
def test_bitwise_equal_to_the_non_distributed_optimizer_at_the_same_layout():
    layout = Layout(dp=2) if dist.get_world_size() == 2 else Layout(cp=2, dp=2)
    one_process_adam("per-token", "llama")
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    (plain, plain_norms, plain_zeros), (sharded, norms, zeros) = [
        distributed_adam(layout, "per-token", "llama", groups, overlap, distributed, clip=0.0)
        for overlap, distributed in ((False, False), (True, True))
    ]
    reset_layout()
    failures = [
        f"{name} differs from the plain optimizer's"
        for name in plain
        if not torch.equal(plain[name][0], sharded[name][0])
    ]
    if zeros != plain_zeros or zeros[0] == 0:
        failures.append(f"zero counts {zeros}, plain optimizer {plain_zeros}")
    for norm, ref in zip(norms, plain_norms):
        if not abs(norm - ref) <= 1e-12 * ref:
            failures.append(f"grad norms {norms}, plain optimizer {plain_norms}")
    assert_no_failures(failures)


@pytest.mark.world(2, 4)
@pytest.mark.parametrize("mutation", ["shard-boundary-off-by-one", "shard-counted-twice"])
def test_negative_controls_fail_the_comparison(mutation, monkeypatch):
    layout = Layout(dp=2) if dist.get_world_size() == 2 else Layout(cp=2, dp=2)
    reference = one_process_adam("averaged", "gpt2")
    if mutation == "shard-boundary-off-by-one":
        original = GradBucket.shard_range

        def shifted(self, rank, size):
            lo, hi = original(self, rank, size)
            return lo + 1, min(hi + 1, self.end)

        monkeypatch.setattr(GradBucket, "shard_range", shifted)
    else:
        original = DistributedOptimizer.get_main_grads_for_grad_norm

        def twice(self):
            grads = original(self)
            return grads + grads[:1]

        monkeypatch.setattr(DistributedOptimizer, "get_main_grads_for_grad_norm", twice)
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    params, norms, zeros = distributed_adam(layout, "averaged", "gpt2", groups, False)
    failures = compare(params, norms, zeros, reference, groups)
    reset_layout()
    everyone: List[List[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failures)
    assert any(everyone), f"{mutation}: the comparison did not catch the mutation"


def compare(params, norms, zeros, reference, groups) -> List[str]:
    ref_params, ref_norms, ref_zeros = reference
    failures = []
    tp_size, tp_rank = groups.tp.size(), groups.tp.rank()
    ours, theirs = [], []
    for name, (param, owner) in params.items():
        expected = shard_like(ref_params[name], owner, tp_size, tp_rank)
        ours.append(param.reshape(-1))
        theirs.append(expected.reshape(-1))
        error = rel_error(param, expected)
        if not error <= PER_TENSOR_TOLERANCE:
            failures.append(f"{name}: relative error {error:.2e} after {STEPS} Adam steps")
    error = rel_error(torch.cat(ours), torch.cat(theirs))
    if not error <= TOLERANCE:
        failures.append(f"all parameters: relative error {error:.2e} after {STEPS} Adam steps")
    # the first step's norm (later ones are taken at parameters that differ by rounding)
    if not abs(norms[0] - ref_norms[0]) <= TOLERANCE * ref_norms[0]:
        failures.append(f"grad norm {norms[0]!r}, one process {ref_norms[0]!r}")
    return failures


# ----------------------------------------------------------------------------- reference


def _no_decay(name: str, param: torch.Tensor) -> bool:
    """megatron's default: no weight decay on biases and 1-D parameters."""
    return name.endswith(".bias") or param.dim() == 1


@functools.lru_cache(maxsize=None)
def one_process_adam(mode: str, arch_name: str) -> Tuple[Dict[str, torch.Tensor], list, list]:
    """The one-process run: fp32 GPT, whole global batch, objective J of SPEC section 4,
    ``clip_grad_norm_(CLIP)``, ``torch.optim.AdamW``. Returns the parameters after STEPS
    steps (by reference name), the norm before clipping and the zero count per step."""
    arch = ARCHS[arch_name]
    reset_layout()
    model = build_gpt(make_config(Layout(), mode, arch), arch, ProcessGroupCollection(), 0)
    named = dict(reference_names(model))
    decay = [p for n, p in named.items() if not _no_decay(n, p)]
    no_decay = [p for n, p in named.items() if _no_decay(n, p)]
    adam = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        eps=ADAM_EPS,
        foreach=False,
    )
    batch = global_batch(arch.vocab)
    norms, zeros = [], []
    for _ in range(STEPS):
        adam.zero_grad()
        sums, counts = [], []
        for g in range(GLOBAL_MICROBATCHES):
            losses = model(batch["tokens"][g], batch["position_ids"][g], labels=batch["labels"][g])
            sums.append((losses * batch["loss_mask"][g]).sum())
            counts.append(batch["loss_mask"][g].sum())
        sums, counts = torch.stack(sums), torch.stack(counts)
        if mode == "per-token":
            objective = sums.sum() / counts.sum().clamp(min=1)
        else:
            objective = (sums / counts.clamp(min=1)).mean()
        objective.backward()
        grads = [p.grad for p in named.values()]
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
        norms.append(norm)
        zeros.append(sum(int((g == 0).sum()) for g in grads))
        torch.nn.utils.clip_grad_norm_(list(named.values()), clip_of(mode, arch_name, norm))
        adam.step()
    return {n: p.detach().clone() for n, p in named.items()}, norms, zeros


_CLIP: Dict[Tuple[str, str], float] = {}


def clip_of(mode: str, arch_name: str, first_norm: float) -> float:
    """Half the first step's gradient norm: clipping is active at every step."""
    return _CLIP.setdefault((mode, arch_name), 0.5 * first_norm)


# ----------------------------------------------------------------------------- distributed


def distributed_adam(
    layout: Layout,
    mode: str,
    arch_name: str,
    groups,
    overlap: bool,
    distributed: bool = True,
    clip: Optional[float] = None,
):
    """STEPS steps of this rank's DDP chunks (small buckets, overlapped reduction and, with
    ``overlap``, overlapped parameter all-gather) with ``get_megatron_optimizer``
    (``use_distributed_optimizer=distributed``; clipping at ``clip``, default the
    reference's threshold)."""
    arch = ARCHS[arch_name]
    config = make_config(layout, mode, arch)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        overlap_param_gather=overlap,
        use_distributed_optimizer=distributed,
        bucket_size=BUCKET,
    )
    pp_rank, vpp = groups.pp.rank(), layout.vpp
    stages = layout.pp * (vpp or 1)
    chunks = []
    for v in range(vpp or 1):
        gpt = build_gpt(
            config, arch, groups, None, v * layout.pp + pp_rank, stages, v if vpp else None
        )
        chunks.append(DistributedDataParallel(config, ddp_config, gpt, pg_collection=groups))
    config.no_sync_func = [c.no_sync for c in chunks] if vpp else chunks[0].no_sync
    config.grad_sync_func = (
        [c.start_grad_sync for c in chunks] if vpp else chunks[0].start_grad_sync
    )
    config.finalize_model_grads_func = finalize_model_grads
    clip = _CLIP[(mode, arch_name)] if clip is None else clip
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            adam_eps=ADAM_EPS,
            clip_grad=clip,
            log_num_zeros_in_grad=True,
            use_distributed_optimizer=distributed,
            overlap_param_gather=overlap,
        ),
        chunks,
        pg_collection=groups,
    )
    for group in optimizer.param_groups:  # what OptimizerParamScheduler sets every step
        group["weight_decay"] = WEIGHT_DECAY * group["wd_mult"]
    num_microbatches = GLOBAL_MICROBATCHES // layout.dp
    first = groups.dp.rank() * num_microbatches
    batch = global_batch(arch.vocab)
    microbatches = [
        get_batch_on_this_cp_rank({k: v[first + m] for k, v in batch.items()}, groups.cp)
        for m in range(num_microbatches)
    ]
    norms, zeros = [], []
    for _ in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        iterators = [iter(microbatches) for _ in chunks]
        get_forward_backward_func(layout.pp, vpp)(
            forward_step_func=forward_step,
            data_iterator=iterators if vpp else iterators[0],
            model=chunks if vpp else chunks[0],
            num_microbatches=num_microbatches,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            pg_collection=groups,
        )
        success, norm, num_zeros = optimizer.step()
        assert success
        norms.append(norm)
        zeros.append(int(num_zeros))
    for chunk in chunks:
        chunk.finish_param_sync()
    params = {}
    for chunk in chunks:
        for name, param in reference_names(chunk.module):
            params[name] = (param.detach().clone(), param)
    return params, norms, zeros
