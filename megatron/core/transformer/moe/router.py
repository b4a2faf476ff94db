"""The MoE router: logits = x W^T (W [E, h]), top-k routing, and the router losses attached
to the routing probabilities (megatron-core 0.16.1's ``TopKRouter``)."""

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core import communication
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.parallel import moe_groups_of
from megatron.core.transformer.transformer_config import TransformerConfig

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class Router(MegatronModule):
    """The gating weight [E, h] and, with ``add_bias_linear``, bias [E] (replicated over TP;
    under sequence parallelism marked ``sequence_parallel`` by the model, so their gradients
    are summed over TP).
    ``defer_router_losses`` (set by ``MoELayer``): hold the router losses back for
    ``attach_deferred_losses``."""

    defer_router_losses = False

    def __init__(
        self, config: TransformerConfig, pg_collection: Optional[ProcessGroupCollection] = None
    ) -> None:
        super().__init__(config)
        self.config = config
        self.num_experts = config.num_moe_experts
        self.groups = moe_groups_of(pg_collection, config)
        self.layer_number: Optional[int] = None
        self.weight = torch.nn.Parameter(
            torch.empty(self.num_experts, config.hidden_size, dtype=config.params_dtype)
        )
        # megatron-core: a router bias [E] with add_bias_linear (GPT-OSS), zero-initialized
        self.bias = None
        if config.add_bias_linear:
            self.bias = torch.nn.Parameter(torch.zeros(self.num_experts, dtype=config.params_dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``config.init_method`` on the weight (the GPT re-draws it from (seed, name))."""
        if self.config.perform_initialization:
            with torch.no_grad():
                self.config.init_method(self.weight)

    def set_layer_number(self, layer_number: int) -> None:
        """The global (1-based) layer number the tracker files this router's losses under."""
        self.layer_number = layer_number

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """Logits [..., E] = x W^T (+ b), in ``moe_router_dtype`` (default: the input's
        dtype)."""
        dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype), bias)

    def routing(self, logits: torch.Tensor):
        """Route logits (the subclass's rule)."""
        raise NotImplementedError

    def forward(self, input: torch.Tensor):
        """Route the input (the subclass's rule)."""
        raise NotImplementedError

    def attach_deferred_losses(self, output: torch.Tensor) -> torch.Tensor:
        """The MoE layer's output with any losses the router held back (none here)."""
        return output


