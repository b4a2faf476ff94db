"""The routed experts of a MoE layer (megatron-core 0.16.1's ``SequentialMLP`` and
``GroupedMLP``: the same parameters and values, two ways to compute).

Expert i (global index g = ep_rank * E_local + i): y = (act(x W1_g^T) * p) W2_g^T, with
W1_g [F (2F gated), h] and W2_g [h, F] split over expert tensor parallelism like a
column- / row-parallel pair (the gated W1 with stride 2: a rank keeps its slices of both
halves). Each rank returns its partial sums; the token dispatcher sums them over expert TP.
Expert parameters have ``allreduce = False`` (their gradients are reduced over the
expert-data-parallel group) and no communication inside.

``SequentialMLP``: ``local_experts.<i>.linear_fc1.weight`` / ``linear_fc2.weight``, one
matrix product per expert. ``GroupedMLP``: ``weight1`` [h, E_local F1] and ``weight2``
[E_local F, h], expert i's matrices being ``weight1.view(E_local, h, F1)[i]`` (= W1_g^T)
and ``weight2.view(E_local, F, h)[i]`` (= W2_g^T); on a CUDA device with bf16 weights one
grouped GEMM (``torch._grouped_mm``) per projection, else one product per expert.
"""

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.fp8.grouped import Fp8Experts, fp8_grouped_linear
from megatron.core.process_groups_config import ProcessGroupCollection, get_pg_rank, get_pg_size
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.grouped_gemm import use_grouped_mm
from megatron.core.transformer.moe.parallel import moe_groups_of
from megatron.core.transformer.transformer_config import TransformerConfig

FullWeight = Callable[[str, int, tuple], torch.Tensor]
"""(``"linear_fc1"`` | ``"linear_fc2"``, global expert index, full shape) -> the full
float32 weight of that expert (the model's seeded initialization)."""


