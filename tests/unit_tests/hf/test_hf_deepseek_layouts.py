"""DeepSeek-V3 / V2-Lite from HuggingFace at 2-, 4- and 8-rank layouts against transformers,
float64: one step through DDP, the schedule and ``finalize_model_grads`` (per-token loss over
an uneven mask, a CP shard without valid tokens) gives every ``main_grad`` of transformers'
model (this rank's TP / expert shard) and, for V3, the expert bias transformers' routing
counts give (each pipeline stage updates its own layers). Slow: a torchrun launch.

Launch: ``torchrun --nproc-per-node 2 (or 4, 8) -m pytest
tests/unit_tests/hf/test_hf_deepseek_layouts.py -m slow``.
"""

import json
import pathlib

import pytest
import torch
import torch.distributed as dist

from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.utils import get_pg_rank, get_pg_size
from megatron.training.hf import model_from_hf
from megatron.training.hf.config import read_hf_config
from megatron.training.hf.loading import one_chunk_name, shard_ranges, strided_ranges
from megatron.training.hf.weights import our_full_shapes, parameter_sources
from tests.unit_tests.dist_utils import Layout, assert_no_failures, gather_failures, use_layout
from tests.unit_tests.hf.hf_models import HAVE_TRANSFORMERS, SKIP_REASON
from tests.unit_tests.hf.test_hf_deepseek import (
    SEQ,
    expected_bias,
    hf_grad,
    hf_reference,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=SKIP_REASON)]
LAYOUTS = [
    pytest.param(layout, marks=pytest.mark.world(layout.world), id=layout.id)
    for layout in (
        Layout(tp=2, sp=True),
        Layout(cp=2),
        Layout(pp=2),
        Layout(dp=2, ep=2),
        Layout(tp=2, sp=True, pp=2),
        Layout(cp=2, pp=2),
        Layout(tp=2, sp=True, dp=2, ep=2),
        Layout(tp=2, sp=True, cp=2, pp=2),  # 8 ranks
        Layout(tp=2, sp=True, cp=2, dp=2, ep=2),  # 8 ranks: experts over ETP 2 x EP 2
    )
]


def _mask() -> torch.Tensor:
    """Uneven: sequence 0 has valid tokens on one CP shard only (2 x 8, CP chunks of 2)."""
    mask = torch.ones(2, SEQ, dtype=torch.float64)
    mask[0, 2:6] = 0
    mask[1, :1] = 0
    return mask


def _batch_of_this_rank(groups, layout: Layout) -> dict:
    from tests.unit_tests.hf.test_hf_deepseek import _batch

    tokens, labels, _ = _batch()
    batch = dict(tokens=tokens, labels=labels, loss_mask=_mask())
    if layout.dp > 1:  # one sequence per data-parallel rank
        rank = groups.dp.rank()
        batch = {k: v[rank : rank + 1] for k, v in batch.items()}
    return get_batch_on_this_cp_rank(batch, groups.cp)


def _step(directory, layout: Layout, adapt=None, **overrides):
    """Our model from ``directory`` at ``layout`` after one step: (chunk, config);
    ``adapt(chunk)`` before DDP (LoRA); ``overrides``: TransformerConfig fields."""
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    model, config = model_from_hf(
        directory,
        pg_collection=groups,
        params_dtype=torch.float64,
        sequence_parallel=layout.sp,
        calculate_per_token_loss=True,
        **overrides,
    )
    if adapt is not None:
        adapt(model)
    chunk = DistributedDataParallel(config, DistributedDataParallelConfig(), model, groups)
    config.finalize_model_grads_func = finalize_model_grads
    batch = _batch_of_this_rank(groups, layout)

    def forward_step(data_iterator, module):
        output = module(batch["tokens"], None, None, labels=batch["labels"])

        def loss_func(output_tensor):
            loss_sum = (output_tensor * batch["loss_mask"]).sum()
            return loss_sum, batch["loss_mask"].sum().to(torch.int), {}

        return output, loss_func

    chunk.zero_grad_buffer()
    get_forward_backward_func(layout.pp)(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=chunk,
        num_microbatches=1,
        seq_length=SEQ,
        micro_batch_size=batch["tokens"].shape[0],
        pg_collection=groups,
    )
    return model, config


