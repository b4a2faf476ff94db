"""SPEC 12 rule 4: the clipping norm is the norm of the whole model's gradient, whatever the
layout (TP, PP, CP, DP).

Toy model (from tensor_parallel layers): word embedding E [V, H] (vocab-parallel), L blocks of
Column(H -> F, bias) + Row(F -> H, bias) + LayerNorm(H) (replicated), an output layer tied to
E. The full model's gradient G is drawn once (seeded, float64); every rank holds the part of G
its parameters own: a TP shard of sharded parameters, the whole gradient of replicated ones,
the same values on DP/CP replicas, and on the last pipeline stage a tied copy of E's gradient
(``shared = True``). Reference: ||G|| computed in one process from the full tensors. Negative
controls: counting TP-replicated parameters on every TP rank, counting the tied copy, or
reducing over all ranks (DP/CP replicas) each change the norm.
"""

import math

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tests.unit_tests.dist_utils import WORLD_SIZE, assert_no_failures, reset_layout

pytestmark = pytest.mark.timeout(120)

V, H, F, L = 8, 4, 8, 4  # vocab, hidden, ffn, blocks (divisible by TP 8 and PP 4)

LAYOUTS = {  # id: (tp, pp, cp, dp)
    2: ["tp2", "pp2", "cp2", "dp2"],
    4: ["tp2-dp2", "tp2-pp2", "tp2-cp2", "tp4", "pp2-dp2", "cp2-dp2", "pp4"],
    8: ["tp2-pp2-dp2", "tp2-cp2-pp2", "tp8"],
}


def _sizes(layout_id: str):
    sizes = {"tp": 1, "pp": 1, "cp": 1, "dp": 1}
    for part in layout_id.split("-"):
        name, value = part[:2], int(part[2:])
        sizes[name] = value
    return sizes


def _full_gradient() -> dict:
    """G for every full parameter of the dense model (float32 values, as main_grad holds)."""
    gen = torch.Generator().manual_seed(1234)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).float().double()

    grads = {"embedding": draw(V, H)}
    for i in range(L):
        grads.update(
            {
                f"{i}.fc1.weight": draw(F, H),
                f"{i}.fc1.bias": draw(F),
                f"{i}.fc2.weight": draw(H, F),
                f"{i}.fc2.bias": draw(H),
                f"{i}.norm.weight": draw(H),
                f"{i}.norm.bias": draw(H),
            }
        )
    return grads


def _dense_norm(grads: dict) -> float:
    return math.sqrt(sum(float((g**2).sum()) for g in grads.values()))


class _Stage(torch.nn.Module):
    """This pipeline stage's blocks; the embedding on the first stage, the tied output copy on
    the last (when they differ)."""

    def __init__(self, config, tp_group, pp_rank, pp_size):
        super().__init__()
        per_stage = L // pp_size
        self.block_ids = list(range(pp_rank * per_stage, (pp_rank + 1) * per_stage))
        init = torch.nn.init.normal_
        kw = dict(config=config, init_method=init, tp_group=tp_group)
        if pp_rank == 0:
            self.embedding = VocabParallelEmbedding(V, H, **kw)
        self.blocks = torch.nn.ModuleList()
        for _ in self.block_ids:
            block = torch.nn.Module()
            block.fc1 = ColumnParallelLinear(H, F, bias=True, gather_output=False, **kw)
            block.fc2 = RowParallelLinear(
                F, H, bias=True, input_is_parallel=True, skip_bias_add=False, **kw
            )
            block.norm = torch.nn.LayerNorm(H)
            self.blocks.append(block)
        if pp_size > 1 and pp_rank == pp_size - 1:
            self.output = VocabParallelEmbedding(V, H, **kw)
            self.output.weight.shared = True  # the tied copy of the word embeddings

    def attach(self, full: dict, tp_rank: int, tp_size: int) -> None:
        """main_grad of each parameter = the part of G it owns."""

        def own(param, g):
            if getattr(param, "tensor_model_parallel", False):
                g = g.chunk(tp_size, dim=param.partition_dim)[tp_rank]
            param.main_grad = g.float().contiguous()

        if hasattr(self, "embedding"):
            own(self.embedding.weight, full["embedding"])
        if hasattr(self, "output"):
            own(self.output.weight, full["embedding"])
        for i, block in zip(self.block_ids, self.blocks):
            for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "norm.weight"):
                module, attr = name.split(".")
                own(getattr(getattr(block, module), attr), full[f"{i}.{name}"])
            own(block.norm.bias, full[f"{i}.norm.bias"])


def _norms(layout_id: str, monkeypatch) -> dict:
    s = _sizes(layout_id)
    reset_layout()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=s["tp"],
        pipeline_model_parallel_size=s["pp"],
        context_parallel_size=s["cp"],
    )
    assert parallel_state.get_data_parallel_world_size() == s["dp"]
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    config = ModelParallelConfig(tensor_model_parallel_size=s["tp"], params_dtype=torch.float32)
    torch.manual_seed(0)
    stage = _Stage(config, pgs.tp, parallel_state.get_pipeline_model_parallel_rank(), s["pp"])
    full = _full_gradient()
    stage.attach(full, tp_rank, s["tp"])
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, clip_grad=1.0), [stage], pg_collection=pgs)
    opt.prepare_grads()
    out = {"reference": _dense_norm(full), "ours": opt.get_grad_norm()}

    import megatron.core.tensor_parallel as tp_pkg

    with monkeypatch.context() as m:  # replicated parameters counted on every TP rank
        m.setattr(tp_pkg, "param_is_not_tensor_parallel_duplicate", lambda p, g=None: True)
        out["tp_duplicates_counted"] = opt.get_grad_norm()
    tied = getattr(stage, "output", None)  # the tied copy counted as well (every rank
    if tied is not None:  # takes part in the collective)
        del tied.weight.shared
    out["tied_copy_counted"] = opt.get_grad_norm()
    if tied is not None:
        tied.weight.shared = True
    inner = opt.chained_optimizers[0]
    inner.grad_stats_parallel_group = torch.distributed.group.WORLD  # DP/CP replicas summed
    out["replicas_counted"] = opt.get_grad_norm()
    inner.grad_stats_parallel_group = pgs.mp

    success, norm, _ = opt.step()  # the returned norm is the clipping norm
    out["step"] = norm
    clipped = stage.blocks[0].norm.weight
    out["clip_ok"] = torch.allclose(
        clipped.grad.double(), full[f"{stage.block_ids[0]}.norm.weight"] / (norm + 1e-6), rtol=1e-5
    )
    return out