class _ExpertLinear(torch.nn.Module):
    """One expert projection's shard: ``weight`` [out, in] (local), y = x weight^T."""

    def __init__(self, weight: torch.Tensor, partition_dim: int, stride: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        _mark_expert(self.weight, partition_dim, stride)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """x W^T."""
        return F.linear(input, self.weight)


class ExpertMLP(torch.nn.Module):
    """One expert of ``SequentialMLP`` (``linear_fc1``, ``linear_fc2``)."""

    def __init__(self, config: TransformerConfig, etp: int) -> None:
        super().__init__()
        ffn = config.moe_ffn_hidden_size // etp
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        dtype, device = config.params_dtype, None
        self.linear_fc1 = _ExpertLinear(
            torch.empty(fc1_out, config.hidden_size, dtype=dtype, device=device),
            partition_dim=0,
            stride=2 if config.gated_linear_unit else 1,
        )
        self.linear_fc2 = _ExpertLinear(
            torch.empty(config.hidden_size, ffn, dtype=dtype, device=device),
            partition_dim=1,
            stride=1,
        )
        self.config = config

    def forward(self, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """(act(x W1^T) * p) W2^T."""
        return self.linear_fc2(_activate(self.config, self.linear_fc1(tokens), probs))


class _LocalExperts(MegatronModule):
    """What both expert modules hold: the MoE groups (``tp_group`` = expert TP, ``ep_group``)
    and ``num_local_experts``, local expert i being global expert ``first_expert + i`` with
    ``first_expert = ep_rank * num_local_experts``."""

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        pg_collection: Optional[ProcessGroupCollection],
    ) -> None:
        super().__init__(config)
        self.groups = moe_groups_of(pg_collection, config)
        self.num_local_experts = num_local_experts
        self.tp_group, self.ep_group = self.groups.expt_tp, self.groups.ep
        # FP8 GEMMs with ``config.fp8`` (``megatron.core.fp8.grouped``), else None
        self.fp8_experts = Fp8Experts.from_config(config, self.groups.tp_cp, self.first_expert)

    @property
    def first_expert(self) -> int:
        """The global index of local expert 0."""
        return get_pg_rank(self.ep_group) * self.num_local_experts

    def expert_split(self, proj: str) -> Tuple[int, int]:
        """(dim, stride) of ``proj``'s expert-TP split of a full [out, in] weight: fc1 by
        rows, both halves of [gate; up] when gated (stride 2); fc2 by columns."""
        if proj == "linear_fc1":
            return 0, 2 if self.config.gated_linear_unit else 1
        return 1, 1

    def local_expert_weight(self, i: int, proj: str) -> torch.Tensor:
        """Local expert ``i``'s ``proj`` ("linear_fc1" | "linear_fc2") weight shard [out, in]:
        the tensor or a view of it (writing it writes the parameter)."""
        raise NotImplementedError

    def project(self, proj: str, x: torch.Tensor, sizes: List[int]) -> torch.Tensor:
        """``proj`` of every local expert on its rows of ``x`` (``sizes[i]`` rows each)."""
        parts = [F.linear(xi, self.local_expert_weight(i, proj))
                 for i, xi in enumerate(torch.split(x, sizes))]  # fmt: skip
        return torch.cat(parts, dim=0)

    def adapted_forward(self, x, tokens_per_expert, probs, adapters) -> Tuple[torch.Tensor, None]:
        """The forward with LoRA adapters ({proj: ``ExpertLoRAAdapter``}, ``moe.expert_lora``)
        added to the outputs of fc1 and fc2, each expert's rows through its own adapter."""
        sizes = [int(n) for n in tokens_per_expert.tolist()]
        hidden = self.project("linear_fc1", x, sizes)
        if "linear_fc1" in adapters:
            hidden = hidden + adapters["linear_fc1"](x, sizes)
        hidden = _activate(self.config, hidden, probs)
        out = self.project("linear_fc2", hidden, sizes)
        if "linear_fc2" in adapters:
            out = out + adapters["linear_fc2"](hidden, sizes)
        return out, None

    @torch.no_grad()
    def initialize_experts(self, full_weight: FullWeight) -> None:
        """Fill every local expert with its expert-TP shard of its global expert's full
        weights (``full_weight``); the same values in ``SequentialMLP`` and ``GroupedMLP``."""
        etp = get_pg_size(self.tp_group)
        for i in range(self.num_local_experts):
            for proj in ("linear_fc1", "linear_fc2"):
                target = self.local_expert_weight(i, proj)
                dim, stride = self.expert_split(proj)
                shape = list(target.shape)
                shape[dim] *= etp
                full = full_weight(proj, self.first_expert + i, tuple(shape))
                target.copy_(_split(full, dim, stride, self.tp_group))


class SequentialMLP(_LocalExperts):
    """The local experts as a list of MLPs, run one after the other."""

    def __init__(
        self,
        num_local_experts,
        config: TransformerConfig,
        submodules=None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(num_local_experts, config, pg_collection)
        self.local_experts = torch.nn.ModuleList(
            ExpertMLP(config, get_pg_size(self.tp_group)) for _ in range(num_local_experts)
        )

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ):
        """Rows grouped by local expert (``tokens_per_expert`` rows each) -> (outputs, None)."""
        sizes = [int(n) for n in tokens_per_expert.tolist()]
        if self.fp8_experts is not None:
            weights = [(e.linear_fc1.weight, e.linear_fc2.weight) for e in self.local_experts]
            return _fp8_experts(self, permuted_local_hidden_states, sizes, permuted_probs, weights)
        tokens = torch.split(permuted_local_hidden_states, sizes)
        probs = torch.split(permuted_probs, sizes)
        outputs = [expert(x, p) for expert, x, p in zip(self.local_experts, tokens, probs)]
        if not outputs:
            return permuted_local_hidden_states, None
        return torch.cat(outputs, dim=0), None

    def local_expert_weight(self, i: int, proj: str) -> torch.Tensor:
        """Local expert ``i``'s ``proj`` parameter [out, in]."""
        return getattr(self.local_experts[i], proj).weight

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron-core's layout: ``{prefix}experts.linear_fc1.weight`` etc. with the global
        expert index on an axis after the layer axis (see ``expert_sharded_state_dict``)."""
        from megatron.core.transformer.moe.checkpointing import expert_sharded_state_dict

        return expert_sharded_state_dict(self, prefix, sharded_offsets, metadata)


class GroupedMLP(_LocalExperts):
    """The local experts as two stacked weights (see the module docstring)."""

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(num_local_experts, config, pg_collection)
        etp = get_pg_size(self.tp_group)
        self.ffn = config.moe_ffn_hidden_size // etp
        self.fc1_out = 2 * self.ffn if config.gated_linear_unit else self.ffn
        hidden, dtype = config.hidden_size, config.params_dtype
        self.weight1 = torch.nn.Parameter(
            torch.empty(hidden, num_local_experts * self.fc1_out, dtype=dtype)
        )
        self.weight2 = torch.nn.Parameter(
            torch.empty(num_local_experts * self.ffn, hidden, dtype=dtype)
        )
        _mark_expert(self.weight1, 1, 1)
        _mark_expert(self.weight2, 0, 1)

    def expert_w1(self) -> torch.Tensor:
        """[E_local, h, F1]: expert i's W1^T shard."""
        return self.weight1.view(self.num_local_experts, self.config.hidden_size, self.fc1_out)

    def expert_w2(self) -> torch.Tensor:
        """[E_local, F, h]: expert i's W2^T shard."""
        return self.weight2.view(self.num_local_experts, self.ffn, self.config.hidden_size)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ):
        """Rows grouped by local expert -> (outputs, None)."""
        x = permuted_local_hidden_states
        w1, w2 = self.expert_w1(), self.expert_w2()
        if self.fp8_experts is not None:
            sizes = [int(n) for n in tokens_per_expert.tolist()]
            weights = [(a.t(), b.t()) for a, b in zip(w1, w2)]
            return _fp8_experts(self, x, sizes, permuted_probs, weights)
        if use_grouped_mm(x, w1):
            offsets = torch.cumsum(tokens_per_expert.to(x.device), 0).to(torch.int32)
            hidden = torch._grouped_mm(x, w1, offs=offsets)
            hidden = _activate(self.config, hidden, permuted_probs)
            return torch._grouped_mm(hidden, w2, offs=offsets), None
        sizes = [int(n) for n in tokens_per_expert.tolist()]
        outputs = []
        for i, (xi, pi) in enumerate(
            zip(torch.split(x, sizes), torch.split(permuted_probs, sizes))
        ):
            outputs.append(_activate(self.config, xi @ w1[i], pi) @ w2[i])
        if not outputs:
            return x, None
        return torch.cat(outputs, dim=0), None

    def project(self, proj: str, x: torch.Tensor, sizes: List[int]) -> torch.Tensor:
        """``proj`` of every local expert on its rows: one grouped GEMM where ``forward``
        uses one, else one product per expert."""
        stacked = self.expert_w1() if proj == "linear_fc1" else self.expert_w2()
        if use_grouped_mm(x, stacked):
            offsets = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)
            return torch._grouped_mm(x, stacked, offs=offsets)
        return super().project(proj, x, sizes)

    def local_expert_weight(self, i: int, proj: str) -> torch.Tensor:
        """Local expert ``i``'s ``proj`` weight [out, in]: a transposed view of its block of
        ``weight1`` / ``weight2``."""
        stacked = self.expert_w1() if proj == "linear_fc1" else self.expert_w2()
        return stacked[i].t()

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The same checkpoint entries as ``SequentialMLP`` (see
        ``expert_sharded_state_dict``): checkpoints load across the two."""
        from megatron.core.transformer.moe.checkpointing import expert_sharded_state_dict

        return expert_sharded_state_dict(self, prefix, sharded_offsets, metadata)


def _activate(config: TransformerConfig, hidden: torch.Tensor, probs: torch.Tensor):
    """act(h) (gated: act(gate) * up) times each row's probability."""
    if config.gated_linear_unit:
        gate, up = hidden.chunk(2, dim=-1)
        hidden = config.activation_func(gate) * up
    else:
        hidden = config.activation_func(hidden)
    return hidden * probs.unsqueeze(-1).to(hidden.dtype)


def _fp8_experts(experts: _LocalExperts, x, sizes, probs, weights) -> Tuple[torch.Tensor, None]:
    """Both projections of every local expert in FP8; ``weights``: (W1_i, W2_i) [out, in]."""
    hidden = fp8_grouped_linear(x, sizes, [w for w, _ in weights], experts.fp8_experts)
    hidden = _activate(experts.config, hidden, probs)
    return fp8_grouped_linear(hidden, sizes, [w for _, w in weights], experts.fp8_experts), None


def _mark_expert(param: torch.nn.Parameter, partition_dim: int, stride: int) -> None:
    """Expert-parameter attributes: split over expert TP along ``partition_dim``, reduced
    over expert DP (``allreduce = False``)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride
    param.allreduce = False


def _split(full: torch.Tensor, dim: int, stride: int, group) -> torch.Tensor:
    """This expert-TP rank's shard: ``full`` cut along ``dim`` into size * stride blocks,
    blocks rank, rank + size, ... kept (the strided split of the dense layers)."""
    size, rank = get_pg_size(group), get_pg_rank(group)
    if size == 1:
        return full
    block = full.shape[dim] // (size * stride)
    return torch.cat(torch.split(full, block, dim=dim)[rank::size], dim=dim)
