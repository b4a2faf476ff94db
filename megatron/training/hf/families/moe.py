"""What the mixture-of-experts families share: reading the routing keys of ``config.json``
and the weight table of a MoE layer.

A HuggingFace MoE block of these families computes, per token x, router logits z = x G^T
(G [E, h]), p = softmax(z) over all E experts, the top ``num_experts_per_tok`` = k of p,
weights w_j = p_j (``norm_topk_prob`` false) or p_j / sum of the k (true; Mixtral always),
and y = sum_j w_j FFN_{e_j}(x), FFN_e(x) = down_e(silu(gate_e x) * up_e x) [+ sigmoid(x s^T)
FFN_shared(x), Qwen2-MoE]. In our ``TopKRouter`` terms (softmax score function): the
renormalized weights are a softmax over the k selected logits (``moe_router_pre_softmax``
false, megatron-core's default), the unnormalized ones the softmax over all experts read at
the k (``moe_router_pre_softmax`` true); the order of the top-k is the same (softmax is
monotonic). Our experts apply w_j at the activation, (silu(gate x) * up x * w_j) down^T:
the same product, associated differently (float32 rounding, not a different model).

Our parameter names (one-chunk, global layer L, GLOBAL expert g; a ``GroupedMLP`` or an
expert-parallel model holds the same values under other names, see ``loading.py``):
``decoder.layers.L.mlp.router.weight`` [E, h], ``...mlp.experts.local_experts.g.linear_fc1
.weight`` [2F, h] = [gate_g; up_g], ``...linear_fc2.weight`` [h, F] = down_g, and for the
shared expert ``...mlp.shared_experts.linear_fc1.weight`` [gate; up], ``linear_fc2.weight``,
``gate_weight`` [1, h].

HuggingFace's ``router_aux_loss_coef`` is not read as ``moe_aux_loss_coeff``: transformers
pools the router probabilities of all layers into one load-balancing loss and does not
divide by k, while megatron's is per layer (docs/huggingface.md has the conversion); an
import trains with no router loss unless one is asked for.
"""

from typing import Any, Dict, List, Optional, Tuple, Union

from megatron.core.config_rules import moe_layer_pattern
from megatron.training.hf.family import ConfigReader, HFArchitecture, Segment, Source

# The routing these families compute, in megatron's names (TransformerConfig and trainer
# settings alike): set on import, required of a trained model's settings on export (the
# HFArchitecture defaults; DeepSeek's families set other values).
WRITTEN_ROUTING: Dict[str, Any] = {
    "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False,
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
}


def written_moe_layer_freq(arch: HFArchitecture) -> Union[int, List[int]]:
    """``moe_layer_freq`` of a MoE ``arch``: 1 when every layer is a MoE layer, else the 0/1
    list (whose layers megatron-core's checkpoints store one by one, not stacked)."""
    pattern = list(arch.moe_layer_freq)
    return 1 if all(pattern) else pattern


def read_routing(c: ConfigReader, experts: int, norm_topk_prob: bool) -> Dict[str, Any]:
    """``num_experts_per_tok`` and the keys every MoE family has that do not change the
    weights' meaning (``output_router_logits``: what forward returns; ``router_aux_loss_coef``:
    a training loss, not mapped, see the module docstring)."""
    topk = c.positive_int("num_experts_per_tok")
    c.require(
        topk <= experts,
        "num_experts_per_tok",
        topk,
        f"at most the number of experts ({experts})",
    )
    coef = c.optional("router_aux_loss_coef", 0.0)
    c.require(
        isinstance(coef, (int, float)) and coef >= 0,
        "router_aux_loss_coef",
        coef,
        "a number >= 0",
    )
    c.seen("output_router_logits")
    return dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_router_pre_softmax=not norm_topk_prob,
    )


def read_norm_topk_prob(c: ConfigReader) -> bool:
    """``norm_topk_prob`` (default false): whether the k routing weights are renormalized."""
    value = c.optional("norm_topk_prob", False)
    c.require(isinstance(value, bool), "norm_topk_prob", value, "true or false")
    return value


def read_sparse_layers(c: ConfigReader) -> Optional[Tuple[int, ...]]:
    """Qwen-MoE's choice of MoE layers as one 0/1 per layer (our ``moe_layer_freq`` list):
    layer i is sparse when it is not in ``mlp_only_layers`` and (i + 1) is a multiple of
    ``decoder_sparse_step``. None when no layer is sparse (a dense model)."""
    layers = c.positive_int("num_hidden_layers")
    step = c.positive_int("decoder_sparse_step", default=1)
    dense = c.optional("mlp_only_layers", [])
    c.require(
        isinstance(dense, list) and all(isinstance(i, int) and 0 <= i < layers for i in dense),
        "mlp_only_layers",
        dense,
        f"a list of layer indices in [0, {layers})",
    )
    pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
    return pattern if any(pattern) else None


