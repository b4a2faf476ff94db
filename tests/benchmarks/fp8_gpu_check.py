"""FP8 on a CUDA GPU (issue 41), the checks the CPU suite cannot make, in one launch:

    python tests/benchmarks/fp8_gpu_check.py [--iters 300] [--json out.json]

1. ``ColumnParallelLinear`` with ``fp8`` "hybrid" / "e4m3" in fp32 and bf16 at sizes that are
   not multiples of 16 (the padded ``torch._scaled_mm`` path): the output and both gradients
   against the products of the dequantized operands (relative errors printed; expect ~1e-3
   in bf16 outputs, ~1e-6 in fp32).
2. The compiled amax / cast / transpose kernels (``scaling.operands``' CUDA path) against the
   eager functions: bitwise equal, for bf16 and fp32 tensors, e4m3 and e5m2, with values past
   the format's range (the clamp) and a zero tensor.
3. The FP8 weight cache (``megatron.core.fp8.cache``, issue 41), with
   ``tests/unit_tests/fp8/test_weight_cache.py``'s model and steps: 3 SGD steps of 4
   microbatches of bf16 FP8 linears and FP8 GroupedMLP experts, the linears compiled
   (inductor, as ``--compile`` traces them), the experts eager and cached, bitwise equal to
   the eager uncached steps (gradients and weights): with the cache traced into the linears'
   graphs (``CACHE_WHEN_COMPILED``, the default: 2 graphs per linear, fill and reuse) and
   without it (1 graph per linear). Bitwise on the H200 in session 14.

The script exits non-zero naming the checks and runs that failed (after writing ``--json``).
4. The trainer's loss curves, ``--bf16`` against ``--bf16 --fp8-format hybrid --fp8-recipe
   tensorwise`` (a 4-layer, hidden-256 model on the generated SFT data, ``--iters``
   iterations): the relative difference of the last 20 losses' means (issue 41: within 1-2%),
   and 5 iterations each of FP8 with ``--compile`` and of an FP8 MoE model (GroupedMLP).
"""

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.unit_tests.fp8.fp8_reference import dequantized  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _fake_quant(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantized(t, dtype, precision=torch.float32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def check_linear() -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    for dtype in (torch.float32, torch.bfloat16):
        for fmt, grad_dtype in (("hybrid", E5M2), ("e4m3", E4M3)):
            config = TransformerConfig(
                num_layers=1, hidden_size=24, num_attention_heads=2, fp8=fmt,
                fp8_recipe="tensorwise", params_dtype=dtype, use_cpu_initialization=True,
            )  # fmt: skip
            layer = ColumnParallelLinear(
                24, 40, config=config, init_method=torch.nn.init.normal_, bias=True
            ).cuda()
            x = torch.randn(5, 3, 24, device="cuda", dtype=dtype, requires_grad=True)
            y, _ = layer(x)
            g = torch.randn_like(y)
            y.backward(g)
            xq, wq = _fake_quant(x.detach(), E4M3), _fake_quant(layer.weight.detach(), E4M3)
            gq = _fake_quant(g, grad_dtype).reshape(-1, 40)
            print(
                f"{dtype} {fmt}: y {_rel(y, xq @ wq.t() + layer.bias.float()):.1e}, "
                f"dx {_rel(x.grad.reshape(-1, 24), gq @ wq):.1e}, "
                f"dw {_rel(layer.weight.grad, gq.t() @ xq.reshape(-1, 24)):.1e}",
                flush=True,
            )


def check_fused_casts() -> None:
    from megatron.core.fp8 import scaling

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for fp8 in (E4M3, E5M2):
            for shape in ((8192, 2048), (1000, 24)):
                torch._dynamo.reset()  # each case compiled (not eager past the recompile limit)
                t = (torch.randn(shape, device="cuda") * 300).to(dtype)
                amax = scaling.local_amax(t)
                assert torch.equal(amax, t.abs().amax().float()), "amax differs"
                ref = scaling._cast(t, scaling.scale_from_amax(amax, fp8, 0), fp8)
                amaxes = torch.stack([amax / 4, amax * 3, torch.zeros_like(amax)])  # 1st clamps
                other = t[:7, :5].contiguous()
                args = ((t, t * 2, other), amaxes, fp8, 1, (0, 2), (ref,))
                want = scaling._operands(*args)
                for experts in (False, True):  # the dense linears' and the experts' graphs
                    got = scaling.operands(*args, experts=experts)
                    pairs = zip([*got[0], *got[1], got[2]], [*want[0], *want[1], want[2]])
                    for i, (a, b) in enumerate(pairs):
                        same = a.view(torch.uint8) == b.view(torch.uint8)
                        assert bool(same.all()), (
                            f"{dtype} {fp8} {shape} experts={experts}: output {i} differs in "
                            f"{int((~same).sum())} of {same.numel()} bytes"
                        )
    zero = torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16)
    assert float(scaling.local_amax(zero)) == 0.0
    print("# compiled FP8 casts: bitwise the eager ones", flush=True)


def _cache_against_uncached(traced: bool, graphs: int, device: str, backend: str) -> None:
    """The FP8 weight cache (``megatron.core.fp8.cache``) through the unit test's model and
    steps (``test_weight_cache.py``) in bf16 at sizes that are not multiples of 16, the
    linears compiled as the trainer's ``--compile`` traces them, the experts eager and cached,
    ``traced``: ``CACHE_WHEN_COMPILED`` (restored after): bitwise the eager uncached steps,
    ``graphs`` graphs for the 2 linears."""
    import pytest

    from megatron.core.fp8 import cache
    from tests.unit_tests.fp8.test_weight_cache import Shape, _compiled_against_uncached

    model = dict(device=device, dtype=torch.bfloat16, shape=Shape(48, 80, 40, (37, 0, 58)))
    model["bias"] = False  # an inductor-compiled bias-gradient sum may add in another order
    with pytest.MonkeyPatch.context() as patch:  # restores CACHE_WHEN_COMPILED
        patch.setattr(cache, "CACHE_WHEN_COMPILED", traced)
        count = _compiled_against_uncached(patch, 3, backend, **model)
    assert count == graphs, f"{count} graphs for 2 compiled FP8 linears, not {graphs}"
    name = "traced into the linears' graphs" if traced else "not traced"
    print(f"# FP8 weight cache {name}: bitwise the eager uncached steps", flush=True)


def check_cache_untraced(device: str = "cuda", backend: str = "inductor") -> None:
    """``CACHE_WHEN_COMPILED`` off: compiled linears cast their weights at every call (1
    graph each)."""
    _cache_against_uncached(False, 2, device, backend)


def check_cache_traced(device: str = "cuda", backend: str = "inductor") -> None:
    """``CACHE_WHEN_COMPILED`` (the default): 2 graphs per linear (fill, reuse)."""
    _cache_against_uncached(True, 4, device, backend)


def curves(iters: int) -> tuple:
    """({run: losses}, [the runs that failed])."""
    from megatron.training import TrainingConfig
    from megatron.training.training import pretrain

    base = dict(
        num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024,
        seq_length=256, global_batch_size=16, micro_batch_size=4, bf16=True, progress=False,
    )  # fmt: skip
    fp8 = dict(fp8_format="hybrid", fp8_recipe="tensorwise")
    runs = {
        "bf16": ({}, iters),
        "bf16+fp8": (fp8, iters),
        "bf16+fp8 --compile": (dict(fp8, compile=True), 5),
        "bf16+fp8 MoE": (
            dict(fp8, num_experts=4, disable_bias_linear=True, moe_grouped_gemm=True),
            5,
        ),
    }
    out, failed = {}, []
    for name, (extra, n) in runs.items():
        start = time.time()
        try:
            result = pretrain(TrainingConfig(train_iters=n, **base, **extra))
        except Exception:  # noqa: BLE001 - reported, the other runs go on
            traceback.print_exc()
            failed.append(name)
            continue
        out[name] = [r["loss"] for r in result.records]
        times = sorted(r["iteration_time_s"] for r in result.records)
        print(f"{name}: {time.time() - start:.0f} s, median iteration "
              f"{times[len(times) // 2] * 1e3:.1f} ms, losses {out[name][0]:.4f} -> "
              f"{out[name][-1]:.4f}", flush=True)  # fmt: skip
    if "bf16" in out and "bf16+fp8" in out:
        a, b = (sum(out[k][-20:]) / len(out[k][-20:]) for k in ("bf16", "bf16+fp8"))
        print(f"last-20 mean loss: bf16 {a:.4f}, fp8 {b:.4f}, relative {(b - a) / a:+.2%}")
    return out, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--json", default=None)
    parser.add_argument("--checks", nargs="*", default=None, help="these checks only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_gpu_check.py needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    failed = []
    checks = (check_linear, check_fused_casts, check_cache_untraced, check_cache_traced)
    for check in checks:
        if args.checks is not None and check.__name__ not in args.checks:
            continue
        try:
            check()
        except Exception:  # noqa: BLE001 - reported, the other checks still run
            traceback.print_exc()
            print(f"# {check.__name__}: FAILED (above)", flush=True)
            failed.append(check.__name__)
    losses, failed_runs = curves(args.iters) if args.iters else ({}, [])
    failed += [f"curves: {name}" for name in failed_runs]
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(losses, handle)
    if failed:
        raise SystemExit(f"fp8_gpu_check.py: {len(failed)} failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
