"""DeepSeek-V3 and DeepSeek-V2 (``DeepseekV3ForCausalLM``, ``DeepseekV2ForCausalLM``; V2-Lite:
no q LoRA): multi-latent attention, the first ``first_k_dense_replace`` layers dense, the others
MoE layers with ``n_shared_experts`` shared experts (docs/deepseek.md).

Attention (our ``MLASelfAttention``, megatron-core's names): ``linear_q_down_proj`` =
``q_a_proj``, ``q_layernorm`` = ``q_a_layernorm``, ``linear_q_up_proj`` = ``q_b_proj`` (or
``linear_q_proj`` = ``q_proj``), ``linear_kv_down_proj`` = ``kv_a_proj_with_mqa``,
``kv_layernorm`` = ``kv_a_layernorm``, ``linear_kv_up_proj`` = ``kv_b_proj``, ``linear_proj`` =
``o_proj``, row for row: the rope pairs are interleaved on both sides (transformers' V3
``rope_interleave``, V2's complex rotation). The q/kv norms use our one ``layernorm_epsilon``,
transformers' always 1e-6: ``rms_norm_eps`` must be 1e-6.

Routing. V3: sigmoid scores s, the top-k of s + ``e_score_correction_bias`` (our
``router.expert_bias`` buffer, updated by the trainer when training) within the ``topk_group``
best of ``n_group`` groups (a group's score: the sum of its best two; ours: of its best
k / group_topk, so k / topk_group must be 2), weights s renormalized (``norm_topk_prob``,
ours always for k > 1) times ``routed_scaling_factor``. V2: softmax over all experts read at the
top k, not renormalized, times ``routed_scaling_factor``; ``group_limited_greedy`` keeps the
``topk_group`` groups of highest max score (ours: the sum of the best k / group_topk, so k must
equal ``topk_group``). What cannot be expressed is refused by name.

Multi-token prediction (V3): depth k is layer ``num_hidden_layers + k``
(``hf/mtp_weights.py``); the checkpoint's tensors say whether it has them
(``num_nextn_predict_layers``, which transformers writes as 1 without them, must count them
when they are there). V2 has none: its layers after ``num_hidden_layers`` are refused by name.
"""

from typing import Any, Dict, Iterable, List, Optional

from megatron.training.hf.families.llama import LlamaShaped, layer_prefix, rmsnorm_decoder
from megatron.training.hf.families.moe import moe_mlp_sources, read_routing
from megatron.training.hf.family import ConfigReader, Family, HFArchitecture, Segment, Source

# The only epsilon transformers' DeepSeek q/kv down-projection norms use.
DOWN_NORM_EPS = 1e-6
HINT = (  # the start of both versions' settings_hint
    "RMSNorm + swiglu + rope + --multi-latent-attention (q/kv norms, --norm-epsilon 1e-6) + MoE "
    "layers after the dense ones with "
)
_YARN_KEYS = {
    "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
    "partial_rotary_factor",
}  # fmt: skip


