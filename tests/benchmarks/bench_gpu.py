"""The CUDA path end to end on one GPU: a bf16 GPT training step through our schedule, DDP
and finalize_model_grads, against a bare PyTorch loop doing the same math, and the bf16
gradients against an fp32 reference.

    torchrun --standalone --nproc-per-node 1 tests/benchmarks/bench_gpu.py [--json out.json]

World size 1 with nccl (no pipeline or context parallelism: one GPU). The model is
``GPTModel`` with bf16 parameters (``params_dtype=torch.bfloat16``, ``bf16=True``), M
microbatches per step. Timed variants (blocks of steps, each block repeated twice, in the
order below; each step is bracketed by ``torch.cuda.synchronize``):

- ``bare``: ``loss.backward()`` per microbatch, bf16 ``param.grad`` accumulated by autograd,
  ``zero_grad(set_to_none=True)`` per step. The floor.
- ``bare + fp32 accumulation``: as ``bare``, with a post-accumulate-grad hook per parameter
  adding ``param.grad`` into an fp32 buffer (what megatron's ``main_grad`` does).
- ``ours, fp32 main_grad``: ``forward_backward_no_pipelining`` with DDP
  (``grad_reduce_in_fp32=True``, megatron's setting for bf16) and ``finalize_model_grads``.
- ``ours, bf16 main_grad``: the same with ``grad_reduce_in_fp32=False``.
- ``ours, fp32 main_grad, no count check``: the fp32 variant with the schedule's validation
  of ``num_tokens`` replaced by a no-op, to price it; ``..., eager count check``: with the
  validation as it was before counts on a GPU were checked at the end of the schedule (one
  host read, a device sync, per microbatch).
- ``ours, fp32 main_grad, gradient_accumulation_fusion``: the fp32 variant with
  ``gradient_accumulation_fusion`` (the linear layers' weight-gradient GEMMs accumulate
  into the fp32 ``main_grad`` directly; embeddings and norms go through the hook).

Peak memory is ``torch.cuda.max_memory_allocated`` over each variant's steps (parameters and
gradient buffers included). The gradient check runs one step of ``bare`` and of
``ours, fp32 main_grad`` and compares them with an fp32 reference: a float32 copy of the same
(bf16-valued) weights, TF32 off, the same objective (1/M) sum_m S_m / max(N_m, 1) accumulated
microbatch by microbatch. Tolerances (bf16 keeps 8 significant bits, so each rounding errs
by up to 2^-9 relative; activations are rounded at every layer, forward and backward):
relative L2 error of all gradients together <= 3e-2, of each parameter <= 5e-2, and no more
than 1.05 x the bare loop's error (the framework adds no error of its own). The first H200
run used a global bound of 2e-2, declared before measuring; both ours and the bare PyTorch
loop measured 2.1e-2 (same model, same bf16 arithmetic), so the bound was raised to 3e-2 and
the comparison with the bare loop added (docs/performance.md).
"""

import argparse
import copy
import dataclasses
import json
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from bench_common import (
    gpt_forward_step,
    init_distributed,
    machine,
    median,
    say,
    synchronize,
    table,
)

from megatron.core import parallel_state
from megatron.core.device import comm_device
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules, token_counts
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

GLOBAL_TOL, PARAM_TOL, VS_BARE = 3e-2, 5e-2, 1.05
FUSED = "ours, fp32 main_grad, gradient_accumulation_fusion"