def moe_mlp_sources(
    arch: HFArchitecture,
    layer: int,
    router: str,
    expert: str,
    projections: Tuple[str, str, str],
    shared: Optional[str] = None,
    shared_gate: Optional[str] = None,
) -> Dict[str, Source]:
    """The MLP part of MoE layer ``layer``'s table: ``router`` the gate's key, ``expert`` the
    experts' key prefix with ``{g}`` for the expert index, ``projections`` the (gate, up,
    down) names within an expert; ``shared`` / ``shared_gate``: the shared expert's key prefix
    (its projections named gate_proj/up_proj/down_proj) and its sigmoid gate's key."""
    h, f = arch.hidden_size, arch.moe_ffn_hidden_size
    gate, up, down = projections
    ours = f"decoder.layers.{layer}.mlp."
    table = {ours + "router.weight": (Segment(router, 0, arch.num_moe_experts),)}
    for g in range(arch.num_moe_experts):
        name, key = f"{ours}experts.local_experts.{g}.", expert.format(g=g)
        table[name + "linear_fc1.weight"] = (
            Segment(f"{key}{gate}.weight", 0, f),
            Segment(f"{key}{up}.weight", 0, f),
        )
        table[name + "linear_fc2.weight"] = (Segment(f"{key}{down}.weight", 0, h),)
    if arch.moe_shared_expert_intermediate_size is not None:
        fs = arch.moe_shared_expert_intermediate_size
        table[ours + "shared_experts.linear_fc1.weight"] = (
            Segment(f"{shared}gate_proj.weight", 0, fs),
            Segment(f"{shared}up_proj.weight", 0, fs),
        )
        table[ours + "shared_experts.linear_fc2.weight"] = (
            Segment(f"{shared}down_proj.weight", 0, h),
        )
        if arch.moe_shared_expert_gate:
            table[ours + "shared_experts.gate_weight"] = (Segment(shared_gate, 0, 1),)
    return table


def replace_mlp(table: Dict[str, Source], layer: int, moe: Dict[str, Source]) -> None:
    """Put MoE layer ``layer``'s MLP entries ``moe`` in place of the dense ones."""
    for name in [n for n in table if n.startswith(f"decoder.layers.{layer}.mlp.")]:
        del table[name]
    table.update(moe)


def moe_full_shapes(arch: HFArchitecture) -> Dict[str, tuple]:
    """{our one-chunk MoE parameter name: full shape} (see the module docstring)."""
    shapes: Dict[str, tuple] = {}
    if arch.num_moe_experts is None:
        return shapes
    h, f = arch.hidden_size, arch.moe_ffn_hidden_size
    fs = arch.moe_shared_expert_intermediate_size
    for layer in range(arch.num_layers):
        if not arch.is_moe_layer(layer):
            continue
        p = f"decoder.layers.{layer}.mlp."
        shapes[p + "router.weight"] = (arch.num_moe_experts, h)
        shapes[p + "router.bias"] = (arch.num_moe_experts,)
        for g in range(arch.num_moe_experts):
            shapes[f"{p}experts.local_experts.{g}.linear_fc1.weight"] = (2 * f, h)
            shapes[f"{p}experts.local_experts.{g}.linear_fc2.weight"] = (h, f)
            shapes[f"{p}experts.local_experts.{g}.linear_fc1.bias"] = (2 * f,)
            shapes[f"{p}experts.local_experts.{g}.linear_fc2.bias"] = (h,)
        if fs is not None:
            shapes[p + "shared_experts.linear_fc1.weight"] = (2 * fs, h)
            shapes[p + "shared_experts.linear_fc2.weight"] = (h, fs)
            shapes[p + "shared_experts.gate_weight"] = (1, h)
        if arch.moe_router_enable_expert_bias:
            shapes[p + "router.expert_bias"] = (arch.num_moe_experts,)
    return shapes


def moe_architecture_fields(settings: Dict[str, Any]) -> Dict[str, Any]:
    """The HFArchitecture MoE fields of a model our trainer built (none when dense)."""
    if settings.get("num_experts") is None:
        return {}
    pattern = moe_layer_pattern(settings.get("moe_layer_freq", 1), settings["num_layers"])
    return dict(
        num_moe_experts=settings["num_experts"],
        moe_router_topk=settings.get("moe_router_topk", 2),
        moe_ffn_hidden_size=settings.get("moe_ffn_hidden_size") or settings["ffn_hidden_size"],
        moe_router_pre_softmax=bool(settings.get("moe_router_pre_softmax", False)),
        moe_shared_expert_intermediate_size=settings.get("moe_shared_expert_intermediate_size"),
        moe_shared_expert_gate=bool(settings.get("moe_shared_expert_gate", False)),
        moe_layer_freq=tuple(pattern),
        **{key: settings.get(key, default) for key, default in WRITTEN_ROUTING.items()},
    )
