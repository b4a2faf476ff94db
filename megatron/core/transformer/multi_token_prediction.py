"""Multi-token prediction (DeepSeek-V3's MTP) with megatron-core 0.16.1's API and names,
exact at every layout.

Depth k = 1..K (``config.mtp_num_layers``) lives on the last pipeline stage. With h_0 the
decoder's output after its final norm and t the tokens:

    h_k = final_layernorm_k(transformer_layer_k(eh_proj_k([enorm_k(E(t rolled by k));
          hnorm_k(h_{k-1})])))

(the next depth reads the normed h_k, as megatron-core does); logits_k = the shared output
layer of h_k; labels and loss mask rolled by k (the positions rolled in are masked). Rolling
is in the GLOBAL sequence order: across the load-balanced CP shards, and within each
document of a packed row. The MTP loss of a microbatch is

    (mtp_loss_scaling_factor / K) sum_k S_k / max(N_k, 1)

with S_k the masked cross-entropy sum and N_k the rolled mask's valid tokens of the WHOLE
sequence (summed over CP: megatron-core 0.16.1 divides each shard by its own count,
Megatron-LM #7452 item 3, NaN for a shard with no target); in per-token mode
(``calculate_per_token_loss``) it is (f / K) sum_k S_k and ``finalize_model_grads`` divides
by the main loss's token count, as megatron-core does. It reaches the gradient through
``MTPLossAutoScaler`` on the main hidden states, whose backward gives it the schedule's scale.
"""

import dataclasses
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.communication import all_gather_along_first_dim, all_reduce
from megatron.core.context_parallel import cp_gathered_positions, thd_partitioned_indices
from megatron.core.process_groups_config import resolve_group
from megatron.core.transformer.loss_auto_scaler import loss_auto_scaler
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.parallel_groups import cp_group_of, pp_rank_of, tp_group_of
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import build_layers, full_recompute_spans
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import refuse_unsupported_arguments
from megatron.core.utils import get_pg_rank, get_pg_size, shard_per_token_tensor


@dataclasses.dataclass
class MultiTokenPredictionLayerSubmodules:
    """The parts of one MTP depth (megatron-core 0.16.1's fields)."""

    enorm: Union[ModuleSpec, type] = None
    hnorm: Union[ModuleSpec, type] = None
    eh_proj: Union[ModuleSpec, type] = None
    transformer_layer: Union[ModuleSpec, type] = None
    layer_norm: Union[ModuleSpec, type] = None


@dataclasses.dataclass
class MultiTokenPredictionBlockSubmodules:
    """One layer spec per MTP depth."""

    layer_specs: Optional[List[ModuleSpec]] = None


def get_mtp_layer_spec(
    transformer_layer_spec: ModuleSpec, use_transformer_engine: bool
) -> ModuleSpec:
    """An MTP depth around ``transformer_layer_spec``: local norms and a column-parallel
    ``eh_proj`` (Transformer Engine is not available: ``use_transformer_engine`` must be
    False)."""
    if use_transformer_engine:
        raise NotImplementedError(
            "get_mtp_layer_spec: use_transformer_engine=True is not supported (Transformer "
            "Engine is not available); pass False"
        )
    return ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=WrappedTorchNorm,
            hnorm=WrappedTorchNorm,
            eh_proj=tensor_parallel.ColumnParallelLinear,
            transformer_layer=transformer_layer_spec,
            layer_norm=WrappedTorchNorm,
        ),
    )