class TopKRouter(Router):
    """Top-k routing with softmax (after or before selection) or sigmoid scores, expert
    bias (aux-loss-free balancing), group-limited selection and a scaling factor
    (``moe_utils.topk_routing``); the load-balancing losses ("aux_loss", "seq_aux_loss")
    and the z-loss of ``moe_utils``, each defined over the whole micro-batch and attached
    to the probabilities through ``MoEAuxLossAutoScaler``. A ``MoELayer`` sets
    ``defer_router_losses``: the losses (and counts) are then made by
    ``attach_deferred_losses`` on the layer's output, after the experts' work is queued,
    so on a GPU their many small host-side ops overlap the expert GEMMs instead of delaying
    them; the losses and every gradient are the same.

    Router losses and counts are computed when training with autograd on (a recomputed
    forward counts once). ``last_topk_indices`` [T, k]: the experts of the last forward in
    top-k order (the MoE layer combines a token's k outputs in this order).
    """

    def __init__(
        self, config: TransformerConfig, pg_collection: Optional[ProcessGroupCollection] = None
    ) -> None:
        super().__init__(config, pg_collection)
        self.topk = config.moe_router_topk
        self.score_function = config.moe_router_score_function
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        self.last_topk_indices: Optional[torch.Tensor] = None
        self._deferred: Optional[tuple] = None
        self._batch = 1
        if self.enable_expert_bias:
            bias_dtype = torch.promote_types(torch.float32, config.params_dtype)
            self.register_buffer(
                "local_tokens_per_expert",
                torch.zeros(self.num_experts, dtype=torch.int64),
                persistent=False,
            )
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=bias_dtype))
        else:
            self.local_tokens_per_expert = None
            self.expert_bias = None

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (``.to``, ``.cuda``, ``.bfloat16``, Float16Module's cast), the
        expert bias kept in its own dtype (float32, float64 in a float64 model) on the new
        device: megatron-core keeps it in float32 whatever the model's dtype (its router
        casts it back before each forward, load and save); in bf16 a bias past 0.25 would
        round an update of 1e-3 away."""
        bias = self.expert_bias
        module = super()._apply(fn, recurse)
        moved = self.expert_bias
        if bias is not None and moved.dtype != bias.dtype:
            self._buffers["expert_bias"] = bias.to(moved.device)
        return module

    def is_aux_loss_enabled(self) -> bool:
        """Whether any load-balancing loss has a nonzero coefficient."""
        return any(self.get_aux_loss_coeff(kind) for kind in ("aux_loss", "seq_aux_loss"))

    def get_aux_loss_coeff(self, aux_loss_type: str) -> float:
        """The coefficient of ``aux_loss_type`` (0 when that type is not configured)."""
        kinds = self.config.moe_router_load_balancing_type
        coeffs = self.config.moe_aux_loss_coeff
        if isinstance(kinds, (list, tuple)):
            return sum(c for k, c in zip(kinds, coeffs) if k == aux_loss_type)
        return coeffs if kinds == aux_loss_type else 0.0

    def forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """(probs [T, E], routing map [T, E]) for input [s, b, h] (T = s b, s-major).

        ``padding_mask`` [s, b] (True = padding) must hold exactly this rank's tokens."""
        if padding_mask is not None and padding_mask.numel() != input.shape[0] * input.shape[1]:
            raise ValueError(
                f"TopKRouter: padding_mask has {padding_mask.numel()} entries (shape "
                f"{tuple(padding_mask.shape)}) but this rank holds {input.shape[0]} x "
                f"{input.shape[1]} tokens (hidden states {tuple(input.shape)}); the mask must be "
                "sharded like the hidden states (sequence and context parallel)"
            )
        self._batch = input.shape[1]
        logits = self.gating(input).reshape(-1, self.num_experts)
        return self.routing(logits, padding_mask)

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """Route logits [T, E]; when training, attach the router losses to the probs."""
        pad = None if padding_mask is None else padding_mask.reshape(-1).bool()
        valid = None if pad is None else ~pad
        probs, routing_map, indices = moe_utils.topk_routing(
            logits,
            self.topk,
            use_pre_softmax=self.config.moe_router_pre_softmax,
            num_groups=self.config.moe_router_num_groups,
            group_topk=self.config.moe_router_group_topk,
            scaling_factor=self.config.moe_router_topk_scaling_factor,
            score_function=self.score_function,
            expert_bias=self.expert_bias,
        )
        self.last_topk_indices = indices
        self._deferred = None
        if self.training and torch.is_grad_enabled():
            if self.defer_router_losses:
                self._deferred = (logits, routing_map, pad, valid)
            else:
                probs = self._attach_and_track(probs, logits, routing_map, pad, valid)
        return probs, routing_map

    def attach_deferred_losses(self, output: torch.Tensor) -> torch.Tensor:
        """``output`` with the router losses of the last ``routing`` attached (and its counts
        made) when ``defer_router_losses`` held them back; else ``output`` unchanged."""
        if self._deferred is None:
            return output
        logits, routing_map, pad, valid = self._deferred
        self._deferred = None
        return self._attach_and_track(output, logits, routing_map, pad, valid)

    def _attach_and_track(self, activation, logits, routing_map, pad, valid) -> torch.Tensor:
        """Count the dispatch, attach the router losses to ``activation``, then file the
        counts and losses in the tracker (``_file_in_tracker``, eager)."""
        counts = self._count_dispatched(routing_map, valid)
        tracked = []
        activation = self._attach_router_losses(activation, logits, routing_map, pad, tracked)
        _file_in_tracker(self, counts, tracked)
        return activation

    def apply_z_loss(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """Attach this shard's part of z_m = c sum lse^2 / T_m to the logits (T_m counted
        over the micro-batch)."""
        if not (self.training and torch.is_grad_enabled() and self.config.moe_z_loss_coeff):
            return logits
        pad = None if padding_mask is None else padding_mask.reshape(-1).bool()
        routing_map = torch.zeros_like(logits, dtype=torch.bool)
        counts = moe_utils.micro_batch_token_counts(
            routing_map, None if pad is None else ~pad, self.groups.tp_cp
        )
        tracked = []
        logits = self._attach_z_loss(logits, logits, pad, counts, tracked)
        _file_in_tracker(self, None, tracked)
        return logits

    def _attach_router_losses(self, probs, logits, routing_map, pad, tracked) -> torch.Tensor:
        """Attach the configured load-balancing losses and the z-loss (each shard's part)
        to ``probs``; T_m and n_e come from one ``micro_batch_token_counts`` call. Each
        attached loss is appended to ``tracked`` as (name, loss, coefficient)."""
        aux_coeff = self.get_aux_loss_coeff("aux_loss")
        seq_coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if not (aux_coeff or seq_coeff or self.config.moe_z_loss_coeff):
            return probs
        valid = None if pad is None else ~pad
        scores = None
        if aux_coeff or seq_coeff:
            routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function, padding_mask=pad
            )
        counts = moe_utils.micro_batch_token_counts(routing_map, valid, self.groups.tp_cp)
        if aux_coeff:
            aux = moe_utils.switch_load_balancing_loss_func(
                scores,
                counts.per_expert,
                counts.tokens,
                self.topk,
                self.num_experts,
                aux_coeff,
                padding_mask=pad,
            )
            weight = moe_utils.router_loss_token_weight(self.config, counts)
            probs = MoEAuxLossAutoScaler.apply(probs, aux * _weight(weight, aux))
            tracked.append(("load_balancing_loss", aux, aux_coeff))
        if seq_coeff:
            seq_aux = self._seq_aux_loss(scores, routing_map, valid, seq_coeff)
            weight = moe_utils.router_loss_token_weight(self.config, counts)
            probs = MoEAuxLossAutoScaler.apply(probs, seq_aux * _weight(weight, seq_aux))
            tracked.append(("seq_load_balancing_loss", seq_aux, seq_coeff))
        if self.config.moe_z_loss_coeff:
            probs = self._attach_z_loss(probs, logits, pad, counts, tracked)
        return probs

    def _attach_z_loss(self, activation, logits, pad, counts, tracked) -> torch.Tensor:
        z_loss = moe_utils.z_loss_func(
            logits, self.config.moe_z_loss_coeff, padding_mask=pad, num_tokens=counts.tokens
        )
        weight = moe_utils.router_loss_token_weight(self.config, counts)
        tracked.append(("z_loss", z_loss, self.config.moe_z_loss_coeff))
        return MoEAuxLossAutoScaler.apply(activation, z_loss * _weight(weight, z_loss))

    def _seq_aux_loss(self, scores, aux_map, valid, coeff):
        """This shard's part of (1/B) sum_b E c / (k T_b^2) sum_e n_{b,e} sum_{x in b} p_e(x)
        (T_b, n_b over the whole sequence b: an out-of-place all-reduce over tp x cp)."""
        batch = self._batch
        tokens, experts = scores.shape
        if valid is None:
            valid = torch.ones(tokens, dtype=torch.bool, device=scores.device)
        seq_map = aux_map.view(tokens // batch, batch, experts).transpose(0, 1)
        seq_valid = valid.view(tokens // batch, batch).transpose(0, 1)
        # one count vector per sequence: [B, E + 1] summed over the micro-batch's shards
        per_seq = [
            moe_utils.micro_batch_token_counts(seq_map[b], seq_valid[b], None) for b in range(batch)
        ]
        local = torch.stack([torch.cat([c.per_expert, c.tokens.reshape(1)]) for c in per_seq])
        total = communication.all_reduce(local, self.groups.tp_cp)
        seq_scores = scores.view(tokens // batch, batch, experts).transpose(0, 1)
        sums = seq_scores.sum(dim=1)  # [B, E], padding rows are zero already
        seq_tokens = total[:, -1].to(scores.dtype).clamp(min=1.0)
        per_seq_loss = (total[:, :-1].to(scores.dtype) * sums).sum(dim=1) / seq_tokens**2
        return per_seq_loss.sum() * experts * coeff / (self.topk * batch)

    def _count_dispatched(self, routing_map: torch.Tensor, valid) -> torch.Tensor:
        """Valid tokens per expert of the dispatch map [E] (int64): added to the expert-bias
        update's counts here; the logged load (``_file_in_tracker``)."""
        chosen = routing_map if valid is None else routing_map & valid.unsqueeze(-1)
        counts = chosen.sum(dim=0, dtype=torch.int64)
        if self.enable_expert_bias:
            with torch.no_grad():
                self.local_tokens_per_expert += counts.to(self.local_tokens_per_expert.device)
        return counts

    def _tracked_layers(self) -> int:
        """The tracker's layer count: the decoder's layers, then the MTP depths' (as
        megatron-core's router)."""
        return self.config.num_layers + (self.config.mtp_num_layers or 0)

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask=None) -> None:
        """Add the dispatch map's valid-token counts to ``local_tokens_per_expert``."""
        valid = None if padding_mask is None else ~padding_mask.reshape(-1)
        _file_in_tracker(self, self._count_dispatched(routing_map, valid), [])


@torch.compiler.disable
def _file_in_tracker(router: TopKRouter, counts: Optional[torch.Tensor], losses: list) -> None:
    """Add a router's dispatch ``counts`` (None: none) and its ``losses`` ((name, loss,
    coefficient): the loss / coefficient, megatron-core's logged value) to the tracker under
    its layer number. Eager under ``torch.compile``: traced, dynamo guarded on the layer
    number (a Python int) and on the tracker's entries, so each layer recompiled."""
    layers, tp_cp, dp = router._tracked_layers(), router.groups.tp_cp, router.groups.dp
    if counts is not None:
        moe_utils.save_tokens_per_expert(counts, router.layer_number, layers, tp_cp, dp)
    for name, loss, coeff in losses:
        loss = loss / coeff
        moe_utils.save_to_aux_losses_tracker(
            name, loss, router.layer_number, layers, reduce_group=tp_cp, avg_group=dp
        )


def _weight(weight, like: torch.Tensor):
    """The per-token-mode weight as a scalar of ``like``'s dtype (or the int 1)."""
    if isinstance(weight, torch.Tensor):
        return weight.detach().to(device=like.device, dtype=like.dtype)
    return weight