def mla_full_shapes(arch: HFArchitecture) -> Dict[str, tuple]:
    """{our one-chunk MLA parameter name: full shape}."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    qk, pos = arch.qk_head_dim, arch.qk_pos_emb_head_dim
    q_rank, kv_rank, v = arch.q_lora_rank, arch.kv_lora_rank, arch.v_head_dim
    shapes: Dict[str, tuple] = {}
    for layer in range(arch.num_layers):
        p = f"decoder.layers.{layer}.self_attention."
        if q_rank is None:
            shapes[p + "linear_q_proj.weight"] = (heads * (qk + pos), h)
        else:
            shapes[p + "linear_q_down_proj.weight"] = (q_rank, h)
            shapes[p + "q_layernorm.weight"] = (q_rank,)
            shapes[p + "linear_q_up_proj.weight"] = (heads * (qk + pos), q_rank)
        shapes[p + "linear_kv_down_proj.weight"] = (kv_rank + pos, h)
        shapes[p + "kv_layernorm.weight"] = (kv_rank,)
        shapes[p + "linear_kv_up_proj.weight"] = (heads * (qk + v), kv_rank)
        shapes[p + "linear_proj.weight"] = (h, heads * v)
    return shapes


def read_mla(c: ConfigReader) -> Dict[str, Any]:
    """The MLA fields of a DeepSeek ``config.json`` (dims and rope)."""
    q_rank = c.optional("q_lora_rank", None)
    c.require(
        q_rank is None or (isinstance(q_rank, int) and q_rank >= 1),
        "q_lora_rank",
        q_rank,
        "null (one q projection) or a positive integer",
    )
    nope, pos = c.positive_int("qk_nope_head_dim"), c.positive_int("qk_rope_head_dim")
    c.require(pos % 2 == 0, "qk_rope_head_dim", pos, "an even integer (rope pairs)")
    c.expect(
        "qk_head_dim",
        nope + pos,
        f"qk_nope_head_dim + qk_rope_head_dim ({nope + pos})",
        default=nope + pos,
    )
    c.expect("head_dim", pos, f"qk_rope_head_dim ({pos}): transformers' rope dim", default=pos)
    c.expect(
        "rope_interleave",
        True,
        "true (interleaved rope pairs, DeepSeek's and ours)",
        default=True,
    )
    return dict(
        multi_latent_attention=True,
        q_lora_rank=q_rank,
        kv_lora_rank=c.positive_int("kv_lora_rank"),
        qk_head_dim=nope,
        qk_pos_emb_head_dim=pos,
        v_head_dim=c.positive_int("v_head_dim"),
        qk_layernorm=True,
        **read_deepseek_rope(c),
    )


def read_deepseek_rope(c: ConfigReader) -> Dict[str, Any]:
    """``rotary_base`` and the rope / yarn fields from ``rope_parameters`` (transformers 5)
    or ``rope_theta`` / ``rope_scaling`` (DeepSeek's own configs)."""
    params = c.optional("rope_parameters", None)
    scaling = c.optional("rope_scaling", None)
    theta = c.optional("rope_theta", None)
    key, rope = ("rope_parameters", params) if params is not None else ("rope_scaling", scaling)
    c.require(rope is None or isinstance(rope, dict), key, rope, "an object or null")
    rope = rope or {}
    theta = rope.get("rope_theta", theta)
    theta = 10000.0 if theta is None else theta
    c.require(isinstance(theta, (int, float)) and theta > 0, "rope_theta", theta, "a number > 0")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        extra = sorted(set(rope) - {"rope_theta", "rope_type", "type"})
        c.require(not extra, key, rope, "rope_theta and rope_type only for default rope")
        return dict(rotary_base=float(theta), rope_type="rope")
    c.require(kind == "yarn", key, rope, "rope_type default or yarn")
    unknown = sorted(set(rope) - _YARN_KEYS)
    c.require(not unknown, key, rope, f"yarn keys only (not {unknown})")
    c.require(
        rope.get("attention_factor") is None,
        key,
        rope,
        "no attention_factor (our yarn derives it from mscale and mscale_all_dim)",
    )
    c.require(rope.get("truncate", True) is True, key, rope, "truncate true or absent")
    c.require(rope.get("partial_rotary_factor", 1.0) == 1.0, key, rope, "partial_rotary_factor 1")
    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
    c.require(isinstance(factor, (int, float)) and factor > 0, key, rope, "a yarn factor > 0")
    c.require(
        isinstance(original, int) and original >= 1,
        key,
        rope,
        "original_max_position_embeddings, a positive integer",
    )
    mscale, all_dim = rope.get("mscale") or 0.0, rope.get("mscale_all_dim") or 0.0
    # transformers: cos/sin x mscale(f, mscale) / mscale(f, all_dim) only when both are set,
    # else x mscale(f, 1); ours always the quotient (all_dim 0 gives mscale(f, 0) = 1).
    c.require(
        bool(mscale) or not all_dim,
        key,
        rope,
        "mscale set when mscale_all_dim is (transformers then scales cos/sin by "
        "mscale(factor, 1), which our yarn cannot express)",
    )
    return dict(
        rotary_base=float(theta),
        rope_type="yarn",
        rotary_scaling_factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        mscale=float(mscale) if all_dim else 1.0,
        mscale_all_dim=float(all_dim),
    )


def write_rope(arch: HFArchitecture) -> Dict[str, Any]:
    """``rope_parameters`` of an exported config (transformers 5's form)."""
    if arch.rope_type == "rope":
        return {"rope_type": "default", "rope_theta": arch.rotary_base}
    return {
        "rope_type": "yarn",
        "rope_theta": arch.rotary_base,
        "factor": arch.rotary_scaling_factor,
        "original_max_position_embeddings": arch.original_max_position_embeddings,
        "beta_fast": arch.beta_fast,
        "beta_slow": arch.beta_slow,
        "mscale": arch.mscale,
        "mscale_all_dim": arch.mscale_all_dim,
    }


def read_moe_layers(c: ConfigReader, layers: int) -> Optional[Dict[str, Any]]:
    """The expert counts and MoE layer pattern (None: every layer dense)."""
    experts = c.positive_int("n_routed_experts")
    dense = c.optional("first_k_dense_replace", 0)
    c.require(
        isinstance(dense, int) and 0 <= dense <= layers,
        "first_k_dense_replace",
        dense,
        f"an integer in [0, num_hidden_layers ({layers})]",
    )
    c.expect("moe_layer_freq", 1, "1 (every layer after the dense ones)", default=1)
    c.expect("ep_size", 1, "a positive integer", default=1, allow=lambda v: isinstance(v, int))
    c.seen("aux_loss_alpha", "seq_aux", "auto_map")
    if dense == layers:
        c.seen(
            "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
            "topk_group", "norm_topk_prob", "routed_scaling_factor", "topk_method",
            "scoring_func", "router_aux_loss_coef", "output_router_logits",
        )  # fmt: skip
        return None
    ffn = c.positive_int("moe_intermediate_size")
    shared = c.positive_int("n_shared_experts")
    scale = c.positive_float("routed_scaling_factor", default=1.0)
    return dict(
        num_moe_experts=experts,
        moe_ffn_hidden_size=ffn,
        moe_shared_expert_intermediate_size=ffn * shared,
        moe_layer_freq=(0,) * dense + (1,) * (layers - dense),
        moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
    )


def read_groups(c: ConfigReader, experts: int, topk: int, per_group_best: int):
    """(num_groups, group_topk) of ``n_group`` / ``topk_group``, (None, None) when they
    restrict nothing; ``per_group_best``: how many best scores make a group's score."""
    groups = c.optional("n_group", 1)
    group_topk = c.optional("topk_group", 1)
    c.require(
        isinstance(groups, int) and groups >= 1 and experts % groups == 0,
        "n_group",
        groups,
        f"a positive divisor of n_routed_experts ({experts})",
    )
    c.require(
        isinstance(group_topk, int) and 1 <= group_topk <= groups,
        "topk_group",
        group_topk,
        f"an integer in [1, n_group ({groups})]",
    )
    if groups == 1 or group_topk == groups:
        return None, None
    c.require(
        topk == per_group_best * group_topk,
        "topk_group",
        group_topk,
        f"num_experts_per_tok ({topk}) / {per_group_best}: a group's score here is the sum "
        f"of its best {per_group_best}, ours of its best num_experts_per_tok / topk_group",
    )
    return groups, group_topk


class DeepSeek(Family):
    """What DeepSeek-V2 and V3 share: MLA, dense-then-MoE layers, shared experts."""

    def read(self, c: ConfigReader) -> HFArchitecture:
        hidden = c.positive_int("hidden_size")
        heads = c.positive_int("num_attention_heads")
        layers = c.positive_int("num_hidden_layers")
        c.expect("num_key_value_heads", heads, f"num_attention_heads ({heads})", default=heads)
        c.expect("hidden_act", "silu", "silu (SwiGLU)", default="silu")
        c.expect("pretraining_tp", 1, "1", default=1, allow=lambda v: isinstance(v, int))
        c.expect("attention_bias", False, "false (no biases)", default=False)
        eps = c.positive_float("rms_norm_eps", default=1e-6)
        c.require(
            eps == DOWN_NORM_EPS,
            "rms_norm_eps",
            eps,
            "1e-6 (transformers' q/kv down-projection norms always use 1e-6; ours use the "
            "model's one epsilon)",
        )
        mla = read_mla(c)
        moe = read_moe_layers(c, layers)
        if moe is not None:
            moe.update(self.read_routing(c, moe["num_moe_experts"]))
        self.read_mtp(c)
        return rmsnorm_decoder(
            c,
            self.model_type,
            {"rms_norm_eps": DOWN_NORM_EPS, "max_position_embeddings": 4096},
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=heads,
            kv_channels=hidden // heads,
            swiglu=True,
            activation="silu",
            position_embedding_type="rope",
            rope_scaling_factor=None,
            add_bias_linear=False,
            add_qkv_bias=False,
            **mla,
            **(moe or {}),
        )

    def read_routing(self, c: ConfigReader, experts: int) -> Dict[str, Any]:
        """The family's routing fields."""
        raise NotImplementedError

    def read_mtp(self, c: ConfigReader) -> None:
        """The multi-token prediction keys (V3); its layers are refused in ``check_keys``."""

    def write(self, arch: HFArchitecture) -> Dict[str, Any]:
        moe = arch.num_moe_experts is not None
        pattern = arch.moe_layer_freq if moe else (0,) * arch.num_layers
        dense = pattern.index(1) if 1 in pattern else arch.num_layers
        ffn = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
        shared = arch.moe_shared_expert_intermediate_size or 0
        config = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": arch.vocab_size,
            "hidden_size": arch.hidden_size,
            "intermediate_size": arch.ffn_hidden_size,
            "moe_intermediate_size": ffn,
            "num_hidden_layers": arch.num_layers,
            "num_attention_heads": arch.num_attention_heads,
            "num_key_value_heads": arch.num_attention_heads,
            "n_shared_experts": shared // ffn if shared % ffn == 0 else None,
            "n_routed_experts": arch.num_moe_experts or 1,
            "routed_scaling_factor": arch.moe_router_topk_scaling_factor or 1.0,
            "num_experts_per_tok": arch.moe_router_topk,
            "first_k_dense_replace": dense,
            "q_lora_rank": arch.q_lora_rank,
            "kv_lora_rank": arch.kv_lora_rank,
            "qk_nope_head_dim": arch.qk_head_dim,
            "qk_rope_head_dim": arch.qk_pos_emb_head_dim,
            "v_head_dim": arch.v_head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": arch.max_position_embeddings,
            "rms_norm_eps": arch.norm_epsilon,
            "rope_parameters": write_rope(arch),
            "tie_word_embeddings": arch.tied,
            "attention_bias": False,
        }
        if tuple(pattern) != (0,) * dense + (1,) * (arch.num_layers - dense):
            config["moe_layer_freq"] = list(pattern)  # refused on reading: not this family's
        config.update(self.write_routing(arch))
        return config

    def write_routing(self, arch: HFArchitecture) -> Dict[str, Any]:
        """The family's routing keys."""
        raise NotImplementedError

    def global_sources(self, arch: HFArchitecture, prefix: Optional[str]) -> Dict[str, Source]:
        return LlamaShaped.global_sources(self, arch, prefix)  # type: ignore[arg-type]

    def layer_sources(
        self, arch: HFArchitecture, layer: int, prefix: Optional[str]
    ) -> Dict[str, Source]:
        h, heads = arch.hidden_size, arch.num_attention_heads
        qk, pos = arch.qk_head_dim, arch.qk_pos_emb_head_dim
        p = layer_prefix(prefix, layer)
        attn, mlp, ours = f"{p}self_attn.", f"{p}mlp.", f"decoder.layers.{layer}."

        def rows(key: str, count: int) -> Source:
            return (Segment(key, 0, count),)

        table = {
            "input_layernorm.weight": rows(f"{p}input_layernorm.weight", h),
            "pre_mlp_layernorm.weight": rows(f"{p}post_attention_layernorm.weight", h),
            "self_attention.linear_kv_down_proj.weight": rows(
                f"{attn}kv_a_proj_with_mqa.weight", arch.kv_lora_rank + pos
            ),
            "self_attention.kv_layernorm.weight": rows(
                f"{attn}kv_a_layernorm.weight", arch.kv_lora_rank
            ),
            "self_attention.linear_kv_up_proj.weight": rows(
                f"{attn}kv_b_proj.weight", heads * (qk + arch.v_head_dim)
            ),
            "self_attention.linear_proj.weight": rows(f"{attn}o_proj.weight", h),
        }
        if arch.q_lora_rank is None:
            table["self_attention.linear_q_proj.weight"] = rows(
                f"{attn}q_proj.weight", heads * (qk + pos)
            )
        else:
            table["self_attention.linear_q_down_proj.weight"] = rows(
                f"{attn}q_a_proj.weight", arch.q_lora_rank
            )
            table["self_attention.q_layernorm.weight"] = rows(
                f"{attn}q_a_layernorm.weight", arch.q_lora_rank
            )
            table["self_attention.linear_q_up_proj.weight"] = rows(
                f"{attn}q_b_proj.weight", heads * (qk + pos)
            )
        table = {ours + name: source for name, source in table.items()}
        if not arch.is_moe_layer(layer):
            ffn = arch.ffn_hidden_size
            table[ours + "mlp.linear_fc1.weight"] = (
                Segment(f"{mlp}gate_proj.weight", 0, ffn),
                Segment(f"{mlp}up_proj.weight", 0, ffn),
            )
            table[ours + "mlp.linear_fc2.weight"] = rows(f"{mlp}down_proj.weight", h)
            return table
        projections = ("gate_proj", "up_proj", "down_proj")
        table.update(
            moe_mlp_sources(
                arch,
                layer,
                f"{mlp}gate.weight",
                mlp + "experts.{g}.",
                projections,
                shared=f"{mlp}shared_experts.",
            )
        )
        if arch.moe_router_enable_expert_bias:
            table[ours + "mlp.router.expert_bias"] = rows(
                f"{mlp}gate.e_score_correction_bias", arch.num_moe_experts
            )
        return table

    def check_keys(self, arch: HFArchitecture, keys: Iterable[str], where: str) -> None:
        last = arch.num_layers + (arch.mtp_num_layers or 0)
        extra = sorted(k for k in keys if (_layer_of(k) or 0) >= last)
        if extra:
            expected = (
                f"{arch.mtp_num_layers or 0} multi-token prediction layer(s) after them (as "
                "many as num_nextn_predict_layers declares, each with all its tensors)"
                if self.carries_mtp
                else "none (DeepSeek-V2 has no multi-token prediction layers)"
            )
            raise ValueError(
                f"{where}: tensors {extra[:3]}{' ...' if len(extra) > 3 else ''} are layers "
                f"after num_hidden_layers ({arch.num_layers}); expected {expected}"
            )


