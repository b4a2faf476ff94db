"""Which attention kernel runs: the config's choice, PyTorch's own default, the env override.

``TransformerConfig.attention_backend`` (megatron-core's ``AttnBackend``) names a kernel family
(``kernel_for_backend``); ``"auto"`` (the default) asks ``default_kernel``: the kernel that
PyTorch's ``scaled_dot_product_attention`` would pick first for such tensors on this device,
decided once per (device, dtype, head dim) and logged once. The environment variable
``MEGATRON_ATTENTION_KERNEL`` overrides every choice, and says so once in the log.
"""

import functools
import logging
import os
from typing import Optional, Tuple

import torch

logger = logging.getLogger(__name__)

KERNELS = ("flash", "efficient", "cudnn", "cpu", "math")
"""Kernel names (``cp_attention.kernels``); ``"auto"`` (or None) means ``default_kernel``."""

ENV_OVERRIDE = "MEGATRON_ATTENTION_KERNEL"

# megatron-core's AttnBackend name -> our kernel: flash -> PyTorch's flash kernel (its CPU
# flash op on CPU tensors), fused (Transformer Engine's fused attention, cuDNN) -> cuDNN,
# unfused and local (megatron-core's own explicit-score attention) -> the explicit "math"
# kernel, auto -> PyTorch's own first choice.
_BACKEND_KERNELS = {
    "flash": "flash",
    "fused": "cudnn",
    "unfused": "math",
    "local": "math",
    "auto": "auto",
}

# the kernels with a sliding window (``kernels``' specs with ``window_forward``)
WINDOW_KERNELS = ("flash", "cpu", "math")

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HALF = (torch.float16, torch.bfloat16)


def kernel_for_backend(backend) -> str:
    """The kernel name for ``attention_backend`` (an ``AttnBackend`` or its name)."""
    name = getattr(backend, "name", backend)
    if name not in _BACKEND_KERNELS:
        raise ValueError(
            f"attention_backend must be one of {tuple(_BACKEND_KERNELS)} (megatron-core's "
            f"AttnBackend), got {backend!r}"
        )
    return _BACKEND_KERNELS[name]


def check_backend_window(backend, window_size) -> None:
    """Refuse, naming both settings, an ``attention_backend`` whose kernel has no sliding
    window when ``window_size`` limits it (at model build time)."""
    kernel = kernel_for_backend(backend)
    limited = window_size is not None and window_size[0] != -1
    if limited and kernel != "auto" and kernel not in WINDOW_KERNELS:
        raise ValueError(
            f"attention_backend={getattr(backend, 'name', backend)!r} (kernel {kernel!r}) has no "
            f"sliding window, but window_size={tuple(window_size)!r}; use attention_backend "
            "'auto', 'flash' or 'unfused'"
        )


def default_kernel(
    device_type: str,
    capability: Optional[Tuple[int, int]],
    dtype: torch.dtype,
    head_dim: int,
    cudnn_version: Optional[int] = None,
    cuda_major: int = 12,
    sliding_window: bool = False,
) -> str:
    """The kernel PyTorch's SDPA tries first for causal attention of such tensors.

    CPU (and any non-CUDA device): ``"cpu"`` (PyTorch's CPU flash op). CUDA, as
    ``torch/.../sdp_utils.cpp`` orders its backends: cuDNN first on sm90 / sm100-class GPUs
    (minor 0 or 3 with CUDA < 13) with a cuDNN newer than 9.15.0 (``cudnn_version`` None:
    not available or not enabled), for fp16/bf16 and head dims that are multiples of 8 up
    to 128; then flash (sm80 to sm121, fp16/bf16, head dim up to 256); then the
    memory-efficient kernel (fp32, or older GPUs); head dims that are not multiples of 8
    and other dtypes (float64) take the explicit ``"math"`` kernel. With a
    ``sliding_window`` (which SDPA itself has no argument for), the first of these that has
    one: flash, else ``"math"``; ``"cpu"`` on CPU.
    """
    if device_type != "cuda":
        return "cpu"
    if head_dim % 8 != 0 or dtype not in _FUSED_DTYPES:
        return "math"
    if dtype not in _HALF:
        return "math" if sliding_window else "efficient"
    major, minor = capability
    cudnn_first = (
        cudnn_version is not None
        and cudnn_version > 91500
        and major in (9, 10)
        and (cuda_major >= 13 or minor in (0, 3))
    )
    if cudnn_first and head_dim <= 128 and not sliding_window:
        return "cudnn"
    if (8, 0) <= (major, minor) <= (12, 1) and head_dim <= 256:
        return "flash"
    return "math" if sliding_window else "efficient"


