"""``PackedSeqParams``: how several documents are packed into one sequence (megatron-core's
dataclass and field names).

``qkv_format="thd"``: the batch is one row of t tokens holding documents back to back;
``cu_seqlens_q/kv`` are their cumulative real lengths ([0, l_1, l_1 + l_2, ...], int32),
``cu_seqlens_q/kv_padded`` the cumulative lengths after padding each document (under context
parallelism to a multiple of 2C), ``max_seqlen_q/kv`` the longest document. Attention keeps
documents apart (``megatron.core.transformer.cp_attention``).
"""

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch import Tensor


@dataclass
class PackedSeqParams:
    """Parameters of the ``thd`` (packed) sequence format, as megatron-core 0.16.1 has them."""

    qkv_format: Optional[str] = None
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_kv: Optional[Tensor] = None
    cu_seqlens_q_padded: Optional[Tensor] = None
    cu_seqlens_kv_padded: Optional[Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    local_cp_size: Optional[int] = None
    cp_group: Optional[dist.ProcessGroup] = None