def _layer_of(key: str) -> Optional[int]:
    """The layer index of a ``model.layers.<L>.`` tensor name (None: another tensor)."""
    parts = key.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
        return int(parts[2])
    return None


def mtp_layers_in(keys: Iterable[str], num_layers: int) -> List[int]:
    """The layers after ``num_layers`` that a checkpoint's tensor names hold, sorted."""
    return sorted({layer for layer in map(_layer_of, keys) if (layer or 0) >= num_layers})


class DeepseekV3(DeepSeek):
    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    settings_hint = HINT + "sigmoid routing, expert bias and a shared expert (DeepSeek-V3)"

    def read_routing(self, c: ConfigReader, experts: int) -> Dict[str, Any]:
        c.expect("topk_method", "noaux_tc", "noaux_tc (DeepSeek-V3's)", default="noaux_tc")
        c.expect("scoring_func", "sigmoid", "sigmoid (DeepSeek-V3's)", default="sigmoid")
        norm = c.optional("norm_topk_prob", True)
        out = read_routing(c, experts, norm_topk_prob=bool(norm))
        topk = out["moe_router_topk"]
        c.require(
            norm is (topk > 1),
            "norm_topk_prob",
            norm,
            f"{str(topk > 1).lower()} with num_experts_per_tok {topk} (our sigmoid routing "
            "renormalizes the k weights exactly when k > 1)",
        )
        groups, group_topk = read_groups(c, experts, topk, per_group_best=2)
        return dict(
            out,
            moe_router_pre_softmax=False,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=groups,
            moe_router_group_topk=group_topk,
        )

    carries_mtp = True

    def read_mtp(self, c: ConfigReader) -> None:
        # transformers writes num_nextn_predict_layers (1 by default) whether or not the
        # checkpoint has the layers: the tensors decide (``mtp_layers``).
        for key in ("num_nextn_predict_layers", "num_mtp_layers"):
            c.expect(
                key, 0, "an integer >= 0", default=0, allow=lambda v: type(v) is int and v >= 0
            )

    def mtp_layers(
        self, arch: HFArchitecture, raw: Dict[str, Any], keys: Iterable[str], where: str
    ) -> Optional[int]:
        found = mtp_layers_in(keys, arch.num_layers)
        if not found:
            return None
        declared = raw.get("num_nextn_predict_layers") or 0
        expected = list(range(arch.num_layers, arch.num_layers + declared))
        if found != expected:
            raise ValueError(
                f"{where}: num_nextn_predict_layers={declared} is not supported with the "
                f"checkpoint's layers {found} after num_hidden_layers ({arch.num_layers}); "
                f"expected num_nextn_predict_layers={len(found)} with layers "
                f"{arch.num_layers}..{arch.num_layers + len(found) - 1} (DeepSeek-V3's "
                "multi-token prediction layers)"
            )
        if arch.num_moe_experts is None:
            raise ValueError(
                f"{where}: first_k_dense_replace={arch.num_layers} (every layer dense) is not "
                "supported with multi-token prediction layers (DeepSeek-V3's would be MoE "
                "layers, ours repeat the last layer's kind); expected a MoE last layer"
            )
        return declared

    def declared_mtp_layers(self, raw: Dict[str, Any]) -> Optional[int]:
        return raw.get("num_nextn_predict_layers") or None

    def write_routing(self, arch: HFArchitecture) -> Dict[str, Any]:
        if arch.moe_router_score_function != "sigmoid" or not arch.moe_router_enable_expert_bias:
            return {"scoring_func": arch.moe_router_score_function}  # refused on reading
        return {
            "n_group": arch.moe_router_num_groups or 1,
            "topk_group": arch.moe_router_group_topk or 1,
            "norm_topk_prob": arch.moe_router_topk > 1,
            "rope_interleave": True,
            "num_nextn_predict_layers": arch.mtp_num_layers or 0,
        }


