"""megatron-core 0.16.1's ``moe_utils`` names, each defined in the module of its concept:

- ``routing``: top-k routing of the router (``topk_routing``,
  ``topk_routing_with_score_function``, ``group_limited_topk``,
  ``compute_routing_scores_for_aux_loss``, ``get_updated_expert_bias``);
- ``router_losses``: the token counts of a micro-batch and the losses defined over them
  (``micro_batch_token_counts``, ``switch_load_balancing_loss_func``, ``z_loss_func``,
  ``router_loss_token_weight``, ``MoEAuxLossAutoScaler``);
- ``permutation``: the dispatchers' token permutation (``permute``, ``unpermute``, the
  ordered slot sums, ``count_per_expert``);
- ``aux_loss_tracker``: the process-wide tracker of the router losses and its reduction;
- ``parallel``: the layer's groups (``get_default_pg_collection``).

The router calls the routing and loss functions through this module (``moe_utils.X``), so
patching a name here reaches the router.
"""

from megatron.core.transformer.moe.aux_loss_tracker import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    reduce_aux_losses_tracker_across_ranks,
    reduced_moe_metrics,
    reset_aux_losses_tracker,
    save_to_aux_losses_tracker,
    save_tokens_per_expert,
    track_moe_metrics,
)
from megatron.core.transformer.moe.parallel import get_default_pg_collection
from megatron.core.transformer.moe.permutation import (
    count_per_expert,
    gather_routes,
    inverse_permutation,
    permute,
    routes_into_slots,
    sum_slots_in_order,
    unpermute,
)
from megatron.core.transformer.moe.router_losses import (
    MoEAuxLossAutoScaler,
    TokenCounts,
    micro_batch_token_counts,
    router_loss_token_weight,
    switch_load_balancing_loss_func,
    z_loss_func,
)
from megatron.core.transformer.moe.routing import (
    compute_routing_scores_for_aux_loss,
    get_updated_expert_bias,
    group_limited_topk,
    topk_routing,
    topk_routing_with_score_function,
)

__all__ = [
    "MoEAuxLossAutoScaler",
    "TokenCounts",
    "clear_aux_losses_tracker",
    "compute_routing_scores_for_aux_loss",
    "count_per_expert",
    "gather_routes",
    "get_default_pg_collection",
    "get_moe_layer_wise_logging_tracker",
    "get_updated_expert_bias",
    "group_limited_topk",
    "inverse_permutation",
    "micro_batch_token_counts",
    "permute",
    "reduce_aux_losses_tracker_across_ranks",
    "reduced_moe_metrics",
    "reset_aux_losses_tracker",
    "router_loss_token_weight",
    "routes_into_slots",
    "save_to_aux_losses_tracker",
    "save_tokens_per_expert",
    "sum_slots_in_order",
    "switch_load_balancing_loss_func",
    "topk_routing",
    "topk_routing_with_score_function",
    "track_moe_metrics",
    "unpermute",
    "z_loss_func",
]
