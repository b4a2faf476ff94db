"""Multi-latent attention against transformers' DeepseekV3ForCausalLM (dense layers), float64:
logits, loss and every gradient, at one process and at TP 2 (with and without SP); the
negative control: the shared rope key's gradient not summed over TP fails at TP 2."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import MLATransformerConfig

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 32, 16, 4, 2, 8
YARN = dict(
    factor=4.0,
    original_max_position_embeddings=8,
    beta_fast=8.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=0.8,
)


def _rms_norm_float64(self, hidden_states):
    """transformers' DeepseekV3RMSNorm without its float32 step (its input dtype kept)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)


def _hf_model(rope_type: str, q_lora_rank):
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, **YARN}
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=24,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=6,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=6,
        first_k_dense_replace=LAYERS,
        rms_norm_eps=1e-6,
        max_position_embeddings=32,
        rope_parameters=rope,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    config._attn_implementation = "sdpa"  # eager: softmax in float32
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).double()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)  # norms too: any weight mapped wrongly shows
    return model


def _config(rope_type: str, q_lora_rank, tp: int = 1, sp: bool = False, **extra):
    rope = dict(
        rotary_scaling_factor=YARN["factor"],
        beta_fast=YARN["beta_fast"],
        beta_slow=YARN["beta_slow"],
        mscale=YARN["mscale"],
        mscale_all_dim=YARN["mscale_all_dim"],
        original_max_position_embeddings=YARN["original_max_position_embeddings"],
    )
    return MLATransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=24,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=6,
        qk_head_dim=4,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
        rope_type=rope_type,
        rotary_base=10000,
        layernorm_epsilon=1e-6,
        normalization="RMSNorm",
        qk_layernorm=True,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float64,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        **rope,
        **extra,
    )


def _mapping(layer: int, q_lora_rank) -> dict:
    """Our parameter name -> (HF name, TP split dim or None)."""
    ours, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    attn = {
        "linear_kv_down_proj.weight": ("kv_a_proj_with_mqa.weight", None),
        "kv_layernorm.weight": ("kv_a_layernorm.weight", None),
        "linear_kv_up_proj.weight": ("kv_b_proj.weight", 0),
        "linear_proj.weight": ("o_proj.weight", 1),
    }
    if q_lora_rank is None:
        attn["linear_q_proj.weight"] = ("q_proj.weight", 0)
    else:
        attn["linear_q_down_proj.weight"] = ("q_a_proj.weight", None)
        attn["q_layernorm.weight"] = ("q_a_layernorm.weight", None)
        attn["linear_q_up_proj.weight"] = ("q_b_proj.weight", 0)
    names = {ours + "self_attention." + k: (hf + "self_attn." + v, d) for k, (v, d) in attn.items()}
    names[ours + "input_layernorm.weight"] = (hf + "input_layernorm.weight", None)
    names[ours + "pre_mlp_layernorm.weight"] = (hf + "post_attention_layernorm.weight", None)
    names[ours + "mlp.linear_fc2.weight"] = (hf + "mlp.down_proj.weight", 1)
    return names


def _load(model: GPTModel, hf, q_lora_rank, tp: int, rank: int) -> dict:
    """Copy HF's weights into ``model`` (this TP rank's shards); our name -> HF tensor."""
    hf_params = dict(hf.named_parameters())
    names = {
        "embedding.word_embeddings.weight": ("model.embed_tokens.weight", 0),
        "decoder.final_layernorm.weight": ("model.norm.weight", None),
        "output_layer.weight": ("lm_head.weight", 0),
    }
    for layer in range(LAYERS):
        names.update(_mapping(layer, q_lora_rank))
    ours = dict(model.named_parameters())
    pairs = {}
    with torch.no_grad():
        for name, (hf_name, dim) in names.items():
            pairs[name] = (hf_params[hf_name], dim)
            full = hf_params[hf_name].detach()
            ours[name].copy_(full if dim is None else full.chunk(tp, dim)[rank])
        for layer in range(LAYERS):  # fc1 = [gate; up], each split over TP
            mlp = f"model.layers.{layer}.mlp."
            gate, up = hf_params[mlp + "gate_proj.weight"], hf_params[mlp + "up_proj.weight"]
            fc1 = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
            ours[f"decoder.layers.{layer}.mlp.linear_fc1.weight"].copy_(fc1)
            pairs[f"decoder.layers.{layer}.mlp.linear_fc1.weight"] = ((gate, up), "fc1")
    assert set(pairs) == set(ours), set(ours) ^ set(pairs)
    return pairs


def _expected_grad(hf_param, dim, tp: int, rank: int) -> torch.Tensor:
    if dim == "fc1":
        gate, up = hf_param
        return torch.cat([gate.grad.chunk(tp)[rank], up.grad.chunk(tp)[rank]])
    return hf_param.grad if dim is None else hf_param.grad.chunk(tp, dim)[rank]


def _run(rope_type, q_lora_rank, tp=1, sp=False, pg_collection=None, rank=0):
    """(our logits [b, s, v_local], HF logits, our loss, HF loss, grad mismatches)."""
    hf = _hf_model(rope_type, q_lora_rank)
    config = _config(rope_type, q_lora_rank, tp, sp)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
    model = GPTModel(
        config, spec, VOCAB, 32, position_embedding_type="rope", pg_collection=pg_collection
    )
    pairs = _load(model, hf, q_lora_rank, tp, rank)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, 1)
    modeling = transformers.models.deepseek_v3.modeling_deepseek_v3
    with mock.patch.object(modeling.DeepseekV3RMSNorm, "forward", _rms_norm_float64):
        out = hf(input_ids=tokens)
    hf_loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1))
    hf_loss.backward()
    with torch.no_grad():
        logits = model(tokens, None, None)  # [b, s, v / tp]
    loss = model(tokens, None, None, labels=labels).mean()
    loss.backward()
    if tp > 1:  # what finalize_model_grads does: sum the sequence-parallel marked over TP
        for p in model.parameters():
            if getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=pg_collection.tp)
    bad = []
    for name, param in model.named_parameters():
        expected = _expected_grad(*pairs[name], tp, rank)
        err = (param.grad - expected).abs().max().item() / expected.abs().max().item()
        if err > 1e-10:
            bad.append(f"{name}: {err:.2e}")
    return logits, out.logits, loss, hf_loss, bad


@pytest.mark.world(1)
@pytest.mark.parametrize("rope_type,q_lora_rank", [("rope", 8), ("yarn", 8), ("yarn", None)])
def test_mla_matches_deepseek_v3(rope_type, q_lora_rank):
    """Logits, loss and every gradient equal transformers' in float64."""
    logits, hf_logits, loss, hf_loss, bad = _run(rope_type, q_lora_rank)
    torch.testing.assert_close(logits, hf_logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, hf_loss, rtol=1e-12, atol=1e-12)
    assert not bad, bad
