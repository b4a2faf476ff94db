"""GPT-OSS (``GptOssForCausalLM``) against ``transformers`` itself, one process, float64.

A tiny random GPT-OSS (2 layers: sliding window 5 then full attention, 4 experts top-2,
YaRN with truncate false, a small ``swiglu_limit`` so that the clamps act, random sinks,
router bias and every bias) is saved by transformers; ``model_from_hf`` builds ours in
float64. Logits, the loss and every parameter's gradient (ours written back in HuggingFace's
layout by the family's table) equal transformers' float64 ones; negative controls show the
check catches the sinks or the clamp left out. Import then export gives back the original
tensors bit for bit, and a model our trainer's options describe exports as GPT-OSS.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.training.hf import model_from_hf
from megatron.training.hf.__main__ import main as hf_cli
from megatron.training.hf.config import hf_config_of_settings, read_hf_config
from megatron.training.hf.weights import (
    SafetensorsReader,
    hf_shapes,
    our_full_shapes,
    parameter_sources,
    scatter_to_hf,
)
from tests.unit_tests.dist_utils import rel_error
from tests.unit_tests.hf.hf_models import HAVE_TRANSFORMERS, SKIP_REASON, VOCAB, token_ids

pytestmark = [
    pytest.mark.world(1),
    pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=SKIP_REASON),
]

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=5,
    swiglu_limit=0.4,
    initializer_range=0.1,
    max_position_embeddings=256,
    rope_parameters=dict(
        rope_type="yarn",
        factor=4.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=16,
        rope_theta=150000.0,
    ),
)


def build_gpt_oss(directory, seed: int = 0, **overrides):
    """Save a tiny random GPT-OSS under ``directory`` (float32 values); returns the path."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG, **overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.0)
            elif "router" in name:  # clear margins between the experts
                param.normal_(0.0, 0.5)
            elif "bias" in name:
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return build_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "model")


def _rms_norm_in_input_dtype(self, hidden_states):
    """transformers' GptOssRMSNorm without its float32 round trip (a precision choice,
    not the model's maths): the float64 oracle stays float64."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(autouse=True)
def float64_norms(monkeypatch):
    from transformers.models.gpt_oss import modeling_gpt_oss

    monkeypatch.setattr(modeling_gpt_oss.GptOssRMSNorm, "forward", _rms_norm_in_input_dtype)


def transformers_float64(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, experts_implementation="eager"
    )
    return model.eval()


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of [b, s, V] logits."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def ours_and_theirs(path, ids, **overrides):
    """(our logits, loss, gradients in HF names; transformers' logits, loss, gradients)."""
    theirs = transformers_float64(path)
    their_logits = theirs(ids).logits
    their_loss = loss_of(their_logits, ids)
    their_loss.backward()
    their_grads = {n: p.grad for n, p in theirs.named_parameters()}
    model, _ = model_from_hf(path, params_dtype=torch.float64, **overrides)
    grouped = any(name.endswith("experts.bias1") for name, _ in model.named_parameters())
    assert grouped == bool(overrides.get("moe_grouped_gemm"))
    model.train()
    logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids))
    loss = loss_of(logits, ids)
    loss.backward()
    arch, _ = read_hf_config(path)
    sources = parameter_sources(arch)
    shapes = hf_shapes(arch, sources, our_full_shapes(arch))
    ours = {n: p.grad for n, p in model.named_parameters()}
    ours.update(_sequential_names(model))
    grads = scatter_to_hf({n: g for n, g in ours.items() if n in sources}, sources, shapes)
    return (logits, loss, grads), (their_logits, their_loss, their_grads)