def get_mtp_num_layers_to_build(
    config: TransformerConfig, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> int:
    """``mtp_num_layers`` on the last (virtual) pipeline stage, 0 elsewhere (``pp_rank``
    None: ``parallel_state``'s rank, the MPU fallback)."""
    if not config.mtp_num_layers:
        return 0
    pp_rank = pp_rank_of(None, config) if pp_rank is None else pp_rank
    last_rank = pp_rank == config.pipeline_model_parallel_size - 1
    vpp = config.virtual_pipeline_model_parallel_size
    last_chunk = vp_stage is None or vpp is None or vp_stage == vpp - 1
    return config.mtp_num_layers if last_rank and last_chunk else 0


MTPLossAutoScaler = loss_auto_scaler(
    "MTPLossAutoScaler",
    """Attach the MTP loss to an activation (``loss_auto_scaler``, a scale of its own): the
    schedules set it each step, the gradient scale times C / M in the averaged and legacy
    loss modes, the gradient scale in per-token mode.""",
    __name__,
)


class MTPLossLoggingHelper:
    """The MTP losses of a step for logging: each microbatch's S_k / max(N_k, 1) per depth,
    summed over microbatches and over ``reduce_group`` (CP: each shard holds its part of
    S_k), averaged over ``avg_group`` (DP)."""

    tracker: dict = {}

    @staticmethod
    def save_loss_to_tracker(
        loss: Tensor,
        layer_number: int,
        num_layers: int,
        reduce_group: Optional[dist.ProcessGroup] = None,
        avg_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        """Add ``loss`` to depth ``layer_number`` (0-based) of ``num_layers``."""
        if layer_number is None:
            return
        tracker = MTPLossLoggingHelper.tracker
        values = tracker.get("values")
        if values is None or values.numel() != num_layers or values.device != loss.device:
            values = torch.zeros(num_layers, dtype=torch.float64, device=loss.device)
            tracker["values"] = values
        values[layer_number] += loss.detach().to(torch.float64)  # no host sync
        tracker["reduce_group"] = reduce_group
        tracker["avg_group"] = avg_group

    @staticmethod
    def clean_loss_in_tracker() -> None:
        """Forget the step's losses."""
        tracker = MTPLossLoggingHelper.tracker
        if tracker.get("values") is not None:
            tracker["values"].zero_()
        tracker["reduce_group"] = tracker["avg_group"] = None

    @staticmethod
    def reduce_loss_in_tracker() -> None:
        """Sum the losses over the reduce group, then average them over the average group
        (collective over both)."""
        tracker = MTPLossLoggingHelper.tracker
        values = tracker.get("values")
        if values is None:
            return
        reduce_group, avg_group = tracker.get("reduce_group"), tracker.get("avg_group")
        if get_pg_size(reduce_group) > 1:
            values = all_reduce(values, reduce_group)
        if get_pg_size(avg_group) > 1:
            values = all_reduce(values, avg_group) / get_pg_size(avg_group)
        tracker["values"] = values

    @staticmethod
    def track_mtp_metrics(
        loss_scale: float, iteration: int, writer=None, wandb_writer=None, total_loss_dict=None
    ) -> None:
        """Reduce the step's losses, add ``loss_scale`` times each to ``total_loss_dict``
        under megatron's names ("mtp_1 loss", ...), write them to ``writer`` /
        ``wandb_writer``, and clear the tracker."""
        MTPLossLoggingHelper.reduce_loss_in_tracker()
        values = MTPLossLoggingHelper.tracker.get("values")
        if values is None:
            return
        for index, value in enumerate((values * loss_scale).tolist()):
            name = f"mtp_{index + 1} loss"
            if total_loss_dict is not None:
                total_loss_dict[name] = total_loss_dict.get(name, 0.0) + value
            if writer is not None:
                writer.add_scalar(name, value, iteration)
            if wandb_writer is not None:
                wandb_writer.log({name: value}, iteration)
        MTPLossLoggingHelper.clean_loss_in_tracker()


class SequenceRoll:
    """Shift per-token tensors [b, s_local] of this CP rank towards the start of the
    sequence in the GLOBAL order: ``roll(x, k)[p] = x[p + k]`` when p + k is in p's
    document (the whole row, or one document of a packed row), else 0. Each tensor is
    gathered over the CP group once (small integer tensors: ids, labels, masks): a roll of
    a roll is taken from the first one's gathered source, ``roll(roll(x, j), k) =
    roll(x, j + k)`` (both zero once p + j + k leaves p's document). Build one per forward:
    it keeps what it gathered and returned until it is dropped (so none of those tensors
    may be changed in place meanwhile)."""

    def __init__(self, local_length: int, cp_group, packed_seq_params=None) -> None:
        self.cp_group = cp_group
        self._sources: dict = {}  # id(tensor) -> (tensor, [b, s] source in global order, shift)
        cp, rank = get_pg_size(cp_group), get_pg_rank(cp_group)
        total = local_length * cp
        self.total = total
        if packed_seq_params is None:
            self.gathered = cp_gathered_positions(total, cp) if cp > 1 else None
            self.positions = self._local(self.gathered, local_length, rank)
            self.ends = torch.full((local_length,), total, dtype=torch.long)
            return
        padded = packed_seq_params.cu_seqlens_q_padded
        padded = packed_seq_params.cu_seqlens_q if padded is None else padded
        padded = [int(v) for v in padded]
        lengths = [int(v) for v in packed_seq_params.cu_seqlens_q]
        order = [thd_partitioned_indices(padded, total, cp, r) for r in range(cp)]
        self.gathered = torch.cat(order) if cp > 1 else None
        self.positions = order[rank]
        ends = torch.zeros(total, dtype=torch.long)  # tokens past the last document: none
        for doc in range(len(padded) - 1):
            length = lengths[doc + 1] - lengths[doc]
            ends[padded[doc] : padded[doc + 1]] = padded[doc] + length
        self.ends = ends[self.positions]

    @staticmethod
    def _local(gathered: Optional[Tensor], local_length: int, rank: int) -> Tensor:
        if gathered is None:
            return torch.arange(local_length)
        return gathered[rank * local_length : (rank + 1) * local_length]

    def __call__(self, tensor: Optional[Tensor], shift: int) -> Optional[Tensor]:
        if tensor is None:
            return None
        whole, shift = self._source(tensor, shift)
        target = self.positions + shift
        valid = (target < self.ends).to(tensor.device)
        taken = whole[:, target.clamp(max=self.total - 1).to(tensor.device)]
        rolled = torch.where(valid, taken, torch.zeros_like(taken))
        self._sources[id(rolled)] = (rolled, whole, shift)
        return rolled

    def _source(self, tensor: Tensor, shift: int) -> Tuple[Tensor, int]:
        """(the gathered source of ``tensor``, the shift from it): ``tensor`` itself gathered
        (once), or, for this roll's own output, what it was rolled from."""
        known = self._sources.get(id(tensor))
        if known is not None and known[0] is tensor:
            return known[1], known[2] + shift
        whole = self._whole(tensor)
        self._sources[id(tensor)] = (tensor, whole, 0)
        return whole, shift

    def _whole(self, tensor: Tensor) -> Tensor:
        """[b, s] in global order from every rank's [b, s_local]."""
        if self.gathered is None:
            return tensor
        if tensor.dtype == torch.bool:  # gathered as bytes (not every backend takes bool)
            return self._whole(tensor.to(torch.uint8)).bool()
        parts = all_gather_along_first_dim(tensor.t().contiguous(), self.cp_group)
        whole = parts.new_zeros((self.total,) + tuple(parts.shape[1:]))
        whole[self.gathered.to(parts.device)] = parts
        return whole.t()


class MultiTokenPredictionLayer(MegatronModule):
    """One MTP depth: ``enorm``, ``hnorm``, ``eh_proj`` (column-parallel 2h -> h, gathered
    over TP, then scattered over the sequence under SP), ``transformer_layer`` (global layer
    number ``num_layers + depth``), ``final_layernorm``."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MultiTokenPredictionLayerSubmodules,
        layer_number: int = 1,
        vp_stage: Optional[int] = None,
        pg_collection=None,
        *,
        pp_rank: Optional[int] = None,
    ) -> None:
        super().__init__(config)
        self.layer_number = layer_number
        self.tp_group = tp_group_of(pg_collection, config)
        self.cp_group = cp_group_of(pg_collection, config)
        norm = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.enorm = build_module(submodules.enorm, **norm)
        self.hnorm = build_module(submodules.hnorm, **norm)
        self.eh_proj = build_module(
            submodules.eh_proj,
            config.hidden_size * 2,
            config.hidden_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_group=self.tp_group,
        )
        pp_rank = pp_rank_of(pg_collection, config) if pp_rank is None else pp_rank
        offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
        self.transformer_layer = build_module(
            submodules.transformer_layer,
            config=config,
            layer_number=config.num_layers + layer_number - offset,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
            pp_rank=pp_rank,
        )
        # A MoE depth's router losses enter the objective and its counts the expert-bias
        # update; the tracker files its metrics as layer num_layers + k + 1 (megatron-core's
        # ``track_moe_metrics(mtp_num_layers=...)``).
        self.final_layernorm = build_module(submodules.layer_norm, **norm)

    # megatron-core 0.16.1's signature; ``context``, ``context_mask``, ``rotary_pos_cos`` and
    # ``rotary_pos_sin`` are refused unless None (``refuse_unsupported_arguments``).
    def forward(
        self,
        input_ids: Tensor,
        position_ids: Optional[Tensor],
        hidden_states: Tensor,
        attention_mask: Optional[Tensor],
        context: Optional[Tensor] = None,
        context_mask: Optional[Tensor] = None,
        rotary_pos_emb: Optional[Tensor] = None,
        rotary_pos_cos: Optional[Tensor] = None,
        rotary_pos_sin: Optional[Tensor] = None,
        attention_bias: Optional[Tensor] = None,
        inference_params=None,
        packed_seq_params=None,
        sequence_len_offset: Optional[Tensor] = None,
        embedding: Optional[Callable] = None,
        *,
        padding_mask: Optional[Tensor] = None,
        roll: Optional["SequenceRoll"] = None,
    ):
        """(h_k, the ids and positions rolled by one) from h_{k-1} [s, b, h] and the ids and
        positions of depth k - 1 [b, s_local]: ``embedding`` embeds the ids one further
        ahead (``roll``: the shift in global order; built from ``packed_seq_params`` and
        this layer's CP group when None). ``padding_mask``: already this depth's, sharded
        like the hidden states (for a MoE ``transformer_layer``)."""
        refuse_unsupported_arguments(
            "MultiTokenPredictionLayer",
            context=context,
            context_mask=context_mask,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
        )
        if not callable(embedding):
            raise ValueError(
                f"MultiTokenPredictionLayer: embedding={embedding!r}; expected the model's "
                "embedding (called with input_ids and position_ids)"
            )
        if roll is None:
            roll = SequenceRoll(input_ids.shape[-1], self.cp_group, packed_seq_params)
        input_ids, position_ids = roll(input_ids, 1), roll(position_ids, 1)
        embedded = embedding(input_ids=input_ids, position_ids=position_ids)
        layer_kwargs = dict(
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            attention_bias=attention_bias,
            inference_context=inference_params,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        if padding_mask is not None:
            layer_kwargs["padding_mask"] = padding_mask
        return self._depth(hidden_states, embedded, layer_kwargs), input_ids, position_ids

    def _depth(self, hidden_states: Tensor, embedded: Tensor, layer_kwargs: dict) -> Tensor:
        """h_k from h_{k-1} and the embeddings of the tokens k ahead; under full
        recomputation the depth is one layer of ``full_recompute_spans`` (one checkpoint
        with either method, as the decoder's first layer)."""
        ((_, _, checkpointed),) = full_recompute_spans(self.config, self.training, 1)
        if checkpointed:

            def run(hidden: Tensor, decoder_input: Tensor) -> Tensor:
                return self._project_and_run(hidden, decoder_input, layer_kwargs)

            return tensor_parallel.checkpoint(run, False, hidden_states, embedded)
        return self._project_and_run(hidden_states, embedded, layer_kwargs)

    def _project_and_run(self, hidden: Tensor, embedded: Tensor, layer_kwargs: dict) -> Tensor:
        combined = torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1)
        projected, _ = self.eh_proj(combined)
        projected = tensor_parallel.gather_from_tensor_model_parallel_region(
            projected, group=self.tp_group
        )
        if self.config.sequence_parallel:
            projected = tensor_parallel.scatter_to_sequence_parallel_region(
                projected, group=self.tp_group
            )
        output, _ = self.transformer_layer(projected, **layer_kwargs)
        return self.final_layernorm(output)


class MultiTokenPredictionBlock(MegatronModule):
    """The MTP depths of the last pipeline stage (``mtp.layers.<k>``)."""

    def __init__(
        self,
        config: TransformerConfig,
        spec: Union[MultiTokenPredictionBlockSubmodules, ModuleSpec],
        vp_stage: Optional[int] = None,
        pg_collection=None,
        *,
        pp_rank: Optional[int] = None,
    ) -> None:
        super().__init__(config)
        submodules = spec.submodules if isinstance(spec, ModuleSpec) else spec
        specs = list(getattr(submodules, "layer_specs", None) or [])
        if len(specs) != config.mtp_num_layers:
            raise ValueError(
                f"MultiTokenPredictionBlock: the spec has {len(specs)} MTP layers, "
                f"config.mtp_num_layers is {config.mtp_num_layers!r}; expected equal (all MTP "
                "layers on the last pipeline stage: get_gpt_mtp_block_spec)"
            )
        self.mtp_loss_scaling_factor = config.mtp_loss_scaling_factor
        self.layers = build_layers(specs, config, pg_collection, vp_stage, pp_rank)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> dict:
        """Each depth through its own ``sharded_state_dict`` (``mtp.layers.<k>.``): its layer's
        norms under the spec's keys map and a MoE layer's routed experts on the global expert
        axis (a bare ``ModuleList`` would store them flat by local index: at EP > 1 another
        EP rank's experts would be saved as replicas of this one's)."""
        sharded = {}
        for k, layer in enumerate(self.layers):
            sharded.update(
                layer.sharded_state_dict(f"{prefix}layers.{k}.", sharded_offsets, metadata)
            )
        return sharded

    # megatron-core 0.16.1's signature, passed on to every layer (the arguments
    # ``refuse_unsupported_arguments`` names refused unless None).
    def forward(
        self,
        input_ids: Tensor,
        position_ids: Optional[Tensor],
        hidden_states: Tensor,
        attention_mask: Optional[Tensor],
        context: Optional[Tensor] = None,
        context_mask: Optional[Tensor] = None,
        rotary_pos_emb: Optional[Tensor] = None,
        rotary_pos_cos: Optional[Tensor] = None,
        rotary_pos_sin: Optional[Tensor] = None,
        attention_bias: Optional[Tensor] = None,
        inference_params=None,
        packed_seq_params=None,
        sequence_len_offset: Optional[Tensor] = None,
        extra_block_kwargs: Optional[dict] = None,
        embedding: Optional[Callable] = None,
        *,
        padding_mask: Optional[Tensor] = None,
        roll: Optional[SequenceRoll] = None,
    ) -> Tensor:
        """[h_0; h_1; ...; h_K] concatenated along the sequence dimension (megatron-core's
        return) from h_0 = ``hidden_states``. ``roll`` (this core's; None: built from
        ``packed_seq_params`` and the layers' CP group) shifts the ids, positions and
        ``padding_mask`` ([b, s_local], True = padding; rolled-in positions are not padding,
        as megatron-core rolls it) in global order."""
        refuse_unsupported_arguments(
            "MultiTokenPredictionBlock",
            context=context,
            context_mask=context_mask,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
        )
        if roll is None:
            roll = SequenceRoll(input_ids.shape[-1], self.layers[0].cp_group, packed_seq_params)
        outputs = [hidden_states]
        for depth, layer in enumerate(self.layers, start=1):
            mask = None
            if padding_mask is not None:
                mask = shard_per_token_tensor(
                    roll(padding_mask, depth), layer.tp_group, self.config.sequence_parallel
                )
            hidden_states, input_ids, position_ids = layer(
                input_ids,
                position_ids,
                hidden_states,
                attention_mask,
                context=context,
                rotary_pos_emb=rotary_pos_emb,
                attention_bias=attention_bias,
                inference_params=inference_params,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                embedding=embedding,
                padding_mask=mask,
                roll=roll,
                **(extra_block_kwargs or {}),
            )
            outputs.append(hidden_states)
        return torch.cat(outputs, dim=0)


def mtp_loss_terms(
    per_token_losses: List[Tensor],
    labels_mask: List[Tensor],
    config: TransformerConfig,
    cp_group,
    training: bool,
    dp_group=None,
) -> List[Tensor]:
    """The per-token terms [b, s_local] the MTP loss adds, one per depth: (f / K) m_k l_k /
    max(N_k, 1) with N_k summed over CP (per-token mode: (f / K) m_k l_k), where
    ``per_token_losses[k]`` is depth k+1's cross-entropy and ``labels_mask[k]`` its rolled
    mask. In training, each depth's S_k / max(N_k, 1) is tracked for logging."""
    weight = config.mtp_loss_scaling_factor / config.mtp_num_layers
    local_counts = [mask.detach().to(torch.float64).sum() for mask in labels_mask]
    counts = all_reduce(torch.stack(local_counts), cp_group)  # every depth's N_k at once
    terms = []
    for depth, (loss, mask) in enumerate(zip(per_token_losses, labels_mask)):
        masked = loss * mask.to(loss.dtype)
        denominator = counts[depth].clamp(min=1).to(device=loss.device, dtype=loss.dtype)
        if training:
            MTPLossLoggingHelper.save_loss_to_tracker(
                masked.detach().sum() / denominator,
                depth,
                config.mtp_num_layers,
                reduce_group=cp_group,
                avg_group=dp_group,
            )
        if config.calculate_per_token_loss:
            terms.append(weight * masked)
        else:
            terms.append(weight * masked / denominator)
    return terms


def attach_mtp_loss(
    model,
    hidden_states: Tensor,
    inputs: tuple,
    layer_kwargs: dict,
    runtime_gather_output: Optional[bool],
) -> Tensor:
    """``GPTModel``'s main hidden states with the MTP loss attached (``MTPLossAutoScaler``):
    the depths of ``model.mtp`` run on the decoder's output, each through the shared output
    layer. ``inputs``: (input_ids, position_ids, labels, loss_mask, padding_mask) of this CP
    shard."""
    input_ids, position_ids, labels, loss_mask, padding_mask = inputs
    if input_ids is None:
        raise ValueError(
            "GPTModel: multi-token prediction needs input_ids (each depth embeds the tokens k "
            "ahead); got decoder_input only"
        )
    cp_group = model._cp_group.get()
    roll = SequenceRoll(labels.shape[-1], cp_group, layer_kwargs["packed_seq_params"])
    states = model.mtp(
        input_ids,
        position_ids,
        hidden_states,
        layer_kwargs["attention_mask"],
        rotary_pos_emb=layer_kwargs["rotary_pos_emb"],
        packed_seq_params=layer_kwargs["packed_seq_params"],
        embedding=model.embedding,
        padding_mask=padding_mask,
        roll=roll,
    ).chunk(1 + model.config.mtp_num_layers, dim=0)
    tied = model.share_embeddings_and_output_weights
    weight = model.shared_embedding_or_output_weight() if tied else None
    mask = torch.ones_like(labels) if loss_mask is None else loss_mask
    losses, masks = [], []
    for depth, state in enumerate(states[1:], start=1):
        logits, _ = model.output_layer(
            state, weight=weight, runtime_gather_output=runtime_gather_output
        )
        logits = model.exclude_padded_vocab(logits)
        losses.append(model.compute_language_model_loss(roll(labels, depth), logits))
        masks.append(roll(mask, depth))
    dp_group = resolve_group("dp", None, model.pg_collection)  # the MPU's without a collection
    terms = mtp_loss_terms(losses, masks, model.config, cp_group, model.training, dp_group)
    hidden_states = states[0]
    for term in terms:
        hidden_states = MTPLossAutoScaler.apply(hidden_states, term)
    return hidden_states


def check_mtp_placement(
    config: TransformerConfig,
    mtp_block_spec,
    pre_process: bool,
    post_process: bool,
    position_embedding_type: str,
) -> None:
    """``GPTModel``'s MTP arguments: the MTP layers are built on the last pipeline stage,
    exactly when the config has them; learned position embeddings have no tied copy on a
    later stage."""
    if mtp_block_spec is not None and not config.mtp_num_layers:
        raise ValueError(
            f"GPTModel: mtp_block_spec given but config.mtp_num_layers is "
            f"{config.mtp_num_layers!r}; expected a positive number of MTP layers"
        )
    if mtp_block_spec is not None and not post_process:
        raise ValueError(
            "GPTModel: mtp_block_spec on a chunk with post_process=False; the MTP layers live "
            "on the last pipeline stage (get_gpt_mtp_block_spec returns None elsewhere)"
        )
    if config.mtp_num_layers and post_process and mtp_block_spec is None:
        raise ValueError(
            f"GPTModel: config.mtp_num_layers={config.mtp_num_layers} on the last pipeline "
            "stage needs mtp_block_spec (get_gpt_mtp_block_spec(config, block_spec, False))"
        )
    later_stage = mtp_block_spec is not None and not pre_process
    if later_stage and position_embedding_type == "learned_absolute":
        raise NotImplementedError(
            "GPTModel: multi-token prediction with position_embedding_type='learned_absolute' "
            "on a later pipeline stage than the embeddings is not supported (its "
            "position-embedding copy would not be tied); expected 'rope' or 'none', or "
            "pipeline_model_parallel_size=1"
        )