def resolve_kernel(kernel: Optional[str], like: torch.Tensor, sliding_window: bool = False) -> str:
    """The kernel for tensors like ``like``: ``MEGATRON_ATTENTION_KERNEL`` when set (logged
    once), else ``kernel``; ``"auto"`` or None: ``default_kernel`` for this device, dtype and
    head dimension (and whether a sliding window is asked for; decided once, logged once)."""
    override = os.environ.get(ENV_OVERRIDE) or None
    name = kernel
    if override is not None:
        _log_override(override, kernel)
        name = override
    if name in (None, "auto"):
        return _default_for(like.device, like.dtype, like.shape[-1], sliding_window)
    if name == "math":
        return name
    if like.device.type != "cuda":
        if name not in ("cpu", "flash"):
            raise ValueError(
                f"attention kernel {name!r} (attention_backend / kernel= / {ENV_OVERRIDE}) "
                f"needs CUDA tensors, got {like.device}"
            )
        return "cpu"  # PyTorch's flash op for CPU tensors
    if name not in KERNELS or name == "cpu":
        raise ValueError(
            f"attention kernel must be one of {KERNELS[:3] + KERNELS[4:]} or 'auto' on CUDA, "
            f"got {name!r}"
        )
    if name in HALF_ONLY_KERNELS and like.dtype not in (torch.float16, torch.bfloat16):
        # cuDNN's op returns NaN for float32 inputs instead of refusing them.
        raise ValueError(
            f"attention kernel {name!r} (attention_backend / kernel= / {ENV_OVERRIDE}) takes "
            f"float16 or bfloat16 tensors, got {str(like.dtype).replace('torch.', '')}; use "
            f"'efficient' or 'math' for this dtype, or 'auto'"
        )
    return name


# The CUDA kernels that compute in half precision only.
HALF_ONLY_KERNELS = ("flash", "cudnn")


@functools.lru_cache(maxsize=None)
@torch.compiler.assume_constant_result  # traced code takes the answer, not the logging
def _default_for(
    device: torch.device, dtype: torch.dtype, head_dim: int, sliding_window: bool = False
) -> str:
    """``default_kernel`` for this very device (its capability, cuDNN and PyTorch's own
    SDPA switches), once per (device, dtype, head dim), logged."""
    capability, cudnn_version, cuda_major = None, None, 12
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        cudnn_version = _cudnn_version()
        cuda_major = int((torch.version.cuda or "12").split(".")[0])
    name = default_kernel(
        device.type, capability, dtype, head_dim, cudnn_version, cuda_major, sliding_window
    )
    if name == "flash" and not torch.backends.cuda.flash_sdp_enabled() and not sliding_window:
        name = "efficient"
    logger.info(
        "attention kernel for %s %s, head dim %d%s: %s (PyTorch SDPA's first choice; "
        "TransformerConfig.attention_backend or %s choose another)",
        device,
        str(dtype).replace("torch.", ""),
        head_dim,
        ", sliding window" if sliding_window else "",
        name,
        ENV_OVERRIDE,
    )
    return name


def _cudnn_version() -> Optional[int]:
    """The cuDNN version SDPA would use, or None where SDPA would not use cuDNN."""
    deprioritized = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "0") not in ("", "0")
    if deprioritized or not torch.backends.cuda.cudnn_sdp_enabled():
        return None
    if not torch.backends.cudnn.is_available():
        return None
    return torch.backends.cudnn.version()


_OVERRIDES_LOGGED = set()


def _log_override(override: str, kernel: Optional[str]) -> None:
    if (override, kernel) not in _OVERRIDES_LOGGED:
        _OVERRIDES_LOGGED.add((override, kernel))
        logger.warning(
            "%s=%s overrides the attention kernel %r", ENV_OVERRIDE, override, kernel or "auto"
        )
