"""The mixture-of-experts layer (megatron-core 0.16.1's ``MoELayer``): route, dispatch,
run the local experts, combine, add the shared expert.

    y(x) = sum_{j < k} p_j(x) FFN_{e_j(x)}(x)  [+ sigmoid(x . g) FFN_shared(x)]

with e_j(x) the token's j-th expert (top-k order) and p_j(x) its routing probability.
Dropless: every route is computed. Padding tokens (``padding_mask`` True) are routed and
computed like the others (their outputs are masked by the loss) and left out of the router
losses and token counts.
"""

from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core.process_groups_config import ProcessGroupCollection, get_pg_rank
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.dispatchers import DISPATCHERS
from megatron.core.transformer.moe.parallel import moe_groups_of
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class MoESubmodules:
    """Specs of the MoE layer's parts."""

    experts: Union[ModuleSpec, type] = None
    shared_experts: Union[ModuleSpec, type] = None
    router: type = TopKRouter


class BaseMoELayer(MegatronModule):
    """Groups, local experts and the router."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config)
        if config.num_moe_experts is None:
            raise ValueError("MoELayer: config.num_moe_experts must be set")
        self.pg_collection = pg_collection
        self.groups = moe_groups_of(pg_collection, config)
        self.ep_group = self.groups.ep
        ep_size = config.expert_model_parallel_size
        self.num_local_experts = config.num_moe_experts // ep_size
        first = get_pg_rank(self.ep_group) * self.num_local_experts
        self.local_expert_indices = [first + i for i in range(self.num_local_experts)]
        self.layer_number = layer_number
        self.router = None
        self.experts = None
        self.shared_experts = None
        self.token_dispatcher = None

    def set_layer_number(self, layer_number: int) -> None:
        """The global 1-based layer number (the router files its losses under it)."""
        self.layer_number = layer_number
        if self.router is not None:
            self.router.set_layer_number(layer_number)


class MoELayer(BaseMoELayer):
    """Router (``submodules.router``), token dispatcher (``moe_token_dispatcher_type``),
    experts (``submodules.experts``: ``SequentialMLP`` or ``GroupedMLP``) and the optional
    shared expert (``moe_shared_expert_intermediate_size``). Input and output [s, b, h]
    ([s/TP, b, h] under sequence parallelism); ``forward`` returns (output, None)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Optional[MoESubmodules] = None,
        layer_number: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config, layer_number, pg_collection)
        submodules = submodules if submodules is not None else MoESubmodules()
        if submodules.experts is None:
            raise ValueError("MoELayer: submodules.experts must name SequentialMLP or GroupedMLP")
        self.submodules = submodules
        self.router = build_module(submodules.router, config=config, pg_collection=pg_collection)
        self.router.defer_router_losses = True  # attached to the output (TopKRouter)
        if layer_number is not None:
            self.router.set_layer_number(layer_number)
        dispatcher = DISPATCHERS[config.moe_token_dispatcher_type]
        self.token_dispatcher = dispatcher(
            self.num_local_experts, self.local_expert_indices, config, pg_collection
        )
        self.experts = build_module(
            submodules.experts, self.num_local_experts, config, pg_collection=pg_collection
        )
        self.use_shared_expert = config.moe_shared_expert_intermediate_size is not None
        if self.use_shared_expert:
            if submodules.shared_experts is None:
                raise ValueError(
                    "MoELayer: config.moe_shared_expert_intermediate_size is set but the spec "
                    "has no shared_experts; build it with get_gpt_layer_local_spec(num_experts=)"
                )
            self.shared_experts = build_module(
                submodules.shared_experts,
                config=config,
                gate=config.moe_shared_expert_gate,
                pg_collection=pg_collection,
            )
            self.token_dispatcher.set_shared_experts(self.shared_experts)

    def route(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """(probs [T, E], routing map [T, E]); ``padding_mask`` [s, b]."""
        return self.router(hidden_states, padding_mask)

    def preprocess(self, hidden_states, probs, routing_map):
        """The dispatcher's preparation (tokens flattened, each token's top-k experts)."""
        return self.token_dispatcher.dispatch_preprocess(
            hidden_states, routing_map, probs, topk_indices=self.router.last_topk_indices
        )

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Send the routes to the ranks of their experts."""
        return self.token_dispatcher.token_dispatch(hidden_states, probs)

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Run the local experts on their routes: (outputs, None)."""
        tokens, tokens_per_expert, route_probs = self.token_dispatcher.dispatch_postprocess(
            hidden_states, probs
        )
        output, mlp_bias = self.experts(tokens, tokens_per_expert, route_probs)
        return self.token_dispatcher.combine_preprocess(output), mlp_bias

    def shared_experts_compute(self, hidden_states: torch.Tensor):
        """The shared expert's output (None without one)."""
        if not self.use_shared_expert:
            return None
        return self.shared_experts(hidden_states)

    def combine(self, output: torch.Tensor):
        """Bring the outputs back and add each token's slots in top-k order."""
        return self.token_dispatcher.token_combine(output)

    def postprocess(self, output: torch.Tensor, shared_expert_output: Optional[torch.Tensor]):
        """[s, b, h], plus the shared expert's output."""
        output = self.token_dispatcher.combine_postprocess(output)
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output

    def forward(
        self,
        hidden_states: torch.Tensor,
        intermediate_tensors=None,
        padding_mask: Optional[torch.Tensor] = None,
    ):
        """[s, b, h] -> (output [s, b, h], None). ``padding_mask`` [b, s] (True = padding),
        sharded like the hidden states."""
        if intermediate_tensors is not None:
            raise NotImplementedError("MoELayer: intermediate_tensors is not supported")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        probs, routing_map = self.route(hidden_states, padding_mask)
        if self.config.moe_apply_probs_on_input:
            top = probs.gather(1, self.router.last_topk_indices)
            scaled = hidden_states.reshape(-1, hidden_states.shape[-1]) * top.to(
                hidden_states.dtype
            )
            dispatched_input, probs = self.preprocess(
                scaled.view(hidden_states.shape), torch.ones_like(probs), routing_map
            )
        else:
            dispatched_input, probs = self.preprocess(hidden_states, probs, routing_map)
        dispatched_input, probs = self.dispatch(dispatched_input, probs)
        output, mlp_bias = self.routed_experts_compute(dispatched_input, probs)
        output = self.combine(output)
        output = self.postprocess(output, self.shared_experts_compute(hidden_states))
        return self.router.attach_deferred_losses(output), mlp_bias

    def backward_dw(self, routed_experts: bool = True, shared_experts: bool = False) -> None:
        """No deferred weight gradients (they are computed in the backward)."""
