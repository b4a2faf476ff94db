"""GPT-2 (``GPT2LMHeadModel``): LayerNorm, learned positions, biases everywhere, tied
embeddings by default. Its attention and MLP weights are ``Conv1D`` ([in, out], the
transpose of a linear layer's), so their segments are column ranges (``transposed``);
``c_attn`` is [q; k; v] over all heads, which our per-head [q_h, k_h, v_h] rows interleave.
Files are written with and without the ``transformer.`` prefix.
"""

from typing import Any, Dict, Iterable, Optional

from megatron.training.hf.family import ConfigReader, Family, HFArchitecture, Segment, Source

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


class GPT2(Family):
    model_type = "gpt2"
    architecture = "GPT2LMHeadModel"
    settings_hint = "LayerNorm + gelu + learned positions + biases (GPT-2)"

    def read(self, c: ConfigReader) -> HFArchitecture:
        hidden = c.positive_int("n_embd")
        heads = c.positive_int("n_head")
        c.require(hidden % heads == 0, "n_head", heads, f"a divisor of n_embd ({hidden})")
        act = c.optional("activation_function", "gelu_new")
        c.require(act in ACTIVATIONS, "activation_function", act, f"one of {sorted(ACTIVATIONS)}")
        c.expect("scale_attn_weights", True, "true (scores scaled by 1/sqrt(head size))", True)
        c.expect("scale_attn_by_inverse_layer_idx", False, "false", default=False)
        c.expect("add_cross_attention", False, "false", default=False)
        c.seen("reorder_and_upcast_attn")  # numerics only (float32 attention scores)
        inner = c.optional("n_inner", None)
        inner = 4 * hidden if inner is None else inner
        c.require(
            isinstance(inner, int) and inner >= 1, "n_inner", inner, "a positive integer or null"
        )
        # every field of HFArchitecture, as llama.py fills it from its own key names
        return HFArchitecture(
            family=self.model_type,
            num_layers=c.positive_int("n_layer"),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=heads,
            kv_channels=hidden // heads,
            ffn_hidden_size=inner,
            vocab_size=c.positive_int("vocab_size"),
            normalization="LayerNorm",
            norm_epsilon=c.positive_float("layer_norm_epsilon", default=1e-5),
            swiglu=False,
            activation=ACTIVATIONS[act],
            position_embedding_type="learned_absolute",
            max_position_embeddings=c.positive_int("n_positions", default=1024),
            rotary_base=10000.0,
            rope_scaling_factor=None,
            add_bias_linear=True,
            add_qkv_bias=False,
            tied=bool(c.optional("tie_word_embeddings", True)),
            dtype=c.dtype(),
        )

    def write(self, arch: HFArchitecture) -> Dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "activation_function": {"gelu_tanh": "gelu_new", "gelu": "gelu"}[arch.activation],
            "n_embd": arch.hidden_size,
            "n_head": arch.num_attention_heads,
            "n_inner": arch.ffn_hidden_size,
            "n_layer": arch.num_layers,
            "n_positions": arch.max_position_embeddings,
            "layer_norm_epsilon": arch.norm_epsilon,
            "vocab_size": arch.vocab_size,
            "tie_word_embeddings": arch.tied,
            "scale_attn_weights": True,
            "attn_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "resid_pdrop": 0.0,
        }

    def key_prefix(self, keys: Iterable[str]) -> Optional[str]:
        return "" if "wte.weight" in set(keys) else None

    def global_sources(self, arch: HFArchitecture, prefix: Optional[str]) -> Dict[str, Source]:
        h, v = arch.hidden_size, arch.vocab_size
        p = "transformer." if prefix is None else prefix
        out = {
            "embedding.word_embeddings.weight": (Segment(f"{p}wte.weight", 0, v),),
            "embedding.position_embeddings.weight": (
                Segment(f"{p}wpe.weight", 0, arch.max_position_embeddings),
            ),
            "decoder.final_layernorm.weight": (Segment(f"{p}ln_f.weight", 0, h),),
            "decoder.final_layernorm.bias": (Segment(f"{p}ln_f.bias", 0, h),),
        }
        if not arch.tied:
            out["output_layer.weight"] = (Segment("lm_head.weight", 0, v),)
        return out

    def layer_sources(
        self, arch: HFArchitecture, layer: int, prefix: Optional[str]
    ) -> Dict[str, Source]:
        h, d, ffn, heads = (
            arch.hidden_size,
            arch.kv_channels,
            arch.ffn_hidden_size,
            arch.num_attention_heads,
        )
        p = f"{'transformer.' if prefix is None else prefix}h.{layer}."

        def qkv(kind: str, transposed: bool) -> Source:
            key = f"{p}attn.c_attn.{kind}"
            return tuple(
                Segment(key, part * h + head * d, part * h + (head + 1) * d, transposed)
                for head in range(heads)
                for part in range(3)
            )

        table = {
            "input_layernorm.weight": (Segment(f"{p}ln_1.weight", 0, h),),
            "input_layernorm.bias": (Segment(f"{p}ln_1.bias", 0, h),),
            "self_attention.linear_qkv.weight": qkv("weight", True),
            "self_attention.linear_qkv.bias": qkv("bias", False),
            "self_attention.linear_proj.weight": (Segment(f"{p}attn.c_proj.weight", 0, h, True),),
            "self_attention.linear_proj.bias": (Segment(f"{p}attn.c_proj.bias", 0, h),),
            "pre_mlp_layernorm.weight": (Segment(f"{p}ln_2.weight", 0, h),),
            "pre_mlp_layernorm.bias": (Segment(f"{p}ln_2.bias", 0, h),),
            "mlp.linear_fc1.weight": (Segment(f"{p}mlp.c_fc.weight", 0, ffn, True),),
            "mlp.linear_fc1.bias": (Segment(f"{p}mlp.c_fc.bias", 0, ffn),),
            "mlp.linear_fc2.weight": (Segment(f"{p}mlp.c_proj.weight", 0, h, True),),
            "mlp.linear_fc2.bias": (Segment(f"{p}mlp.c_proj.bias", 0, h),),
        }
        return {f"decoder.layers.{layer}.{name}": source for name, source in table.items()}


FAMILY = GPT2()
