"""What megatron-core 0.16.1's local multi-latent attention needs to build without Transformer
Engine, and to run on the CPU: imported by ``bench_mla.py``'s megatron-core child and by
``tests/unit_tests/dist_checkpointing/scripts/mcore_deepseek_save.py``, each run by
megatron-core's interpreter with this repository's root NOT on ``sys.path`` (its ``megatron``
would be imported instead of megatron-core's); this folder is, and imports only torch and
megatron-core.

Without TE: its local ``DotProductAttention`` rejects the ``k_channels`` / ``v_channels`` that
``MLASelfAttention`` passes (``local_core_attention``: a subclass drops them; the core
attention reads the context width from ``kv_channels``, to be set to ``v_head_dim``);
``multi_latent_attention.HAVE_TE`` is True whenever TE's extension module imports, which it
does without TE (``TELinear`` a placeholder, ``isinstance`` fails: set from whether
``transformer_engine`` is installed); its router's gating reads ``moe_utils.te_general_gemm``,
defined only when TE imports (set to None: the plain matmul). Its checkpoint writer processes
call ``psutil`` for a debug line, which 0.16.1 does not declare: without it the writer raises
in a child process and ``dist_checkpointing.save`` hangs (the memory reading: 0).

On the CPU (``cpu``): its YaRN table and the router's and MTP's trackers are made on
``torch.cuda.current_device()`` (the CPU), ``torch.cuda.synchronize`` is a no-op, the CUDA
RNG tracker's fork (attention and MoE) a no-op (no dropout). Its default causal mask and its
alltoall dispatcher's streams need CUDA too: callers pass the mask and use the allgather
dispatcher.
"""

import contextlib
import importlib.util
from typing import List

import torch


class _NoRng:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


def apply_shims(cpu: bool) -> List[str]:
    """Patch megatron-core (module docstring); returns what was changed."""
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.moe import moe_utils

    done = []
    have_te = importlib.util.find_spec("transformer_engine") is not None
    if mla.HAVE_TE != have_te:
        mla.HAVE_TE = have_te
        done.append(f"multi_latent_attention.HAVE_TE -> {have_te}")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        done.append("moe_utils.te_general_gemm -> None")
    if not filesystem_async.HAVE_PSUTIL:
        filesystem_async._process_memory = lambda: 0
        done.append("checkpoint writer's process memory -> 0 (no psutil)")
    if cpu:
        torch.cuda.current_device = lambda: torch.device("cpu")
        torch.cuda.synchronize = lambda *args, **kwargs: None
        tensor_parallel.get_cuda_rng_tracker = _NoRng
        moe_utils.get_cuda_rng_tracker = _NoRng
        done += ["torch.cuda.current_device -> cpu", "CUDA rng fork -> no-op"]
    return done


def local_core_attention() -> type:
    """megatron-core's local ``DotProductAttention`` taking (and dropping) the ``k_channels``
    / ``v_channels`` that ``MLASelfAttention`` passes."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalCoreAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs) -> None:
            super().__init__(*args, **kwargs)

    return LocalCoreAttention
