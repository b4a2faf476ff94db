"""Causal core attention over a context-parallel (CP) shard: the one entry point the model calls.

``context_parallel_attention`` takes this CP rank's load-balanced shard of Q, K and V (chunks r
and 2C-1-r of the sequence, see ``megatron.core.context_parallel``) and returns the attention
output for its queries, exactly as the unsharded sequence would give it: query at global
position i sees keys at global positions j <= i (and, for packed sequences, only keys of its
own document).

Attention runs on flash-class kernels (``kernels``: PyTorch's SDPA backends on GPUs, the CPU
flash op on CPUs); no score matrix is ever materialized. The ways to bring the keys to the
queries (``cp_comm_type``, megatron-core's names) are the strategies of ``registry``:
``"all_gather"`` (default; also for None; ``all_gather``), ``"p2p"`` (the load-balanced ring;
``ring``), ``"a2a"`` and ``"a2a+p2p"`` (heads all-to-all, and all-to-all within groups plus
a ring between them; ``all_to_all``).

Packed sequences (``PackedSeqParams``, THD) work in every mode: each document is split over
the ranks on its own, and each kernel call becomes one varlen call over all documents (a loop
over documents where the varlen op is missing or the dtype is not half precision).

Each mode is a ``torch.autograd.Function`` that calls the kernels' forward and backward ops
itself (the kernels' log-sum-exp is not differentiable). Only square blocks are causal, so
kernels whose causal mask is top-left aligned (cuDNN) need no split. In all_gather and p2p
every result is a sum of several calls' partials: bf16 inputs run on the fp16 kernels
through exact power-of-two factors (``rescale``) so that the partials keep 11 significant
bits and the float32 sum is rounded to bf16 once. Memory per rank: saved tensors are
the local Q, K, V, output and a float32 LSE, O(s/C); transient buffers hold K/V of one head
group for the whole sequence (all_gather) or of one peer (p2p).

Modules, top down: ``api`` (the entry point and its checks), ``registry`` and ``strategy``
(the strategies and what one is), ``all_gather``, ``ring``, ``all_to_all`` (one per
strategy), ``local`` (a whole sequence on one rank), ``blocks`` (kernel calls on plan parts,
merged by log-sum-exp), ``plans`` (how a sequence is cut into kernel calls, and their cache),
``rescale`` (bf16 through the fp16 kernels), ``sinks`` (attention sinks joined to the merged
output and LSE), ``collectives`` (every collective of the
package), ``kernel_choice`` (which kernel runs: config, PyTorch's default, environment
override), ``kernels`` (the attention kernels with their log-sum-exp).
"""

from megatron.core.transformer.cp_attention.api import (
    attention_with_kernel,
    check_window_size,
    context_parallel_attention,
)
from megatron.core.transformer.cp_attention.kernel_choice import (
    check_backend_window,
    kernel_for_backend,
)
from megatron.core.transformer.cp_attention.kernels import Kernel

__all__ = [
    "context_parallel_attention",
    "attention_with_kernel",
    "Kernel",
    "check_window_size",
    "check_backend_window",
    "kernel_for_backend",
]
