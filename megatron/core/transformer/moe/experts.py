"""The routed experts of a MoE layer (megatron-core 0.16.1's ``SequentialMLP`` and
``GroupedMLP``: the same parameters and values, two ways to compute).

Expert i (global index g = ep_rank * E_local + i): y = (act(x W1_g^T) * p) W2_g^T, with
W1_g [F (2F gated), h] and W2_g [h, F] split over expert tensor parallelism like a
column- / row-parallel pair (the gated W1 with stride 2: a rank keeps its slices of both
halves). Each rank returns its partial sums; the token dispatcher sums them over expert TP.
With ``add_bias_linear`` (megatron-core's GPT-OSS experts; ``GroupedMLP``'s as ``bias1``
[E_local, F1 / ETP] and ``bias2`` [E_local, h]: fc1's bias split over expert TP with its rows,
fc2's whole and added once, by expert-TP rank 0)
y = p (act(x W1_g^T + b1_g) W2_g^T + b2_g); the gated unit is ``fused_bias_geglu.gated_unit``
(``glu_linear_offset``, ``activation_func_clamp_value``).
Expert parameters have ``allreduce = False`` (their gradients are reduced over the
expert-data-parallel group) and no communication inside.

``SequentialMLP``: ``local_experts.<i>.linear_fc1.weight`` / ``linear_fc2.weight``, one
matrix product per expert. ``GroupedMLP``: ``weight1`` [h, E_local F1] and ``weight2``
[E_local F, h], expert i's matrices being ``weight1.view(E_local, h, F1)[i]`` (= W1_g^T)
and ``weight2.view(E_local, F, h)[i]`` (= W2_g^T); on a CUDA device with bf16 weights one
grouped GEMM (``torch._grouped_mm``) per projection, else one product per expert.

Under ``torch.compile`` (the trainer's ``--compile``) the experts compile once whatever the
split of the tokens over the experts: see ``_eager_if_counts_on_host``.
"""

import functools
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.fp8.cache import cached_operands, init_weight_cache
from megatron.core.fp8.grouped import Fp8Experts, expert_weights_operands, fp8_grouped_linear
from megatron.core.fusions.fused_bias_geglu import gated_unit
from megatron.core.process_groups_config import ProcessGroupCollection, get_pg_rank, get_pg_size
from megatron.core.tensor_parallel.utils import strided_shard
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.grouped_gemm import ExpertRows, grouped_linear, use_grouped_mm
from megatron.core.transformer.moe.parallel import moe_groups_of
from megatron.core.transformer.transformer_config import TransformerConfig

FullWeight = Callable[[str, int, tuple], torch.Tensor]
"""(``"linear_fc1"`` | ``"linear_fc2"``, global expert index, full shape) -> the full
float32 weight of that expert (the model's seeded initialization)."""


