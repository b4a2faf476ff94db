"""The attention kernel through the config, sliding-window attention, argument checks.

- ``default_kernel``: PyTorch's own SDPA priority as a pure function of (device type,
  capability, dtype, head dim, cuDNN version); on a GPU it is compared with
  ``torch._fused_sdp_choice`` itself (CUDA-only test).
- ``TransformerConfig.attention_backend`` (megatron-core's ``AttnBackend``) reaches the kernel:
  ``DotProductAttention`` passes it; ``MEGATRON_ATTENTION_KERNEL`` overrides it, logged.
- ``window_size``: exact against a float64 masked oracle at C = 1 (dense, GQA, packed) and with
  a2a at C = 2, 4; refused by name where it is not implemented.
- Mismatched dtypes or devices of Q, K, V are named.
"""

import logging
import re
from types import SimpleNamespace

import pytest
import torch

import megatron.core.transformer.cp_attention.kernels as fk
from megatron.core.context_parallel import cp_shard_positions, thd_partitioned_indices
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer import dot_product_attention as dpa
from megatron.core.transformer.cp_attention import (
    check_window_size,
    context_parallel_attention,
    kernel_choice,
)
from megatron.core.transformer.cp_attention.kernel_choice import default_kernel, resolve_kernel
from megatron.core.transformer.cp_attention.registry import STRATEGIES
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from tests.unit_tests.transformer.test_cp_attention import (
    DTYPE,
    TOLERANCE,
    device,
    make_inputs,
    max_relative_errors,
    packed_case,
    packed_params,
    reference,
    world,
)

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
NEW_CUDNN = 91600  # SDPA prefers cuDNN only above 9.15.0


# ----------------------------------------------------------------------------- kernel choice


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "device_type, capability, dtype, head_dim, cudnn, window, expected",
    [
        ("cpu", None, BF16, 64, None, False, "cpu"),
        ("cpu", None, FP64, 12, None, True, "cpu"),
        ("cuda", (9, 0), BF16, 128, NEW_CUDNN, False, "cudnn"),  # H100/H200
        ("cuda", (9, 0), FP16, 64, NEW_CUDNN, False, "cudnn"),
        ("cuda", (10, 0), BF16, 128, NEW_CUDNN, False, "cudnn"),  # B200
        ("cuda", (9, 0), BF16, 128, 91500, False, "flash"),  # cuDNN too old for SDPA's preference
        ("cuda", (9, 0), BF16, 128, None, False, "flash"),  # cuDNN off
        ("cuda", (9, 0), BF16, 256, NEW_CUDNN, False, "flash"),  # head dim > 128
        ("cuda", (8, 0), BF16, 128, NEW_CUDNN, False, "flash"),  # A100
        ("cuda", (8, 9), FP16, 128, NEW_CUDNN, False, "flash"),  # L40
        ("cuda", (12, 0), BF16, 128, NEW_CUDNN, False, "flash"),
        ("cuda", (7, 5), FP16, 64, NEW_CUDNN, False, "efficient"),  # T4: no flash
        ("cuda", (9, 0), FP32, 128, NEW_CUDNN, False, "efficient"),
        ("cuda", (9, 0), BF16, 12, NEW_CUDNN, False, "math"),  # head dim not a multiple of 8
        ("cuda", (9, 0), FP64, 64, NEW_CUDNN, False, "math"),
        ("cuda", (9, 0), BF16, 128, NEW_CUDNN, True, "flash"),  # cuDNN has no window here
        ("cuda", (9, 0), FP32, 128, NEW_CUDNN, True, "math"),
    ],
)
def test_default_kernel_follows_sdpa_priority(
    device_type, capability, dtype, head_dim, cudnn, window, expected
):
    """The default is the kernel PyTorch's SDPA tries first for such tensors."""
    got = default_kernel(device_type, capability, dtype, head_dim, cudnn, sliding_window=window)
    assert got == expected


@pytest.mark.world(1)
def test_default_kernel_needs_cuda_13_for_other_minor_versions():
    """With CUDA < 13, SDPA prefers cuDNN on sm9x/sm10x minor 0 or 3 only."""
    assert default_kernel("cuda", (10, 1), BF16, 128, NEW_CUDNN, cuda_major=12) == "flash"
    assert default_kernel("cuda", (10, 1), BF16, 128, NEW_CUDNN, cuda_major=13) == "cudnn"


