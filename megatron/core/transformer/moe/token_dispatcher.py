"""Token dispatchers: send each (token, expert) route to the rank holding the expert and
bring the expert outputs back (megatron-core 0.16.1's allgather and alltoall dispatchers,
on any backend: gloo through ``all_to_all_single`` with split sizes, no CUDA streams).

Routes: token t's j-th choice (top-k order) is route t k + j. The experts receive their
routes grouped by local expert, and within an expert in (source rank, token, j) order.
The combine puts every route's output in its slot [t, j] of a [T, k, h] buffer (zeros
elsewhere), reduces the buffer over the ranks that hold parts of it (expert-parallel ranks
hold other slots, expert-tensor-parallel ranks partial sums of the same slot), and adds a
token's slots in top-k order: deterministic, no atomic scatter-add, and (for
``expert_tensor_parallel_size`` 1) bitwise the same for every expert-parallel size.

Collectives (differentiable, each backward the adjoint): all-gather / reduce-scatter along
dim 0 and the all-to-all of ``tensor_parallel.mappings``.
"""

from typing import List, Optional, Tuple

import torch

from megatron.core import communication
from megatron.core.process_groups_config import ProcessGroupCollection, get_pg_size
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.moe.parallel import moe_groups_of
from megatron.core.transformer.moe.permutation import (
    count_per_expert,
    gather_routes,
    inverse_permutation,
    routes_into_slots,
    sum_slots_in_order,
)
from megatron.core.transformer.transformer_config import TransformerConfig


class MoETokenDispatcher:
    """Common state: the config, the groups and the top-k (local experts: the subclasses)."""

    def __init__(
        self, config: TransformerConfig, pg_collection: Optional[ProcessGroupCollection] = None
    ) -> None:
        self.config = config
        self.groups = moe_groups_of(pg_collection, config)
        self.ep_group, self.tp_group = self.groups.ep, self.groups.expt_tp
        self.tp_ep_group = self.groups.tp_ep
        self.ep_size = get_pg_size(self.ep_group)
        self.tp_size = get_pg_size(self.tp_group)
        self.topk = config.moe_router_topk
        self.shared_experts = None

    def set_shared_experts(self, shared_experts) -> None:
        """Remember the shared experts (megatron-core overlaps them; here they run apart)."""
        self.shared_experts = shared_experts

    def dispatch_preprocess(
        self,
        hidden_states: torch.Tensor,
        routing_map: torch.Tensor,
        probs: torch.Tensor,
        topk_indices: Optional[torch.Tensor] = None,
    ):
        """Flatten hidden states to [T, h]; keep each token's experts in top-k order
        (``topk_indices`` [T, k], an extra of this core; by default the routing map's
        experts in index order) and their probabilities [T, k]."""
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        if topk_indices is None:
            topk_indices = _indices_in_expert_order(routing_map, self.topk)
        self.topk_indices = topk_indices
        return hidden, probs.gather(1, topk_indices)

    def combine_preprocess(self, hidden_states):
        """Nothing to do before the exchange back."""
        return hidden_states

    def combine_postprocess(self, hidden_states):
        """[T, h] back to the input's [s, b, h]."""
        return hidden_states.view(self.hidden_shape)