def _eager_if_counts_on_host(forward: Callable) -> Callable:
    """The experts' ``forward(x, tokens_per_expert, probs)``, run outside ``torch.compile``'s
    graph (``torch.compiler.disable``) when it reads the token count of every expert on the
    host (``counts_on_host``: the per-expert loop, ``SequentialMLP``, the FP8 experts).

    Traced, those counts become Python ints that dynamo guards on: a new split of the tokens
    recompiled the forward (after a change the counts turn symbolic, but an expert with 0 or
    1 tokens is specialized again), until dynamo's recompile limit. The loop's GEMMs are
    one eager kernel per expert either way; only its activation loses fusion. The grouped
    GEMM (``torch._grouped_mm``, CUDA bf16, the fast path) takes the counts as a device
    tensor (``offs``): it stays in the graph, compiled once, its activation fused between
    the two GEMMs, with no host sync."""
    eager = torch.compiler.disable(forward)

    @functools.wraps(forward)
    def run(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        args = (permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        if self.counts_on_host(permuted_local_hidden_states):
            return eager(self, *args)
        return forward(self, *args)

    return run


class _ExpertLinear(torch.nn.Module):
    """One expert projection's shard: ``weight`` [out, in] (local), y = x weight^T; with
    ``bias`` (``add_bias_linear``) a ``bias`` [out] the caller adds (fc1's split over expert
    TP like its rows, fc2's whole: ``_fc2_bias``)."""

    def __init__(self, weight: torch.Tensor, partition_dim: int, stride: int, bias: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        _mark_expert(self.weight, partition_dim, stride)
        self.bias = None
        if bias:  # fc1's split like its rows; fc2's whole on every expert-TP rank
            self.bias = torch.nn.Parameter(weight.new_zeros(weight.shape[0]))
            _mark_expert(self.bias, 0, stride, split=partition_dim == 0)

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
        bias = config.add_bias_linear
        self.linear_fc1 = _ExpertLinear(
            torch.empty(fc1_out, config.hidden_size, dtype=dtype, device=device),
            partition_dim=0,
            stride=2 if config.gated_linear_unit else 1,
            bias=bias,
        )
        self.linear_fc2 = _ExpertLinear(
            torch.empty(config.hidden_size, ffn, dtype=dtype, device=device),
            partition_dim=1,
            stride=1,
            bias=bias,
        )
        self.config = config
        self.adds_fc2_bias = True  # expert-TP rank 0 (set by SequentialMLP)

    def forward(self, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """(act(x W1^T [+ b1]) * p) W2^T [+ p b2]: the routing weight scales the whole
        expert output, its fc2 bias included."""
        hidden = self.linear_fc1(tokens)
        if self.linear_fc1.bias is not None:
            hidden = hidden + self.linear_fc1.bias
        out = self.linear_fc2(_activate(self.config, hidden, probs))
        if self.linear_fc2.bias is not None:
            weight = probs.unsqueeze(-1).to(out.dtype)
            out = out + _fc2_bias(weight, self.linear_fc2.bias, self.adds_fc2_bias)
        return out


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
        if self.fp8_experts is not None:
            init_weight_cache(self)  # the FP8 weights kept across microbatches (fp8.cache)
        if config.add_bias_linear and self.fp8_experts is not None:
            raise NotImplementedError(
                f"add_bias_linear=True with fp8={config.fp8!r}: the FP8 expert GEMMs have no "
                "biases; set add_bias_linear=False or fp8=None"
            )

    @property
    def adds_fc2_bias(self) -> bool:
        """Whether this rank adds the fc2 biases to its partial sums: expert-TP rank 0 (the
        sum over expert TP has them once)."""
        return get_pg_rank(self.tp_group) == 0

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

    def counts_on_host(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` on rows ``x`` reads the tokens per expert on the host (then it
        runs eagerly under ``torch.compile``: ``_eager_if_counts_on_host``)."""
        return True

    def project(self, proj: str, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        """``proj`` of every local expert on its rows of ``x``: one product per expert."""
        weights = [self.local_expert_weight(i, proj).t() for i in range(self.num_local_experts)]
        return grouped_linear(x, weights, rows, grouped=False)

    @torch.compiler.disable  # the adapters take the counts on the host: _eager_if_counts_on_host
    def adapted_forward(self, x, tokens_per_expert, probs, adapters) -> Tuple[torch.Tensor, None]:
        """The forward with LoRA adapters ({proj: ``ExpertLoRAAdapter``}, ``moe.expert_lora``)
        added to the outputs of fc1 and fc2, each expert's rows through its own adapter."""
        return self.expert_forward(x, ExpertRows(tokens_per_expert, x.device), probs, adapters)

    def expert_forward(self, x, rows: ExpertRows, probs, adapters) -> Tuple[torch.Tensor, None]:
        """Every local expert on its rows of ``x``: fc1 (plus its adapter's term where
        ``adapters`` has one), the fc1 biases, the activation times the routing weights, fc2
        (plus its adapter's term), the fc2 biases (``add_bias_linear``) times the weights."""
        hidden = self.project("linear_fc1", x, rows)
        if "linear_fc1" in adapters:
            hidden = hidden + adapters["linear_fc1"](x, rows)
        hidden = _add_bias(hidden, self.stacked_bias("linear_fc1"), rows.counts)
        hidden = _activate(self.config, hidden, probs)
        out = self.project("linear_fc2", hidden, rows)
        if "linear_fc2" in adapters:
            out = out + adapters["linear_fc2"](hidden, rows)
        bias = self.stacked_bias("linear_fc2")
        return _add_bias(out, bias, rows.counts, probs, self.adds_fc2_bias), None

    def stacked_bias(self, proj: str) -> Optional[torch.Tensor]:
        """The local experts' ``proj`` biases [E_local, out] (None without biases)."""
        rows = [self.local_expert_bias(i, proj) for i in range(self.num_local_experts)]
        return None if not rows or rows[0] is None else torch.stack(rows)

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
                target.copy_(strided_shard(full, dim, stride, etp, get_pg_rank(self.tp_group)))


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
        for expert in self.local_experts:
            expert.adds_fc2_bias = self.adds_fc2_bias
            _mark_fc2_bias(expert.linear_fc2.bias, self.adds_fc2_bias)

    @_eager_if_counts_on_host
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

    def local_expert_bias(self, i: int, proj: str) -> Optional[torch.Tensor]:
        """Local expert ``i``'s ``proj`` bias [out] (None without ``add_bias_linear``)."""
        return getattr(self.local_experts[i], proj).bias

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
        self.bias1 = self.bias2 = None  # add_bias_linear: [E_local, F1 / ETP], [E_local, h]
        if config.add_bias_linear:
            self.bias1 = torch.nn.Parameter(
                torch.zeros(num_local_experts, self.fc1_out, dtype=dtype)
            )
            self.bias2 = torch.nn.Parameter(torch.zeros(num_local_experts, hidden, dtype=dtype))
            _mark_expert(self.bias1, 1, 2 if config.gated_linear_unit else 1)
            _mark_expert(self.bias2, 1, 1, split=False)
            _mark_fc2_bias(self.bias2, self.adds_fc2_bias)

    def expert_w1(self) -> torch.Tensor:
        """[E_local, h, F1]: expert i's W1^T shard."""
        return self.weight1.view(self.num_local_experts, self.config.hidden_size, self.fc1_out)

    def expert_w2(self) -> torch.Tensor:
        """[E_local, F, h]: expert i's W2^T shard."""
        return self.weight2.view(self.num_local_experts, self.ffn, self.config.hidden_size)

    def counts_on_host(self, x: torch.Tensor) -> bool:
        """All but the grouped GEMM path (no FP8, ``use_grouped_mm``)."""
        return self.fp8_experts is not None or not use_grouped_mm(x, self.weight1)

    @_eager_if_counts_on_host
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
        return self.expert_forward(x, ExpertRows(tokens_per_expert, x.device), permuted_probs, {})

    def project(self, proj: str, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        """``proj`` of every local expert on its rows: one grouped GEMM on CUDA for bf16
        (``use_grouped_mm``), else one product per expert."""
        stacked = self.expert_w1() if proj == "linear_fc1" else self.expert_w2()
        return grouped_linear(x, stacked, rows, use_grouped_mm(x, stacked))

    def stacked_bias(self, proj: str) -> Optional[torch.Tensor]:
        """``bias1`` / ``bias2`` (None without ``add_bias_linear``)."""
        return self.bias1 if proj == "linear_fc1" else self.bias2

    def local_expert_weight(self, i: int, proj: str) -> torch.Tensor:
        """Local expert ``i``'s ``proj`` weight [out, in]: a transposed view of its block of
        ``weight1`` / ``weight2``."""
        stacked = self.expert_w1() if proj == "linear_fc1" else self.expert_w2()
        return stacked[i].t()

    def local_expert_bias(self, i: int, proj: str) -> Optional[torch.Tensor]:
        """Local expert ``i``'s ``proj`` bias [out] (a view of ``bias1`` / ``bias2``; None
        without ``add_bias_linear``)."""
        stacked = self.stacked_bias(proj)
        return None if stacked is None else stacked[i]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The same checkpoint entries as ``SequentialMLP`` (see
        ``expert_sharded_state_dict``): checkpoints load across the two."""
        from megatron.core.transformer.moe.checkpointing import expert_sharded_state_dict

        return expert_sharded_state_dict(self, prefix, sharded_offsets, metadata)


def _activate(config: TransformerConfig, hidden: torch.Tensor, probs: torch.Tensor):
    """act(h) (gated: act(gate) * up) times each row's probability."""
    if config.gated_linear_unit:
        hidden = gated_unit(config, hidden)
    else:
        hidden = config.activation_func(hidden)
    return hidden * probs.unsqueeze(-1).to(hidden.dtype)


def _add_bias(out, bias, counts, probs=None, adds: bool = True) -> torch.Tensor:
    """``out`` (rows grouped by local expert, ``counts`` each) plus each row's expert's bias
    row (the fc2 bias with ``probs``: times the row's routing weight, added as ``_fc2_bias``
    with ``adds``); ``out`` itself without a bias."""
    if bias is None:
        return out
    rows = bias.repeat_interleave(counts, dim=0, output_size=out.shape[0]).to(out.dtype)
    if probs is not None:
        rows = _fc2_bias(probs.unsqueeze(-1).to(out.dtype), rows, adds)
    return out + rows


def _fc2_bias(weight: torch.Tensor, bias: torch.Tensor, adds: bool) -> torch.Tensor:
    """The fc2 bias term p b2 (``weight`` p, ``bias`` b2) where this rank ``adds`` it
    (expert-TP rank 0); elsewhere exactly 0 with b2's gradient only (t - t.detach(),
    t = p.detach() b2): the partial sums over expert TP have the bias once, p's gradient
    has its term once, and every rank's copy of b2 gets the whole gradient (the expert
    output's gradient is the same on each expert-TP rank)."""
    if adds:
        return weight * bias
    term = weight.detach() * bias
    return term - term.detach()


def _mark_fc2_bias(bias: Optional[torch.Tensor], adds: bool) -> None:
    """A fc2 bias is whole on every expert-TP rank: only the rank that adds it counts in the
    gradient statistics (``expert_tp_duplicate`` on the others)."""
    if bias is not None:
        bias.expert_tp_duplicate = not adds


def _fp8_experts(experts: _LocalExperts, x, sizes, probs, weights) -> Tuple[torch.Tensor, None]:
    """Both projections of every local expert in FP8; ``weights``: (W1_i, W2_i) [out, in]
    (their FP8 operands kept across microbatches, ``fp8.cache``)."""
    fc1, fc2, fp8 = [w for w, _ in weights], [w for _, w in weights], experts.fp8_experts

    def fill():
        return tuple(expert_weights_operands([fc1, fc2], fp8))  # one amax collective

    kept1, kept2 = cached_operands(experts, fc1 + fc2, fill) or (None, None)
    hidden = _activate(experts.config, fp8_grouped_linear(x, sizes, fc1, fp8, kept1), probs)
    return fp8_grouped_linear(hidden, sizes, fc2, fp8, kept2), None


def _mark_expert(
    param: torch.nn.Parameter, partition_dim: int, stride: int, split: bool = True
) -> None:
    """Expert-parameter attributes: split over expert TP along ``partition_dim`` (``split``;
    else whole on every expert-TP rank), reduced over expert DP (``allreduce = False``)."""
    param.tensor_model_parallel = split
    param.partition_dim = partition_dim
    param.partition_stride = stride
    param.allreduce = False