def make_data(args, device) -> List[Dict[str, torch.Tensor]]:
    """M microbatches [b, s] with SFT-like masks (a random-length prompt is masked out)."""
    gen = torch.Generator().manual_seed(42)
    shape = (args.micro_batch, args.seq)
    data = []
    for _ in range(args.microbatches):
        prompt = torch.randint(args.seq // 8, args.seq // 2, (args.micro_batch, 1), generator=gen)
        batch = {
            "tokens": torch.randint(0, args.vocab, shape, generator=gen),
            "labels": torch.randint(0, args.vocab, shape, generator=gen),
            "loss_mask": (torch.arange(args.seq) >= prompt).float(),
            "positions": torch.arange(args.seq).expand(shape).contiguous(),
        }
        data.append({k: v.to(device) for k, v in batch.items()})
    return data


def bare_step(model, data) -> None:
    """The same objective in a plain loop: (1/M) sum_m S_m / max(N_m, 1)."""
    model.zero_grad(set_to_none=True)
    for batch in data:
        output = model(batch["tokens"], batch["positions"], labels=batch["labels"])
        mask = batch["loss_mask"]
        loss = (output * mask).sum() / mask.sum().clamp(min=1) / len(data)
        loss.backward()


class Fp32Accumulation:
    """Hooks that add each fresh bf16 ``param.grad`` into an fp32 buffer and free it."""

    def __init__(self, model) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        self.buffer = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
        self.views, offset = {}, 0
        for p in params:
            self.views[p] = self.buffer[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        self.handles = [p.register_post_accumulate_grad_hook(self._add) for p in params]

    def _add(self, param) -> None:
        self.views[param].add_(param.grad)
        param.grad = None

    def step(self, model, data) -> None:
        self.buffer.zero_()
        bare_step(model, data)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def eager_check(num_tokens) -> None:
    """The count validation before it was deferred on GPUs: one host read (a device sync)."""
    token_counts._check_value(num_tokens.item(), "")


class Ours:
    """Our DDP around ``model`` and one step of the no-pipelining schedule."""

    def __init__(
        self, model, config, groups, fp32: bool, check_counts="shipped", fusion=False
    ) -> None:
        set_fusion(model, fusion)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=fp32)
        self.ddp = DistributedDataParallel(config, ddp_config, model, pg_collection=groups)
        self.config, self.groups, self.check_counts = config, groups, check_counts
        config.no_sync_func = self.ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads

    def step(self, data) -> None:
        shipped_check = schedules._check_num_tokens
        if self.check_counts == "none":
            schedules._check_num_tokens = lambda num_tokens: None
        elif self.check_counts == "eager":
            schedules._check_num_tokens = eager_check
        try:
            self.ddp.zero_grad_buffer()
            get_forward_backward_func()(
                forward_step_func=gpt_forward_step,
                data_iterator=iter(data),
                model=self.ddp,
                num_microbatches=len(data),
                seq_length=data[0]["tokens"].shape[1],
                micro_batch_size=data[0]["tokens"].shape[0],
                pg_collection=self.groups,
            )
        finally:
            schedules._check_num_tokens = shipped_check

    def remove(self) -> None:
        """Detach our DDP's gradient hooks from the shared module (private ``_hooks``)."""
        for handle in self.ddp._hooks:
            handle.remove()
        for param in self.ddp.module.parameters():
            if hasattr(param, "main_grad"):
                del param.main_grad
        set_fusion(self.ddp.module, False)


def set_fusion(model: torch.nn.Module, on: bool) -> None:
    """Switch ``gradient_accumulation_fusion`` on every linear layer of ``model``."""
    for module in model.modules():
        if hasattr(module, "gradient_accumulation_fusion"):
            module.gradient_accumulation_fusion = on


def time_block(step: Callable[[], None], steps: int, warmup: int) -> List[float]:
    """Seconds of each of ``steps`` steps after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + steps):
        synchronize()
        start = time.perf_counter()
        step()
        synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def peak_gib(device) -> float:
    if device.type != "cuda":
        return float("nan")
    return torch.cuda.max_memory_allocated(device) / 2**30


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.double() - expected.double()).norm().item()
    return diff / max(expected.double().norm().item(), 1e-30)


def reference_grads(model_fp32, data) -> Dict[str, torch.Tensor]:
    """fp32 gradients (TF32 off) of the same objective, microbatch by microbatch."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        bare_step(model_fp32, data)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    grads = {n: p.grad.detach().clone() for n, p in model_fp32.named_parameters()}
    model_fp32.zero_grad(set_to_none=True)
    return grads


def compare(grads: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> dict:
    """Relative L2 errors: all parameters together, the worst one and the median one."""
    per_param = {n: rel_error(grads[n], reference[n]) for n in reference}
    num = sum((grads[n].double() - reference[n].double()).norm().item() ** 2 for n in reference)
    den = sum(reference[n].double().norm().item() ** 2 for n in reference)
    worst = max(per_param, key=per_param.get)
    return {
        "global": (num / den) ** 0.5,
        "max": per_param[worst],
        "max_param": worst,
        "median": median(list(per_param.values())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per block")
    parser.add_argument("--blocks", type=int, default=2, help="blocks per variant")
    parser.add_argument("--backend", default=None, help="default: nccl with CUDA, else gloo")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(0)
    init_distributed(backend)
    parallel_state.initialize_model_parallel()
    groups = ProcessGroupCollection.use_mpu_process_groups()
    device = comm_device()
    say(f"# bench_gpu: backend {backend}, world {dist.get_world_size()}, device {device}")
    say(f"# machine: {machine()}")
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16,
        bf16=True,
        pipeline_dtype=torch.bfloat16,
    )
    start = time.perf_counter()
    model = GPTModel(config, get_gpt_layer_local_spec(), args.vocab, args.seq, pg_collection=groups)
    # same bf16 values in fp32 storage; the groups are shared, not copied
    shared = [groups] + [getattr(groups, f.name) for f in dataclasses.fields(groups)]
    memo = {id(obj): obj for obj in shared if obj is not None}  # layers hold groups too
    reference_model = copy.deepcopy(model, memo=memo).float()
    params = sum(p.numel() for p in model.parameters())
    data = make_data(args, device)
    tokens = args.microbatches * args.micro_batch * args.seq
    embedding_params = (args.vocab + args.seq) * args.hidden  # lookups, not matmuls
    # executed matmul FLOPs: 6 per weight per token, and QK^T, PV over all s x s scores
    # (the masked attention computes the full square), forward and backward
    flops = 6 * (params - embedding_params) * tokens
    flops += 3 * 4 * args.layers * args.seq * args.hidden * tokens
    say(
        f"# GPT hidden={args.hidden} heads={args.heads} layers={args.layers} seq={args.seq} "
        f"micro batch={args.micro_batch} vocab={args.vocab}: {params / 1e9:.2f}B bf16 params; "
        f"M={args.microbatches} ({tokens} tokens/step, ~{flops / 1e12:.0f} TFLOP/step); "
        f"built in {time.perf_counter() - start:.0f}s"
    )

    fp32_acc = [None]
    ours = [None]

    def setup(name):
        if name == "bare + fp32 accumulation":
            fp32_acc[0] = Fp32Accumulation(model)
        elif name.startswith("ours"):
            check = "none" if "no count" in name else "eager" if "eager" in name else ""
            fusion = "fusion" in name
            ours[0] = Ours(model, config, groups, "fp32" in name, check or "shipped", fusion)

    def teardown(name):
        if fp32_acc[0] is not None:
            fp32_acc[0].remove()
            fp32_acc[0] = None
        if ours[0] is not None:
            ours[0].remove()
            ours[0] = None
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    steps = {
        "bare": lambda: bare_step(model, data),
        "bare + fp32 accumulation": lambda: fp32_acc[0].step(model, data),
        "ours, fp32 main_grad": lambda: ours[0].step(data),
        "ours, bf16 main_grad": lambda: ours[0].step(data),
        "ours, fp32 main_grad, no count check": lambda: ours[0].step(data),
        "ours, fp32 main_grad, eager count check": lambda: ours[0].step(data),
        FUSED: lambda: ours[0].step(data),
    }
    times = {name: [] for name in steps}
    peaks = {name: 0.0 for name in steps}
    for _ in range(args.blocks):
        for name, step in steps.items():
            setup(name)
            reset_peak(device)
            times[name] += time_block(step, args.steps, args.warmup)
            peaks[name] = max(peaks[name], peak_gib(device))
            teardown(name)

    floor = median(times["bare"])
    rows = []
    for name in steps:
        t = median(times[name])
        rows.append(
            [
                name,
                f"{t * 1e3:.1f}",
                f"{min(times[name]) * 1e3:.1f}-{max(times[name]) * 1e3:.1f}",
                f"{t / floor:.4f}",
                f"{flops / t / 1e12:.0f}",
                f"{peaks[name]:.1f}",
            ]
        )
    say(
        table(
            ["variant", "step ms (median)", "min-max", "vs bare", "TFLOP/s", "peak GiB"],
            rows,
        )
    )

    # Gradients: one step of bare and of ours (fp32 main_grad) against the fp32 reference.
    reference = reference_grads(reference_model, data)
    del reference_model
    bare_step(model, data)
    bare_grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    runner = Ours(model, config, groups, fp32=True)
    runner.step(data)
    ours_grads = {n: runner.ddp.module.get_parameter(n).main_grad for n in reference}
    checks = {"ours, fp32 main_grad": compare(ours_grads, reference)}
    runner.remove()
    runner = Ours(model, config, groups, fp32=True, fusion=True)
    runner.step(data)
    fused_grads = {n: runner.ddp.module.get_parameter(n).main_grad for n in reference}
    checks[FUSED] = compare(fused_grads, reference)
    checks["bare (bf16 param.grad)"] = compare(bare_grads, reference)
    say(
        table(
            ["gradients vs fp32 reference", "global rel L2", "max rel L2 (param)", "median"],
            [
                [
                    k,
                    f"{v['global']:.2e}",
                    f"{v['max']:.2e} ({v['max_param']})",
                    f"{v['median']:.2e}",
                ]
                for k, v in checks.items()
            ],
        )
    )
    bare = checks["bare (bf16 param.grad)"]
    ok = all(
        mine["global"] <= GLOBAL_TOL
        and mine["max"] <= PARAM_TOL
        and mine["global"] <= VS_BARE * bare["global"]
        for mine in (checks["ours, fp32 main_grad"], checks[FUSED])
    )
    say(
        f"GRADIENTS {'PASS' if ok else 'FAIL'} (tolerance: global <= {GLOBAL_TOL:g}, "
        f"each parameter <= {PARAM_TOL:g}, global <= {VS_BARE:g} x the bare loop's)"
    )
    overhead = median(times["ours, fp32 main_grad"]) / floor
    say(
        f"RESULT step_ratio_fp32_main_grad={overhead:.4f} "
        f"step_ratio_bf16_main_grad={median(times['ours, bf16 main_grad']) / floor:.4f} "
        f"step_ratio_fp32_fused={median(times[FUSED]) / floor:.4f}"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {
                    "args": vars(args),
                    "machine": machine(),
                    "times_s": times,
                    "peak_gib": peaks,
                    "grad_checks": checks,
                    "flops_per_step": flops,
                },
                handle,
                indent=1,
            )
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