class _LocalExpertsDispatcher(MoETokenDispatcher):
    """A dispatcher that knows this rank's experts (megatron-core's signature of both
    dispatchers): ``num_local_experts`` of the ``num_moe_experts``, global indices
    ``local_expert_indices``."""

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: List[int],
        config: TransformerConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config, pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts

    def _local_routes(self, experts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The routes (flat indices) to this rank's experts, grouped by local expert (a
        stable sort keeps token order), and the number per local expert (int64, CPU)."""
        flat = experts.reshape(-1)
        local = (flat >= self.local_expert_indices[0]) & (flat <= self.local_expert_indices[-1])
        routes = local.nonzero(as_tuple=True)[0]
        order = torch.sort(flat[routes], stable=True).indices
        routes = routes[order]
        counts = count_per_expert(
            flat[routes] - self.local_expert_indices[0], self.num_local_experts
        )
        return routes, counts.cpu()


class MoEAllGatherTokenDispatcher(_LocalExpertsDispatcher):
    """Every rank of the tp x ep group gets all the group's tokens (all-gather), runs the
    routes to its own experts, and the outputs are reduce-scattered back."""

    def token_dispatch(self, hidden_states, probs):
        """All-gather tokens, their top-k experts and probabilities over tp x ep."""
        group = self.tp_ep_group
        if get_pg_size(group) > 1:
            hidden_states = mappings.gather_from_sequence_parallel_region(
                hidden_states, True, group
            )
            probs = mappings.gather_from_sequence_parallel_region(probs, True, group)
            self.gathered_indices = communication.all_gather_along_first_dim(
                self.topk_indices, group
            )
        else:
            self.gathered_indices = self.topk_indices
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        """(routes' tokens grouped by local expert, tokens per local expert, their probs)."""
        self.routes, tokens_per_expert = self._local_routes(self.gathered_indices)
        self.num_gathered = hidden_states.shape[0]
        tokens = gather_routes(hidden_states, self.routes, self.topk)
        return tokens, tokens_per_expert, probs.reshape(-1).index_select(0, self.routes)

    def token_combine(self, hidden_states):
        """Outputs into their [t, j] slots, reduce-scattered over tp x ep, slots added in
        top-k order."""
        slots = routes_into_slots(hidden_states, self.routes, self.num_gathered, self.topk)
        if get_pg_size(self.tp_ep_group) > 1:
            slots = mappings.reduce_scatter_to_sequence_parallel_region(
                slots, group=self.tp_ep_group
            )
        return sum_slots_in_order(slots)


class MoEAlltoAllTokenDispatcher(_LocalExpertsDispatcher):
    """Tokens are all-gathered over expert TP, then each route is sent to the expert-
    parallel rank of its expert with one all-to-all (split sizes exchanged first); the way
    back is the reverse all-to-all and a reduce-scatter over expert TP."""

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        """All-gather over expert TP; sort routes by expert; all-to-all over EP."""
        hidden, probs, indices = permutated_local_input_tokens, permuted_probs, self.topk_indices
        if self.tp_size > 1:
            hidden = mappings.gather_from_sequence_parallel_region(hidden, True, self.tp_group)
            probs = mappings.gather_from_sequence_parallel_region(probs, True, self.tp_group)
            indices = communication.all_gather_along_first_dim(indices, self.tp_group)
        self.num_gathered = hidden.shape[0]
        flat = indices.reshape(-1)
        self.send_routes = torch.sort(flat, stable=True).indices
        per_expert = count_per_expert(flat, self.num_experts)
        if self.ep_size == 1:  # no split sizes to exchange: the counts stay on the device
            self.recv_counts = per_expert.view(1, self.num_local_experts)
        else:
            received = communication.all_to_all_single(per_expert, self.ep_group)
            per_rank = per_expert.view(self.ep_size, self.num_local_experts)
            self.input_splits = per_rank.sum(1).tolist()
            self.recv_counts = received.view(self.ep_size, self.num_local_experts).cpu()
            self.output_splits = self.recv_counts.sum(1).tolist()
        tokens = gather_routes(hidden, self.send_routes, self.topk)
        route_probs = probs.reshape(-1).index_select(0, self.send_routes)
        if self.ep_size > 1:
            tokens = mappings.all_to_all(
                self.ep_group, tokens, self.output_splits, self.input_splits
            )
            route_probs = mappings.all_to_all(
                self.ep_group, route_probs, self.output_splits, self.input_splits
            )
        return tokens, route_probs

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        """Received (source rank, local expert) chunks reordered to (local expert, source
        rank) (already so from one source)."""
        tokens_per_expert = self.recv_counts.sum(0)
        self.order = None
        if self.ep_size == 1:
            return global_input_tokens, tokens_per_expert, global_probs
        self.order = _chunk_order(self.recv_counts).to(global_input_tokens.device)
        return (
            global_input_tokens.index_select(0, self.order),
            tokens_per_expert,
            global_probs.index_select(0, self.order),
        )

    def token_combine(self, hidden_states, async_finish: bool = True, allocate_on_comm_stream=True):
        """Undo the reorder, all-to-all back, slots reduce-scattered over expert TP and
        added in top-k order."""
        outputs = hidden_states
        if self.order is not None:
            outputs = hidden_states.index_select(0, inverse_permutation(self.order))
        if self.ep_size > 1:
            outputs = mappings.all_to_all(
                self.ep_group, outputs, self.input_splits, self.output_splits
            )
        slots = routes_into_slots(outputs, self.send_routes, self.num_gathered, self.topk)
        if self.tp_size > 1:
            slots = mappings.reduce_scatter_to_sequence_parallel_region(slots, group=self.tp_group)
        return sum_slots_in_order(slots)


def _chunk_order(counts: torch.Tensor) -> torch.Tensor:
    """Row permutation taking chunks laid out (source, expert) to (expert, source), rows
    within a chunk kept in order, for ``counts`` [sources, experts]."""
    sources, experts = counts.shape
    chunk = torch.repeat_interleave(torch.arange(sources * experts), counts.reshape(-1))
    return torch.sort((chunk % experts) * sources + chunk // experts, stable=True).indices


def _indices_in_expert_order(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """Each token's ``topk`` routed experts in index order [T, k]."""
    order = torch.arange(routing_map.shape[1], device=routing_map.device)
    keyed = torch.where(routing_map, order, order + routing_map.shape[1])
    return keyed.sort(dim=1).values[:, :topk] % routing_map.shape[1]