def _sequential_names(model) -> dict:
    """GroupedMLP's expert gradients under SequentialMLP's (the table's) names."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "expert_w1") and module.weight1.grad is not None:
            for i in range(module.num_local_experts):
                g = f"{name}.local_experts.{module.first_expert + i}."
                w1 = module.weight1.grad.view(module.expert_w1().shape)[i].t()
                w2 = module.weight2.grad.view(module.expert_w2().shape)[i].t()
                out[g + "linear_fc1.weight"], out[g + "linear_fc2.weight"] = w1, w2
                out[g + "linear_fc1.bias"] = module.bias1.grad[i]
                out[g + "linear_fc2.bias"] = module.bias2.grad[i]
    return out


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_logits_loss_and_every_gradient_equal_transformers_in_float64(gpt_oss, grouped):
    ids = token_ids()
    extra = {"moe_grouped_gemm": True} if grouped else {}
    (logits, loss, grads), (their_logits, their_loss, their_grads) = ours_and_theirs(
        gpt_oss, ids, **extra
    )
    assert rel_error(logits, their_logits) <= 1e-12
    assert abs(loss.item() - their_loss.item()) <= 1e-12 * abs(their_loss.item())
    assert sorted(grads) == sorted(their_grads)
    errors = {k: rel_error(grads[k], their_grads[k]) for k in grads}
    assert max(errors.values()) <= 1e-10, {k: f"{e:.1e}" for k, e in errors.items() if e > 1e-10}


def _logit_error(path, ids) -> float:
    theirs = transformers_float64(path)
    model, _ = model_from_hf(path, params_dtype=torch.float64)
    with torch.no_grad():
        ours = model(ids, torch.arange(ids.shape[1]).expand_as(ids))
        return rel_error(ours, theirs(ids).logits)


def test_negative_control_sinks_left_out_are_caught(gpt_oss, monkeypatch):
    forward = DotProductAttention.forward

    def without_sinks(self, *args, **kwargs):
        sinks, self.softmax_offset = self.softmax_offset, None
        try:
            return forward(self, *args, **kwargs)
        finally:
            self.softmax_offset = sinks

    monkeypatch.setattr(DotProductAttention, "forward", without_sinks)
    assert _logit_error(gpt_oss, token_ids()) > 1e-3


def test_negative_control_clamp_left_out_is_caught(gpt_oss, monkeypatch):

    def unclamped(config, hidden):
        gate, up = hidden.chunk(2, dim=-1)
        return config.activation_func(gate) * (up + config.glu_linear_offset)

    monkeypatch.setattr("megatron.core.transformer.moe.experts.gated_unit", unclamped)
    assert _logit_error(gpt_oss, token_ids()) > 1e-3


def test_negative_control_every_layer_windowed_is_caught(gpt_oss, monkeypatch):
    """The full-attention layer of ``layer_types`` kept windowed: the logits differ."""
    monkeypatch.setattr(
        "megatron.core.transformer.dot_product_attention.layer_window_size",
        lambda window, freq, layer: window,
    )
    assert _logit_error(gpt_oss, token_ids()) > 1e-3


def test_a_checkpoint_of_sequential_experts_loads_into_grouped_ones(gpt_oss, tmp_path):
    """Expert biases on megatron-core's global expert axis: the same entries from
    ``SequentialMLP`` and ``GroupedMLP``."""
    from megatron.core import dist_checkpointing

    sequential, _ = model_from_hf(gpt_oss, params_dtype=torch.float64)
    dist_checkpointing.save(sequential.sharded_state_dict(), str(tmp_path))
    grouped, _ = model_from_hf(gpt_oss, params_dtype=torch.float64, moe_grouped_gemm=True)
    with torch.no_grad():
        for param in grouped.parameters():
            param.zero_()
    grouped.load_state_dict(dist_checkpointing.load(grouped.sharded_state_dict(), str(tmp_path)))
    ids = token_ids()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        assert rel_error(grouped(ids, positions), sequential(ids, positions)) <= 1e-12


def test_the_released_config_keys_are_read():
    """gpt-oss-20b's config.json shape (transformers 4's rope_scaling and rope_theta, the
    legacy experts_per_token and initial_context_length, 24 alternating layers), dequantized."""
    from megatron.training.hf import architecture_from_config

    layers = ["sliding_attention", "full_attention"] * 12
    released = dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=True,
        attention_dropout=0.0, eos_token_id=200002, experts_per_token=4, head_dim=64,
        hidden_act="silu", hidden_size=2880, initial_context_length=4096,
        initializer_range=0.02, intermediate_size=2880, layer_types=layers,
        max_position_embeddings=131072, num_attention_heads=64, num_experts_per_tok=4,
        num_hidden_layers=24, num_key_value_heads=8, num_local_experts=32,
        output_router_logits=False, pad_token_id=199999, rms_norm_eps=1e-05,
        rope_scaling=dict(beta_fast=32.0, beta_slow=1.0, factor=32.0,
                          original_max_position_embeddings=4096, rope_type="yarn",
                          truncate=False),
        rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0,
        tie_word_embeddings=False, transformers_version="4.55.0.dev0", use_cache=True,
        vocab_size=201088,
    )  # fmt: skip
    arch = architecture_from_config(released)
    assert (arch.window_size, arch.window_attn_skip_freq[:2]) == ((127, 0), (1, 0))
    assert (arch.rotary_scaling_factor, arch.no_yarn_correction_range_round_to_int) == (32.0, True)
    assert (arch.num_moe_experts, arch.moe_router_topk, arch.activation_func_clamp_value) == (
        32, 4, 7.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="experts_per_token=2 .* num_experts_per_tok"):
        architecture_from_config(dict(released, experts_per_token=2))


def test_an_mxfp4_checkpoint_is_refused_with_how_to_dequantize_it():
    from megatron.training.hf import architecture_from_config
    from tests.unit_tests.hf.test_hf_refusals import BASE

    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with pytest.raises(ValueError, match=r"quantization_config=.*Mxfp4Config\(dequantize=True\)"):
        architecture_from_config({**BASE["gpt_oss"], "quantization_config": mxfp4})


def test_import_export_gives_back_the_original_tensors(gpt_oss, tmp_path):
    assert hf_cli(["import", "--hf", str(gpt_oss), "--out", str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "hf"
    assert hf_cli(["export", "--load", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    original, exported = SafetensorsReader(gpt_oss), SafetensorsReader(out)
    assert sorted(original.keys()) == sorted(exported.keys())
    for key in original.keys():
        everything = (slice(None),) * len(original.shape(key))
        a, b = original.read(key, everything), exported.read(key, everything)
        assert a.dtype == b.dtype and torch.equal(a, b), key


GPT_OSS_SETTINGS = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
    vocab_size=VOCAB, normalization="RMSNorm", norm_epsilon=1e-5, quick_geglu=True,
    glu_linear_offset=1.0, activation_func_clamp_value=7.0, softmax_type="learnable",
    window_size=[4, 0], window_attn_skip_freq=2, position_embedding_type="yarn",
    rotary_base=150000.0, rotary_scaling_factor=32.0, yarn_original_max_position_embeddings=4096,
    yarn_beta_fast=32.0, yarn_beta_slow=1.0, no_yarn_correction_range_round_to_int=True,
    untie_embeddings_and_output_weights=True, num_experts=4, moe_ffn_hidden_size=24,
    moe_router_topk=2,
)  # fmt: skip


def test_a_model_of_the_trainers_gpt_oss_flags_writes_a_gpt_oss_config():
    config = hf_config_of_settings(GPT_OSS_SETTINGS)
    assert config["model_type"] == "gpt_oss"
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["sliding_window"] == 5 and config["swiglu_limit"] == 7.0
    assert config["rope_parameters"]["truncate"] is False
    without_sinks = dict(GPT_OSS_SETTINGS, softmax_type="vanilla")
    with pytest.raises(ValueError, match="matches no HuggingFace family"):
        hf_config_of_settings(without_sinks)


@pytest.mark.slow
def test_a_model_trained_from_scratch_exports_as_gpt_oss(tmp_path):
    """--export-hf of a run with the GPT-OSS flags (no HuggingFace start): transformers loads
    the written GPT-OSS and computes what our model computes."""
    from megatron.training import TrainingConfig
    from megatron.training.training import pretrain
    from tests.unit_tests.dist_utils import fresh_layout

    out = tmp_path / "exported"
    settings = {k: v for k, v in GPT_OSS_SETTINGS.items() if k != "num_layers"}
    config = TrainingConfig(
        num_layers=2, seq_length=16, global_batch_size=4, train_iters=1, progress=False,
        export_hf=str(out), **settings,
    )  # fmt: skip
    with fresh_layout():
        pretrain(config)
    import json

    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt_oss"
    ids = token_ids() % config.vocab_size
    model, _ = model_from_hf(out, params_dtype=torch.float64)
    with torch.no_grad():
        ours = model(ids, torch.arange(ids.shape[1]).expand_as(ids))
        assert rel_error(ours, transformers_float64(out)(ids).logits) <= 1e-12


def test_the_cached_forward_and_greedy_generation_equal_the_full_forward_and_transformers(
    gpt_oss,
):
    """megatron.training.generate's cached forward (sinks, the sliding window of the first
    layer over a 12-token sequence: prompt, a chunk, single tokens) gives the full forward's
    logits, and greedy tokens are transformers' ``generate``'s."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.training.generate import generate

    model, _ = model_from_hf(gpt_oss, params_dtype=torch.float64)
    model.eval()
    ids = token_ids()[:1, :12]
    with torch.no_grad():
        full = model(ids, torch.arange(12)[None])
        context, steps = StaticInferenceContext(1, 12), []
        for start, stop in [(0, 6), (6, 9)] + [(i, i + 1) for i in range(9, 12)]:
            steps.append(model(ids[:, start:stop], torch.arange(start, stop)[None],
                               inference_context=context))  # fmt: skip
            context.increment_sequence_len_offset(stop - start)
    assert rel_error(torch.cat(steps, dim=1), full) <= 1e-12
    prompt = ids[0, :6].tolist()
    ours = generate([model], prompt, 6, vocab_size=VOCAB)
    with torch.no_grad():
        out = transformers_float64(gpt_oss).generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=6, min_new_tokens=6,
            output_scores=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    margins = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
    assert min(margins) > 1e-6, f"a near tie makes the comparison meaningless: {margins}"
    assert ours == out.sequences[0, 6:].tolist()