@pytest.mark.world(1)
def test_window_kernels_are_the_specs_with_a_window():
    """kernel_choice's list of window kernels is what the kernel table implements."""
    kernels = kernel_choice.KERNELS
    with_window = {n for n in kernels if fk.kernel_spec(n).window_forward is not None}
    assert with_window == set(kernel_choice.WINDOW_KERNELS)


@pytest.mark.world(1)
def test_default_decided_once_and_logged_once(caplog, monkeypatch):
    """One log line per (device, dtype, head dim); the environment override is logged."""
    monkeypatch.delenv(kernel_choice.ENV_OVERRIDE, raising=False)
    kernel_choice._default_for.cache_clear()
    x = torch.zeros(4, 1, 2, 24)
    with caplog.at_level(logging.INFO, logger=kernel_choice.__name__):
        for _ in range(3):
            assert kernel_choice.resolve_kernel(None, x) == "cpu"
            assert kernel_choice.resolve_kernel("auto", x) == "cpu"
    lines = [r.getMessage() for r in caplog.records if "attention kernel for" in r.getMessage()]
    assert len(lines) == 1 and "head dim 24: cpu" in lines[0], lines
    caplog.clear()
    monkeypatch.setenv(kernel_choice.ENV_OVERRIDE, "math")
    with caplog.at_level(logging.INFO, logger=kernel_choice.__name__):
        for _ in range(3):
            assert kernel_choice.resolve_kernel("flash", x) == "math"
    lines = [r.getMessage() for r in caplog.records if "overrides" in r.getMessage()]
    assert len(lines) == 1 and "MEGATRON_ATTENTION_KERNEL=math" in lines[0], lines


@pytest.mark.world(1)
def test_default_kernel_choice_does_not_break_a_compiled_graph(monkeypatch):
    """Under ``torch.compile`` the first choice (logged) is taken as a constant: the attention
    traces as one graph (the logger call inside the choice used to split it)."""
    monkeypatch.delenv(kernel_choice.ENV_OVERRIDE, raising=False)
    kernel_choice._default_for.cache_clear()
    torch._dynamo.reset()
    q, k, v = (torch.randn(8, 1, 2, 16) for _ in range(3))
    explained = torch._dynamo.explain(lambda *t: context_parallel_attention(*t) * 2)(q, k, v)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]


@pytest.mark.world(1)
def test_attention_backend_names_the_kernel(monkeypatch):
    """Each AttnBackend maps to one kernel; DotProductAttention passes it explicitly; a bad
    value is refused by name."""
    assert {b.name: kernel_choice.kernel_for_backend(b) for b in AttnBackend} == {
        "flash": "flash",
        "fused": "cudnn",
        "unfused": "math",
        "local": "math",
        "auto": "auto",
    }
    with pytest.raises(ValueError, match="attention_backend must be .*got 'sdpa'"):
        TransformerConfig(
            num_layers=1, hidden_size=8, num_attention_heads=2, attention_backend="sdpa"
        )
    seen = []

    def spy(*args, **kwargs):  # attention_with_kernel(q, k, v, kernel options, ...)
        seen.append(dict(kwargs, kernel=args[3].name))
        return args[0]

    monkeypatch.setattr(dpa, "attention_with_kernel", spy)
    for backend, kernel in [("unfused", "math"), (AttnBackend.flash, "flash"), ("auto", "auto")]:
        attention = _attention(attention_backend=backend)
        q = torch.zeros(4, 1, 2, 4)
        attention(q, q, q, None)
        assert seen[-1]["kernel"] == kernel


def _attention(cp_comm_type=None, **config) -> dpa.DotProductAttention:
    settings = dict(num_layers=1, hidden_size=8, num_attention_heads=2, attention_dropout=0.0)
    settings.update(config)
    return dpa.DotProductAttention(
        TransformerConfig(**settings), 1, AttnMaskType.causal, "self", cp_comm_type=cp_comm_type
    )


# ----------------------------------------------------------------------------- sliding window