@pytest.mark.world(4)
def test_grad_norm_counts_every_element_once(monkeypatch):
    """Every axis on 4 ranks (the default run)."""
    _check_layouts(monkeypatch)


@pytest.mark.slow
@pytest.mark.world(2, 8)
def test_grad_norm_counts_every_element_once_2_and_8_ranks(monkeypatch):
    """The same on 2 and 8 ranks (``-m slow``)."""
    _check_layouts(monkeypatch)


def _check_layouts(monkeypatch) -> None:
    failures = []
    for layout_id in LAYOUTS[WORLD_SIZE]:
        s = _sizes(layout_id)
        out = _norms(layout_id, monkeypatch)
        ref = out["reference"]

        def close(x, ref=ref):
            return abs(x - ref) <= 1e-6 * ref

        if not close(out["ours"]) or not close(out["step"]):
            failures.append(f"{layout_id}: norm {out['ours']} / step {out['step']}, dense {ref}")
        if not out["clip_ok"]:
            failures.append(f"{layout_id}: grads not scaled by 1/(norm + 1e-6)")
        # negative controls: each miscount must be visible in this layout
        if s["tp"] > 1 and close(out["tp_duplicates_counted"]):
            failures.append(f"{layout_id}: counting TP duplicates went unnoticed")
        if s["pp"] > 1 and close(out["tied_copy_counted"]):
            failures.append(f"{layout_id}: counting the tied copy went unnoticed")
        if s["dp"] * s["cp"] > 1 and close(out["replicas_counted"]):
            failures.append(f"{layout_id}: summing over DP/CP replicas went unnoticed")
    reset_layout()
    assert_no_failures(failures)


@pytest.mark.world(4)
def test_grad_norm_after_a_real_tp4_backward():
    """TP = 4: gradients from an actual forward/backward through Column -> gelu -> Row ->
    LayerNorm; the norm equals the norm of the dense float64 model's gradient (weights
    gathered from the shards), and counting the replicated LayerNorm/Row-bias on every rank
    would not."""
    reset_layout()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=4)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    config = ModelParallelConfig(tensor_model_parallel_size=4, params_dtype=torch.float32)
    torch.manual_seed(0)
    stage = _Stage(config, pgs.tp, 0, 1)
    block = stage.blocks[0]
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)
        block.norm.bias.uniform_(-0.5, 0.5)
        block.fc1.bias.normal_()
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(7))

    def forward(fc1, b1, fc2, b2, ln_w, ln_b, inp):
        hidden = torch.nn.functional.gelu(inp @ fc1.T + b1)
        out = hidden @ fc2.T + b2
        return (torch.nn.functional.layer_norm(out, (H,), ln_w, ln_b) ** 2).sum()

    y, _ = block.fc2(torch.nn.functional.gelu(block.fc1(x)[0]))
    (
        torch.nn.functional.layer_norm(y, (H,), block.norm.weight, block.norm.bias) ** 2
    ).sum().backward()

    def gather(t, dim):
        parts = [torch.empty_like(t) for _ in range(4)]
        torch.distributed.all_gather(parts, t.detach().contiguous(), group=pgs.tp)
        return torch.cat(parts, dim=dim)

    full = [
        gather(block.fc1.weight, 0),
        gather(block.fc1.bias, 0),
        gather(block.fc2.weight, 1),
        block.fc2.bias.detach(),
        block.norm.weight.detach(),
        block.norm.bias.detach(),
    ]
    leaves = [t.double().clone().requires_grad_() for t in full]
    forward(*leaves, x.double()).backward()
    dense = math.sqrt(sum(float((leaf.grad**2).sum()) for leaf in leaves))

    block_params = [block.fc1.weight, block.fc1.bias, block.fc2.weight, block.fc2.bias]
    block_params += [block.norm.weight, block.norm.bias]
    for p in block_params:
        p.main_grad = p.grad.detach().clone()
        p.grad = None
    for p in stage.embedding.parameters():
        p.main_grad = torch.zeros_like(p)
    for p in stage.parameters():
        if not hasattr(p, "main_grad"):
            p.main_grad = torch.zeros_like(p)
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1), [stage], pg_collection=pgs)
    opt.prepare_grads()
    ours = opt.get_grad_norm()
    import megatron.core.tensor_parallel as tp_pkg

    original = tp_pkg.param_is_not_tensor_parallel_duplicate
    tp_pkg.param_is_not_tensor_parallel_duplicate = lambda p, g=None: True
    try:
        miscounted = opt.get_grad_norm()
    finally:
        tp_pkg.param_is_not_tensor_parallel_duplicate = original
    reset_layout()
    failures = []
    if not abs(ours - dense) <= 1e-5 * dense:
        failures.append(f"norm {ours}, dense float64 {dense}")
    if abs(miscounted - dense) <= 1e-3 * dense:
        failures.append("counting replicated parameters on every TP rank went unnoticed")
    assert_no_failures(failures)