def _global_name(model, name: str) -> "tuple[str, object]":
    """(one-chunk name with the global expert index, the experts module or None)."""
    full = one_chunk_name(model, name)
    if ".local_experts." not in full:
        return full, None
    head, rest = full.split(".local_experts.")
    local, tail = rest.split(".", 1)
    module = model.get_submodule(name.split(".local_experts.")[0])
    assert isinstance(module, (SequentialMLP, GroupedMLP))
    return f"{head}.local_experts.{module.first_expert + int(local)}.{tail}", module


def _expected_shard(full: torch.Tensor, ranges) -> torch.Tensor:
    rows, columns = ranges
    part = torch.cat([full[a:b] for a, b in rows])
    return part if columns is None else part[:, columns[0] : columns[1]]


def _mismatches(model, hf, directory, tp_group) -> list:
    arch, _ = read_hf_config(directory)
    sources, shapes = parameter_sources(arch), our_full_shapes(arch)
    hf_params = dict(hf.named_parameters())
    bad = []
    for name, param in model.named_parameters():
        full_name, experts = _global_name(model, name)
        full = torch.cat([hf_grad(hf_params, s.key)[s.start : s.stop] for s in sources[full_name]])
        if experts is None:
            ranges = shard_ranges(param, shapes[full_name], get_pg_size(tp_group),
                                  get_pg_rank(tp_group))  # fmt: skip
        else:
            dim, stride = experts.expert_split(full_name.rsplit(".", 2)[-2])
            ranges = strided_ranges(shapes[full_name], dim, stride,
                                    get_pg_size(experts.tp_group),
                                    get_pg_rank(experts.tp_group))  # fmt: skip
        expected = _expected_shard(full, ranges)
        scale = expected.abs().max().clamp(min=1e-300)  # an expert no token chose: 0
        err = ((param.main_grad - expected).abs().max() / scale).item()
        if not err <= 1e-10:
            bad.append(f"{full_name}: {err:.2e}")
    return bad


RECOMPUTE = {
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective", recompute_modules=["mlp", "core_attn"]),
}