def window_reference(q, k, v, w, window, real=None, padded=None):
    """Float64 oracle output and gradients of <w, windowed attention(q, k, v)>."""
    from tests.unit_tests.transformer.attention_oracle import reference_attention

    q, k, v = (x.detach().double().cpu().requires_grad_(True) for x in (q, k, v))
    out = reference_attention(q, k, v, real, padded, window=window)
    grads = torch.autograd.grad((out * w.double().cpu()).sum(), (q, k, v))
    return [out.detach()] + list(grads)


def run_window(q, k, v, w, positions, comm, window_size, packed=None, kernel=None):
    local = [x[positions].to(device()).detach().clone().requires_grad_(True) for x in (q, k, v)]
    _, _, group = world()
    out = context_parallel_attention(
        *local, cp_group=group, cp_comm_type=comm, packed_seq_params=packed, kernel=kernel,
        window_size=window_size,
    )  # fmt: skip
    grads = torch.autograd.grad((out * w[positions].to(device())).sum(), local)
    return [out.detach()] + list(grads)


@pytest.mark.world(1)
@pytest.mark.parametrize("kernel", [None, "math"], ids=["default-cpu", "math"])
@pytest.mark.parametrize("window", [1, 3, 40])
@pytest.mark.parametrize("heads, groups", [(4, 4), (8, 4)], ids=["mha", "gqa2"])
def test_sliding_window_matches_masked_oracle(heads, groups, window, kernel):
    """window_size=(left, 0) at C = 1: output and Q/K/V gradients equal the float64 explicit
    masked attention (query i sees keys i - left .. i). Negative control: the same call without
    the window misses the oracle (except when the window covers the whole sequence)."""
    total = 24
    q, k, v, w = make_inputs(total, 2, heads, groups, 8, DTYPE, seed=7)
    expected = window_reference(q, k, v, w, window)
    every = torch.arange(total)
    actual = run_window(q, k, v, w, every, "all_gather", (window, 0), kernel=kernel)
    errors = max_relative_errors(actual, expected, every)
    assert max(errors.values()) <= TOLERANCE, errors
    ignored = run_window(q, k, v, w, every, "all_gather", None, kernel=kernel)
    control = max_relative_errors(ignored, expected, every)
    if window < total - 1:
        assert control["out"] > 1e-3, control
    else:
        assert max(control.values()) <= TOLERANCE, control


@pytest.mark.world(1)
@pytest.mark.parametrize("case", ["spanning", "edges", "tail"])
def test_sliding_window_packed_matches_masked_oracle(case):
    """Packed documents with a window: each document's queries see the last left + 1 keys of
    their own document only."""
    real, padded, total = packed_case(case, 1)
    q, k, v, w = make_inputs(total, 1, 4, 2, 8, DTYPE, seed=8)
    expected = window_reference(q, k, v, w, 2, real, padded)
    every = torch.arange(total)
    packed = packed_params(real, padded, device())
    actual = run_window(q, k, v, w, every, "all_gather", (2, 0), packed)
    errors = max_relative_errors(actual, expected, every)
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.world(1)
def test_window_limits():
    """window_size=(-1, 0) and (-1, -1): megatron-core's "infinite window", full causal;
    (0, 0): each query alone."""
    total = 16
    q, k, v, w = make_inputs(total, 1, 2, 2, 8, DTYPE, seed=9)
    expected = reference(q, k, v, w)
    every = torch.arange(total)
    for window_size in [(-1, 0), (-1, -1)]:
        actual = run_window(q, k, v, w, every, "all_gather", window_size)
        errors = max_relative_errors(actual, expected, every)
        assert max(errors.values()) <= TOLERANCE, (window_size, errors)
    # (0, 0): every query sees only its own key, so the output is V and dQ = dK = 0
    out, dq, dk, dv = run_window(q, k, v, w, every, "all_gather", (0, 0))
    assert torch.allclose(out, v.to(out.dtype), atol=1e-12) and torch.allclose(dv, w)
    assert dq.abs().max() <= 1e-12 and dk.abs().max() <= 1e-12