def test_static_decoding_steps_equal_the_full_forward(gpt_oss):
    """The decoding step of static shapes that ``--enable-cuda-graph`` captures
    (``enable_static_decode``), run eagerly: with the sinks, and the first layer's window of
    5 over 12 tokens in a cache of 24 (masked past the offset and before the window), one
    token per forward after the prompt gives the full forward's logits (float64)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    model, _ = model_from_hf(gpt_oss, params_dtype=torch.float64)
    model.eval()
    ids = token_ids()[:1, :12]
    with torch.no_grad():
        full = model(ids, torch.arange(12)[None])
        context = StaticInferenceContext(1, 24)
        steps = [model(ids[:, :6], torch.arange(6)[None], inference_context=context)]
        context.increment_sequence_len_offset(6)
        context.enable_static_decode(torch.device("cpu"))
        for i in range(6, 12):
            steps.append(model(ids[:, i : i + 1], torch.tensor([[i]]), inference_context=context))
            context.increment_sequence_len_offset(1)
    assert rel_error(torch.cat(steps, dim=1), full) <= 1e-12


@pytest.mark.slow
def test_a_lora_run_exports_a_peft_adapter_and_a_merged_gpt_oss(tmp_path):
    """LoRA on the attention (the experts excluded) from --hf-model: the PEFT adapter on
    transformers' GPT-OSS and the merged export give our trained model's logits."""
    pytest.importorskip("peft", reason="peft is a test extra (pip install -e .[dev])")
    from peft import PeftModel

    from megatron.core import dist_checkpointing
    from megatron.core.transformer.lora import LoRAConfig, apply_lora
    from megatron.training import TrainingConfig
    from megatron.training.checkpointing import checkpoint_dir
    from megatron.training.training import pretrain
    from tests.unit_tests.dist_utils import fresh_layout
    from tests.unit_tests.hf.hf_models import transformers_logits

    base = build_gpt_oss(tmp_path / "base")
    ckpt, adapter, merged = tmp_path / "ckpt", tmp_path / "adapter", tmp_path / "merged"
    lora = dict(lora_dim=4, lora_alpha=8.0, lora_b_init_method="normal")
    with fresh_layout():
        result = pretrain(TrainingConfig(
            hf_model=str(base), seq_length=16, global_batch_size=4, micro_batch_size=2,
            train_iters=2, lr=0.05, progress=False, save=str(ckpt), export_hf=str(adapter),
            lora_exclude_modules=["*.experts.*"], **lora,
        ))  # fmt: skip
    assert result.passed
    model, _ = model_from_hf(base)
    apply_lora(model, LoRAConfig(dim=4, alpha=8.0, exclude_modules=("*.experts.*",)))
    state = model.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": state}, str(checkpoint_dir(str(ckpt), 2)))
    model.load_state_dict(loaded["model"])
    model.eval()
    ids = token_ids()
    with torch.no_grad():
        ours = model(ids, torch.arange(ids.shape[1]).expand_as(ids))
        import transformers

        peft = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft = PeftModel.from_pretrained(peft, adapter).eval()
        assert rel_error(peft(input_ids=ids).logits, ours) <= 1e-5
    assert hf_cli(["export", "--load", str(ckpt), "--out", str(merged), "--merge-lora"]) == 0
    assert rel_error(transformers_logits(merged, ids), ours) <= 1e-5
    assert rel_error(transformers_logits(base, ids), ours) > 1e-4  # the adapters changed it
