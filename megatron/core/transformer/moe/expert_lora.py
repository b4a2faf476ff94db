"""LoRA adapters on the routed experts' ``linear_fc1`` / ``linear_fc2`` (one per expert).

Expert g's projection computes y = W_g x + (alpha / dim) B_g A_g x with its own A_g [dim, in]
and B_g [out, dim]: the form PEFT trains on a 3-D expert parameter (``target_parameters``:
one (A, B) pair per expert) and on per-expert ``nn.Linear`` modules. One adapter module holds
a projection's adapters of every local expert stacked, ``linear_in.weight`` [E_local, dim',
in'] and ``linear_out.weight`` [E_local, out', dim], and is applied to the rows of each
expert (the dispatcher's token grouping), so ``SequentialMLP`` and ``GroupedMLP`` share it.

Sharding follows the expert's expert-tensor-parallel split (ETP; the dense column/row LoRA's):
- fc1 (column-parallel, output split; the gated [gate; up] halves strided): A split on its
  rank dimension, its output all-gathered over ETP (backward: reduce-scatter, so each A shard
  gets the whole gradient); B split on the output like W1. ``dim`` must divide by ETP.
- fc2 (row-parallel, input split; each ETP rank returns a partial sum that the dispatcher
  sums): A split on the input, its output summed over ETP (backward summed too: each rank's
  B slice sees only its rows of the output); B split on the OUTPUT rows, each rank writing its
  rows of the partial sum (zeros elsewhere), so no parameter is replicated over ETP.
Adapters live with their expert over EP (global expert ``first_expert + i``) and, like every
expert parameter, are reduced over expert data parallelism (``allreduce = False``). Weights
are drawn in full per global expert from (seed, the expert's global name), so every layout
starts from the same adapters.
"""

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.process_groups_config import get_pg_rank, get_pg_size
from megatron.core.tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    all_reduce_with_summed_grad,
)
from megatron.core.tensor_parallel.utils import strided_shard
from megatron.core.transformer.lora_init import adapter_init_method, adapter_seed
from megatron.core.transformer.moe.grouped_gemm import ExpertRows, grouped_linear, use_grouped_mm

PROJECTIONS = ("linear_fc1", "linear_fc2")


class _Stacked(torch.nn.Module):
    """One stacked adapter weight [E_local, out, in] (``weight``)."""

    def __init__(self, weight: torch.Tensor, partition_dim: int, stride: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = partition_dim  # of the stacked tensor
        self.weight.partition_stride = stride
        self.weight.allreduce = False  # an expert parameter: reduced over expert DP


class ExpertLoRAAdapter(torch.nn.Module):
    """scale * B_e A_e x on the rows of each local expert e for one projection (module
    docstring). ``global_name``: ``decoder.layers.<L>.mlp.experts.<proj>``."""

    def __init__(self, experts, proj: str, lora, global_name: str, expert_name: Callable) -> None:
        super().__init__()
        self.global_name, self.proj = global_name, proj
        self.first_expert = experts.first_expert  # global index of local expert 0
        self.scale = lora.scale
        self.dropout, self.dropout_position = lora.dropout, lora.dropout_position
        self.group = experts.tp_group
        etp, rank = get_pg_size(self.group), get_pg_rank(self.group)
        if proj == "linear_fc1" and lora.dim % etp:
            raise ValueError(
                f"{lora.flags.get('dim', 'dim')} {lora.dim} is not divisible by the "
                f"expert-tensor-parallel size {etp} ({global_name}'s adapters split their rank "
                "dimension over ETP)"
            )
        local = experts.local_expert_weight(0, proj)  # [out', in'] of this rank
        dim_split, stride = experts.expert_split(proj)
        out_full = local.shape[0] * (etp if dim_split == 0 else 1)
        in_full = local.shape[1] * (etp if dim_split == 1 else 1)
        # (tensor, split dim of the full [out, in] matrix, stride) of A and B
        a_split, b_split = (0, (0, stride)) if proj == "linear_fc1" else (1, (0, 1))
        a_parts, b_parts = [], []
        for i in range(experts.num_local_experts):
            name = expert_name(experts.first_expert + i)
            generator = torch.Generator().manual_seed(adapter_seed(lora.seed, name))
            a = torch.empty(lora.dim, in_full, dtype=torch.float32)
            b = torch.empty(out_full, lora.dim, dtype=torch.float32)
            adapter_init_method(lora.lora_A_init_method, generator)(a)
            adapter_init_method(lora.lora_B_init_method, generator)(b)
            a_parts.append(strided_shard(a, a_split, 1, etp, rank))
            b_parts.append(strided_shard(b, b_split[0], b_split[1], etp, rank))
        kind = dict(device=local.device, dtype=lora.params_dtype)
        self.linear_in = _Stacked(torch.stack(a_parts).to(**kind), a_split + 1, 1)
        self.linear_out = _Stacked(torch.stack(b_parts).to(**kind), b_split[0] + 1, b_split[1])

    def forward(self, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        """The adapters' output for rows ``x`` grouped by local expert (``rows``),
        in ``x``'s dtype: [N, out'] (fc1: this rank's output columns; fc2: the full output,
        this rank's partial sum)."""
        a, b = self.linear_in.weight, self.linear_out.weight
        h = x.to(a.dtype)
        if self.dropout_position == "pre" and self.dropout > 0:
            h = F.dropout(h, p=self.dropout, training=self.training)
        h = grouped_linear(h, a.transpose(1, 2), rows, _grouped_mm_applies(h, a))
        etp = get_pg_size(self.group)
        if etp > 1:
            if self.proj == "linear_fc1":
                h = all_gather_last_dim_from_tensor_parallel_region(h, self.group)
            else:
                h = all_reduce_with_summed_grad(h, self.group)
        y = grouped_linear(h, b.transpose(1, 2), rows, _grouped_mm_applies(h, b)) * self.scale
        if self.dropout_position == "post" and self.dropout > 0:
            y = F.dropout(y, p=self.dropout, training=self.training)
        if self.proj == "linear_fc2" and etp > 1:  # this rank's rows of the output
            rows = y.shape[-1]
            first = get_pg_rank(self.group) * rows
            y = F.pad(y, (first, rows * etp - first - rows))
        return y.to(x.dtype)


class WithExpertAdapters:
    """The experts' forward with adapters on fc1 / fc2 (set as the experts module's
    ``forward``; ``base_forward`` is the unadapted one, as for the dense layers)."""

    def __init__(self, experts, base_forward: Callable, adapters: torch.nn.ModuleDict) -> None:
        self.experts = experts
        self.base_forward = base_forward
        self.adapters = adapters

    def __call__(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        return self.experts.adapted_forward(hidden, tokens_per_expert, probs, self.adapters)


def _grouped_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The experts' rule, and 16-byte aligned rows (an adapter's rank need not be)."""
    return use_grouped_mm(x, w) and all(n % 8 == 0 for n in w.shape[1:])


def expert_adapters_of(experts) -> Optional[torch.nn.ModuleDict]:
    """The experts module's adapters ({proj: ExpertLoRAAdapter}) or None."""
    adapters = getattr(experts, "adapter", None)
    return adapters if isinstance(adapters, torch.nn.ModuleDict) else None
