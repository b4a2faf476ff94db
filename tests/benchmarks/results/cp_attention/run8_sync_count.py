"""Host synchronizations of a packed multi-layer attention fwd+bwd on one GPU, with the
packed-plan cache (shipped) and without it (``cp_attention.plans.cached`` replaced by a plain
call). Run from the repository root:
``python tests/benchmarks/results/cp_attention/run8_sync_count.py``.
"""

import contextlib
import os
import sys
import warnings

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "benchmarks"))

import bench_cp_attention as bench  # noqa: E402

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.cp_attention import context_parallel_attention  # noqa: E402


def count(layers: int, uncached: bool) -> int:
    real, padded = bench.packed_documents(8192, 16, 1)
    host = [torch.tensor(x, dtype=torch.int32).pin_memory() for x in (real, padded)]
    q = torch.randn(8192, 1, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    switch = bench.plans_uncached() if uncached else contextlib.nullcontext()
    with switch, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        cu, cu_padded = (x.to("cuda", non_blocking=True) for x in host)
        packed = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded, max_seqlen_q=1024, max_seqlen_kv=1024,
        )  # fmt: skip
        x = q
        for _ in range(layers):
            x = context_parallel_attention(x, x, x, packed_seq_params=packed)
        x.float().sum().backward()
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


if __name__ == "__main__":
    for layers in (1, 4, 16):
        print(
            f"layers {layers}: syncs cached {count(layers, False)}, uncached {count(layers, True)}"
        )