class DeepseekV2(DeepSeek):
    model_type = "deepseek_v2"
    architecture = "DeepseekV2ForCausalLM"
    settings_hint = (
        HINT + "softmax routing (--moe-router-pre-softmax) and a shared expert (DeepSeek-V2 / "
        "V2-Lite)"
    )

    def read_routing(self, c: ConfigReader, experts: int) -> Dict[str, Any]:
        c.expect("scoring_func", "softmax", "softmax (DeepSeek-V2's)", default="softmax")
        c.expect("mlp_bias", False, "false (no biases)", default=False)
        c.expect(
            "norm_topk_prob",
            False,
            "false (transformers' DeepSeek-V2 never renormalizes the k weights)",
            default=False,
        )
        out = read_routing(c, experts, norm_topk_prob=False)
        method = c.optional("topk_method", "greedy")
        c.require(
            method in ("greedy", "group_limited_greedy"),
            "topk_method",
            method,
            "greedy or group_limited_greedy",
        )
        groups = group_topk = None
        if method == "group_limited_greedy":
            groups, group_topk = read_groups(c, experts, out["moe_router_topk"], 1)
        else:
            c.seen("n_group", "topk_group")
        return dict(out, moe_router_num_groups=groups, moe_router_group_topk=group_topk)

    def write_routing(self, arch: HFArchitecture) -> Dict[str, Any]:
        grouped = arch.moe_router_num_groups is not None
        out = {
            "topk_method": "group_limited_greedy" if grouped else "greedy",
            "n_group": arch.moe_router_num_groups,
            "topk_group": arch.moe_router_group_topk,
            "norm_topk_prob": not arch.moe_router_pre_softmax,
            "mlp_bias": False,
        }
        if arch.moe_router_score_function != "softmax" or arch.moe_router_enable_expert_bias:
            out["scoring_func"] = "sigmoid"  # refused on reading
        return out


FAMILY_V3 = DeepseekV3()
FAMILY_V2 = DeepseekV2()