@pytest.mark.world(2, 4)
@pytest.mark.parametrize("case", ["dense", "spanning"])
def test_sliding_window_a2a_matches_masked_oracle(case):
    """a2a at C = 2, 4 attends the whole sequence for a share of the heads, so the window is
    exact there too (dense and packed)."""
    cp, rank, _ = world()
    if case == "dense":
        real = padded = None
        total = 8 * cp
        positions = cp_shard_positions(total, cp, rank)
    else:
        real, padded, total = packed_case(case, cp)
        positions = thd_partitioned_indices(padded, total, cp, rank)
    q, k, v, w = make_inputs(total, 1, 8, 4, 8, DTYPE, seed=10)
    expected = window_reference(q, k, v, w, 5, real, padded)
    packed = None if real is None else packed_params(real, padded, device())
    actual = run_window(q, k, v, w, positions, "a2a", (5, 0), packed)
    errors = max_relative_errors(actual, expected, positions)
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.world(2)
@pytest.mark.parametrize("comm", [c for c in STRATEGIES if not STRATEGIES[c].sliding_window])
def test_sliding_window_refused_where_not_implemented(comm):
    """The CP strategies without an exact window refuse it by name before any collective."""
    _, _, group = world()
    if comm == "a2a+p2p":
        from tests.unit_tests.transformer.test_cp_attention import hierarchical_groups

        group = hierarchical_groups(2)
    q = torch.zeros(8, 1, 2, 4, device=device())
    with pytest.raises(
        ValueError, match=r"window_size=\(4, 0\) .*" + re.escape(f"cp_comm_type={comm!r}")
    ):
        context_parallel_attention(q, q, q, cp_group=group, cp_comm_type=comm, window_size=(4, 0))


@pytest.mark.world(1)
def test_sliding_window_refused_at_build_time():
    """A layer that cannot compute the window refuses at build time, naming the settings:
    context parallelism with all_gather, and the cuDNN backend; bad values in the config."""
    with pytest.raises(ValueError, match=r"window_size=\(4, 0\) .*cp_comm_type='all_gather'"):
        _attention(window_size=(4, 0), context_parallel_size=2)
    with pytest.raises(ValueError, match=r"attention_backend='fused' .*no sliding window"):
        _attention(window_size=(4, 0), attention_backend="fused")
    assert check_window_size((4, 0), "a2a", 2) == 4  # implemented: accepted
    for bad in [(4, 1), (-2, 0), 4, (4,), (1.5, 0)]:
        with pytest.raises(ValueError, match="window_size must be None or"):
            TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, window_size=bad)


@pytest.mark.world(1)
def test_dot_product_attention_honours_window_size():
    """DotProductAttention with config.window_size equals the windowed oracle (the setting is
    not accepted and ignored)."""
    total = 16
    q, k, v, w = make_inputs(total, 1, 2, 2, 4, DTYPE, seed=11)
    attention = _attention(window_size=(2, 0))
    out = attention(q, k, v, None)
    expected = window_reference(q, k, v, w, 2)[0].reshape(total, 1, -1)
    assert torch.allclose(out.double(), expected, atol=1e-12)


# ----------------------------------------------------------------------------- arguments


@pytest.mark.world(1)
def test_mismatched_dtypes_and_devices_are_named():
    """A float32 query with float64 keys (or tensors on two devices) is a ValueError naming
    each argument's dtype (device), not a kernel error."""
    q = torch.zeros(8, 1, 2, 4, dtype=torch.float32)
    kv = torch.zeros(8, 1, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="query float32, key float64, value float64"):
        context_parallel_attention(q, kv, kv)
    with pytest.raises(ValueError, match="query float32, key float32, value float64"):
        context_parallel_attention(q, q, kv)
    ints = torch.zeros(8, 1, 2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="one floating-point dtype, got query int64"):
        context_parallel_attention(ints, ints, ints)
    meta = torch.zeros(8, 1, 2, 4, device="meta")
    with pytest.raises(ValueError, match="one device, got query cpu, key meta, value cpu"):
        context_parallel_attention(q, meta, q)