@pytest.mark.parametrize("name", ["v3", "v2_lite"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_deepseek_step_at_layout_matches_transformers(name, layout, tmp_path):
    _check_step(name, layout, tmp_path)


@pytest.mark.world(2)
@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize(
    "layout", [Layout(tp=2, sp=True), Layout(cp=2)], ids=lambda layout: layout.id
)
def test_deepseek_v3_step_with_recompute_matches_transformers(recompute, layout, tmp_path):
    """Full and selective recomputation leave every gradient and the bias update as
    transformers' (a doubled count would not show in the bias: sign(2m - 2n) = sign(m - n))."""
    _check_step("v3", layout, tmp_path, **RECOMPUTE[recompute])


def _check_step(name, layout, tmp_path, **overrides):
    # transformers' save_pretrained writes on rank 0 only: every rank reads rank 0's folder
    shared = [str(tmp_path / "model")]
    dist.broadcast_object_list(shared, src=0)
    directory = shared[0]
    _, _, hf, chosen = hf_reference(name, directory, mask=_mask())
    dist.barrier()
    model, config = _step(directory, layout, **overrides)
    failures = _mismatches(model, hf, directory, model.tp_group)
    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None or router.expert_bias is None:
            continue
        hf_bias = hf.model.layers[layer.layer_number - 1].mlp.gate.e_score_correction_bias
        want = expected_bias(hf_bias, chosen[0], config.moe_router_bias_update_rate)
        if not torch.equal(router.expert_bias, want):
            failures.append(f"expert bias {router.expert_bias.tolist()} != {want.tolist()}")
    assert_no_failures(gather_failures(failures))


def _full(param, tp_group) -> torch.Tensor:
    """The whole tensor of a TP-sharded (stride 1) or replicated parameter."""
    if not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    parts = [torch.empty_like(param) for _ in range(tp_group.size())]
    dist.all_gather(parts, param.detach().contiguous(), group=tp_group)
    return torch.cat(parts, dim=param.partition_dim)


def _peft_reference(name: str, directory, adapters: dict, lora) -> dict:
    """peft's LoRA gradients (float64) of transformers' model with ``adapters`` (our full
    adapter tensors), by our adapter parameter names."""
    from peft import PeftModel
    from safetensors.torch import save_file

    from megatron.training.hf.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_config, to_peft
    from tests.unit_tests.hf.test_hf_deepseek import VOCAB, _batch, _build, _patches

    # transformers' copy saved to a folder of this rank's: both ranks saving into the shared
    # ``directory`` raced with the other rank reading it (a half-written config.json)
    hf = _build(name, directory.parent / f"hf{dist.get_rank()}")
    arch, _ = read_hf_config(directory)
    tensors, modules = to_peft(adapters, arch, lora)
    folder = directory.parent / f"adapter{dist.get_rank()}"
    folder.mkdir(exist_ok=True)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS))
    (folder / ADAPTER_CONFIG).write_text(json.dumps(peft_config(arch, lora, modules, None)))
    tokens, labels, _ = _batch()
    mask = _mask()
    patches, _ = _patches(name)
    for patch in patches:
        patch.start()
    try:
        adapted = PeftModel.from_pretrained(hf, str(folder), is_trainable=True).double()
        logits = adapted(input_ids=tokens).logits
    finally:
        for patch in reversed(patches):
            patch.stop()
    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none"
    )
    ((per_token * mask.reshape(-1)).sum() / mask.sum()).backward()
    grads = dict(adapted.named_parameters())
    out = {}
    for ours in adapters:
        layer, part = ours.split(".adapter.")
        module = sources_module(arch, layer)
        which = "lora_A" if part.startswith("linear_in") else "lora_B"
        out[ours] = grads[f"base_model.model.{module}.{which}.default.weight"].grad
    return out


def sources_module(arch, layer_name: str) -> str:
    """transformers' module of our (single-segment) layer ``layer_name``."""
    (segment,) = parameter_sources(arch)[f"{layer_name}.weight"]
    return segment.key[: -len(".weight")]


@pytest.mark.world(2)
@pytest.mark.parametrize("name", ["v3", "v2_lite"])
@pytest.mark.parametrize(
    "layout", [Layout(tp=2, sp=True), Layout(cp=2)], ids=lambda layout: layout.id
)
def test_lora_on_mla_at_layout_matches_peft(name, layout, tmp_path):
    """Adapters on every MLA projection: each rank's adapter main_grad equals peft's float64
    gradient of transformers' model carrying the same (gathered) adapters."""
    from megatron.core.config_rules import LORA_MLA_TARGETS
    from megatron.core.transformer.lora import LoRAConfig, apply_lora

    shared = [str(tmp_path / "model")]
    dist.broadcast_object_list(shared, src=0)
    directory = pathlib.Path(shared[0])
    hf_reference(name, directory, mask=_mask())  # writes the model (rank 0)
    dist.barrier()
    lora = LoRAConfig(target_modules=LORA_MLA_TARGETS + ("linear_proj",), dim=2, alpha=4.0,
                      params_dtype=torch.float64, lora_B_init_method="normal")  # fmt: skip
    model, _ = _step(directory, layout, lambda gpt: apply_lora(gpt, lora))
    tp_group = model.tp_group
    adapters = {n: p for n, p in model.named_parameters() if ".adapter." in n}
    full = {n: _full(p, tp_group) for n, p in adapters.items()}
    reference = _peft_reference(name, directory, full, lora)
    failures = []
    for n, param in adapters.items():
        ranges = shard_ranges(param, tuple(full[n].shape), get_pg_size(tp_group),
                              get_pg_rank(tp_group))  # fmt: skip
        expected = _expected_shard(reference[n], ranges)
        err = ((param.main_grad - expected).abs().max() / expected.abs().max()).item()
        if not err <= 1e-10:
            failures.append(f"{n}: {err:.2e}")
    assert len(adapters) >= 8
    assert_no_failures(gather_failures(failures))