@pytest.mark.world(1)
@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_half_only_kernels_refuse_float32_by_name(kernel, monkeypatch):
    """An explicit flash or cuDNN kernel on float32 CUDA tensors is refused by name (cuDNN's
    op returned NaN losses for them on an H200, with no error); half precision passes. Only
    ``.device``, ``.dtype`` and ``.shape`` are read, so a stand-in works without a GPU."""
    monkeypatch.delenv("MEGATRON_ATTENTION_KERNEL", raising=False)
    cuda = torch.device("cuda", 0)
    like = SimpleNamespace(device=cuda, dtype=torch.float32, shape=(1, 1, 1, 64))
    with pytest.raises(ValueError, match=f"kernel '{kernel}'.*got float32"):
        resolve_kernel(kernel, like)
    assert resolve_kernel(kernel, SimpleNamespace(device=cuda, dtype=BF16, shape=(1, 64))) == kernel


# ----------------------------------------------------------------------------- CUDA


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the GPU runs of this file)"
)
CUDA_TOLERANCE = {BF16: 2e-2, FP16: 3e-3, FP32: 1e-5}


def _cuda_kernels():
    """Every (kernel, dtype) a default can pick on CUDA."""
    cases = [("flash", BF16), ("flash", FP16), ("cudnn", BF16), ("cudnn", FP16)]
    return cases + [("efficient", FP32), ("math", FP32)]


@needs_cuda
@pytest.mark.world(1)
@pytest.mark.parametrize("kernel, dtype", _cuda_kernels())
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_kernels_match_the_float64_oracle(kernel, dtype, head_dim):
    """Each CUDA kernel a default can choose, at C = 1 (GQA, fwd+bwd), within its dtype's
    rounding of the float64 oracle."""
    if kernel == "cudnn" and not torch.backends.cudnn.is_available():
        pytest.skip("cuDNN is not available in this torch build")
    total = 256
    q, k, v, w = make_inputs(total, 2, 8, 4, head_dim, dtype, seed=12)
    expected = reference(q, k, v, w)
    every = torch.arange(total)
    local = [x.cuda().requires_grad_(True) for x in (q, k, v)]
    out = context_parallel_attention(*local, kernel=kernel)
    grads = torch.autograd.grad((out * w.cuda()).sum(), local)
    errors = max_relative_errors([out.detach()] + list(grads), expected, every)
    assert max(errors.values()) <= CUDA_TOLERANCE[dtype], errors


@needs_cuda
@pytest.mark.world(1)
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_default_is_what_sdpa_picks(dtype, head_dim):
    """On this GPU the default kernel is the backend torch._fused_sdp_choice picks for causal
    attention of such tensors."""
    from torch.nn.attention import SDPBackend

    names = {
        int(SDPBackend.FLASH_ATTENTION.value): "flash",
        int(SDPBackend.EFFICIENT_ATTENTION.value): "efficient",
        int(SDPBackend.CUDNN_ATTENTION.value): "cudnn",
        int(SDPBackend.MATH.value): "math",
    }
    q = torch.randn(1, 8, 1024, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    sdpa = names[int(torch._fused_sdp_choice(q, q, q, is_causal=True))]
    ours = kernel_choice._default_for(q.device, dtype, head_dim)
    if sdpa == "cudnn" and head_dim > 128:  # newer cuDNN takes 256; we stop at 128
        assert ours == "flash"
    else:
        assert ours == sdpa


@needs_cuda
@pytest.mark.world(1)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_cuda_flash_sliding_window_matches_masked_oracle(packed):
    """bf16 flash with its own window (dense: flash-attn's op; packed: the varlen op) within
    bf16 rounding of the float64 windowed oracle."""
    if packed:
        real, padded, total = packed_case("spanning", 4)
        params = packed_params(real, padded, torch.device("cuda"))
    else:
        real = padded = params = None
        total = 256
    q, k, v, w = make_inputs(total, 1, 8, 4, 64, BF16, seed=13)
    expected = window_reference(q, k, v, w, 7, real, padded)
    every = torch.arange(total)
    local = [x.cuda().requires_grad_(True) for x in (q, k, v)]
    out = context_parallel_attention(
        *local, kernel="flash", window_size=(7, 0), packed_seq_params=params
    )
    grads = torch.autograd.grad((out * w.cuda()).sum(), local)
    errors = max_relative_errors([out.detach()] + list(grads), expected, every)
    assert max(errors.values()) <= CUDA_TOLERANCE[BF16], errors
