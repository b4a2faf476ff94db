"""DeepSeek-V3 / V2 through the HuggingFace family module (``hf/families/deepseek.py``) against
transformers itself, float64, one process: a tiny V3 (q LoRA, yarn, a dense first layer, MoE
layer with sigmoid routing, expert bias, group-limited top-k, routed scaling, shared experts)
and a V2-Lite-shaped V2 (no q LoRA, softmax routing; greedy and group-limited greedy): logits,
loss, every gradient, and the expert-bias update of a step (``finalize_model_grads``) equal
transformers' (its float32 steps recompiled in float64). Import then export gives back the
original tensors bit for bit. Configs we cannot express are refused by name."""

import inspect
import json
import textwrap
from unittest import mock

import pytest
import torch

from megatron.core.distributed import finalize_model_grads
from megatron.training.hf import model_from_hf
from megatron.training.hf.config import read_hf_config
from megatron.training.hf.weights import SafetensorsReader, parameter_sources
from tests.unit_tests.hf.hf_models import HAVE_TRANSFORMERS, SKIP_REASON

pytestmark = [
    pytest.mark.world(1),
    pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=SKIP_REASON),
]
VOCAB, SEQ = 32, 8
YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
    beta_fast=8.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8,
)  # fmt: skip
BASE = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=6,
    qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=1,
    n_routed_experts=8, n_shared_experts=2, max_position_embeddings=32, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)  # fmt: skip
CONFIGS = {
    # 4 groups of 2, the best 2 groups, top 4 (= 2 x topk_group: groups scored by their best 2)
    "v3": ("DeepseekV3", dict(BASE, q_lora_rank=12, num_experts_per_tok=4, n_group=4,
                              topk_group=2, routed_scaling_factor=2.5, rope_parameters=YARN)),
    "v2_lite": ("DeepseekV2", dict(BASE, q_lora_rank=None, num_experts_per_tok=2,
                                   routed_scaling_factor=1.5, topk_method="greedy")),
    # group-limited greedy: 4 groups, top 2 of the best 2 groups (one expert per group)
    "v2_grouped": ("DeepseekV2", dict(BASE, q_lora_rank=None, num_experts_per_tok=2,
                                      topk_method="group_limited_greedy", n_group=4,
                                      topk_group=2, rope_parameters=YARN)),
}  # fmt: skip


def _float64(fn, module, float64: bool = True):
    """transformers' ``fn`` recompiled from its source with its float32 steps in float64
    (``float64`` False: only V2's complex rope table built from float32 cos and sin, as ours,
    instead of ``torch.polar``'s own float32 trigonometry, which differs by an ulp)."""
    source = textwrap.dedent(inspect.getsource(fn))
    source = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("@"))
    if float64:
        source = source.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    polar = "torch.polar(torch.ones_like(freqs), freqs)"
    source = source.replace(polar, "torch.complex(freqs.cos(), freqs.sin())")
    namespace: dict = {}
    exec(compile(source, f"<float64 {fn.__qualname__}>", "exec"), vars(module), namespace)
    return namespace[fn.__name__]


def _patches(name: str):
    """transformers' RMSNorm, router and (V2) rope rotation in float64."""
    import transformers

    prefix, _ = CONFIGS[name]
    version = prefix[-2:].lower()
    module = getattr(transformers.models, f"deepseek_{version}").__dict__[
        f"modeling_deepseek_{version}"
    ]
    norm, router = getattr(module, f"{prefix}RMSNorm"), getattr(module, f"{prefix}TopkRouter")
    patches = [
        mock.patch.object(norm, "forward", _float64(norm.forward, module)),
        mock.patch.object(router, "forward", _float64(router.forward, module)),
    ]
    if version == "v2":
        rotate = _float64(module.apply_rotary_emb, module)
        patches.append(mock.patch.object(module, "apply_rotary_emb", rotate))
        rope = module.DeepseekV2RotaryEmbedding
        table = _float64(rope.forward, module, float64=False)
        patches.append(mock.patch.object(rope, "forward", table))
    return patches, router


def _build(name: str, directory):
    """The saved tiny model (float32 values, random norms, router and expert bias) and its
    transformers copy in float64."""
    import transformers

    prefix, kwargs = CONFIGS[name]
    config = getattr(transformers, f"{prefix}Config")(**kwargs)
    config._attn_implementation = "sdpa"  # eager: softmax in float32
    config._experts_implementation = "eager"  # grouped_mm: no float64
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.normal_(0.0, 1.0 if "gate.weight" in pname else 0.3)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return model.double()


def _batch():
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, SEQ, dtype=torch.float64)
    mask[0, :3] = 0
    return tokens, torch.roll(tokens, -1, 1), mask


def hf_grad(hf_params: dict, key: str) -> torch.Tensor:
    """The gradient of checkpoint tensor ``key`` (experts are one fused tensor in memory)."""
    if key in hf_params:
        return hf_params[key].grad
    head, expert, proj = key.rsplit(".", 3)[0], int(key.split(".")[-3]), key.split(".")[-2]
    if proj == "down_proj":
        return hf_params[f"{head}.down_proj"].grad[expert]
    gate_up = hf_params[f"{head}.gate_up_proj"].grad[expert]
    return gate_up.chunk(2)[0 if proj == "gate_proj" else 1]


def hf_reference(name: str, directory, mask=None):
    """transformers' step on the tiny model ``name`` saved in ``directory`` (float64): (its
    logits, its masked mean loss with the backward run, the model, the experts its router
    chose per MoE layer [T, k])."""
    hf = _build(name, directory)
    tokens, labels, default_mask = _batch()
    mask = default_mask if mask is None else mask
    patches, router = _patches(name)
    chosen = []
    original = router.forward

    for patch in patches:
        patch.start()
    try:
        patched = router.forward

        def recording(self, hidden_states):
            out = patched(self, hidden_states)
            chosen.append(out[2].detach())
            return out

        with mock.patch.object(router, "forward", recording):
            out = hf(input_ids=tokens)
    finally:
        for patch in reversed(patches):
            patch.stop()
    assert router.forward is original
    per_token = torch.nn.functional.cross_entropy(
        out.logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none"
    )
    hf_loss = (per_token * mask.reshape(-1)).sum() / mask.sum()
    hf_loss.backward()
    return out.logits.detach(), hf_loss, hf, chosen


def _run(name: str, directory):
    """(our logits, loss, model; HF logits, loss, model, HF routed indices per layer)."""
    reference = hf_reference(name, directory)
    tokens, labels, mask = _batch()
    ours, config = model_from_hf(directory, params_dtype=torch.float64)
    ours.train()
    with torch.no_grad():
        logits = ours(tokens, None, None)
    loss = (ours(tokens, None, None, labels=labels) * mask).sum() / mask.sum()
    loss.backward()
    return (logits, loss, ours, config), reference


def expected_bias(bias: torch.Tensor, chosen: torch.Tensor, rate: float) -> torch.Tensor:
    """The expert bias after a step whose routed experts were ``chosen`` [T, k]."""
    counts = torch.bincount(chosen.reshape(-1), minlength=bias.numel()).to(bias.dtype)
    return bias + rate * torch.sign(counts.mean() - counts)


def _gradient_errors(ours, hf, directory) -> dict:
    """Our parameter name -> max relative error of its gradient against transformers'."""
    arch, _ = read_hf_config(directory)
    sources = parameter_sources(arch)
    hf_params = dict(hf.named_parameters())
    errors = {}
    for pname, param in ours.named_parameters():
        expected = torch.cat([hf_grad(hf_params, seg.key)[seg.start : seg.stop]
                              for seg in sources[pname]])  # fmt: skip
        err = (param.grad - expected).abs().max() / expected.abs().max().clamp(min=1e-300)
        errors[pname] = err.item()
    return errors


@pytest.mark.parametrize("name", list(CONFIGS))
def test_deepseek_matches_transformers_in_float64(name, tmp_path):
    """Logits, loss, every gradient and the expert-bias update equal transformers'."""
    (logits, loss, ours, config), (hf_logits, hf_loss, hf, chosen) = _run(name, tmp_path)
    torch.testing.assert_close(logits, hf_logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, hf_loss, rtol=1e-12, atol=1e-12)
    errors = _gradient_errors(ours, hf, tmp_path)
    assert max(errors.values()) < 1e-10, {k: v for k, v in errors.items() if v >= 1e-10}
    assert any("router" in k for k in errors) and any("linear_q" in k for k in errors)
    if name != "v3":
        return
    router = ours.decoder.layers[1].mlp.router
    before = router.expert_bias.clone()
    expected = expected_bias(before, chosen[0], config.moe_router_bias_update_rate)
    finalize_model_grads([_Chunk(ours)])
    assert torch.equal(router.expert_bias, expected)
    assert not torch.equal(expected, before)


class _Chunk(torch.nn.Module):
    """A bare chunk for ``finalize_model_grads`` (no DDP: nothing to synchronize)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = module.config

    def finish_grad_sync(self, force_all_reduce=False):
        pass


def test_import_export_gives_back_the_original_tensors(tmp_path):
    from megatron.training.hf.__main__ import main as hf_cli

    _build("v3", tmp_path / "v3")
    assert hf_cli(["import", "--hf", str(tmp_path / "v3"), "--out", str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "hf"
    assert hf_cli(["export", "--load", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    original, exported = SafetensorsReader(tmp_path / "v3"), SafetensorsReader(out)
    assert sorted(original.keys()) == sorted(exported.keys())
    for key in original.keys():
        everything = (slice(None),) * len(original.shape(key))
        a, b = original.read(key, everything), exported.read(key, everything)
        assert a.dtype == b.dtype and torch.equal(a, b), key
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"


def test_generate_with_multi_latent_attention_takes_transformers_greedy_tokens(tmp_path):
    """``megatron.training.generate`` on an MLA model (with its key/value cache: the prompt in
    one forward, then one token per forward) picks, at every step, the token transformers'
    float64 forward of the same sequence ranks first, each by a margin rounding cannot
    cross."""
    from megatron.training.generate import generate

    hf = _build("v3", tmp_path)
    ours, _ = model_from_hf(tmp_path, params_dtype=torch.float64)
    ours.eval()
    prompt, new = [3, 17, 2, 5, 29, 8], 6
    tokens = generate([ours], prompt, new, vocab_size=VOCAB)
    patches, _ = _patches("v3")
    for patch in patches:
        patch.start()
    try:
        sequence = list(prompt)
        for token in tokens:
            with torch.no_grad():
                last = hf(input_ids=torch.tensor([sequence])).logits[0, -1]
            top = last.topk(2).values
            assert float(top[0] - top[1]) > 1e-6, "a near tie makes the comparison meaningless"
            assert token == int(last.argmax()), (tokens, sequence)
            sequence.append(token)
    finally:
        for patch in reversed(patches):
            patch.stop()
    assert len(tokens) == new


@pytest.mark.parametrize("name", ["v3", "v2_lite"])
def test_the_cached_forward_equals_the_full_forward(name, tmp_path):
    """Multi-latent attention's key/value cache (q LoRA and yarn in v3, neither in v2_lite):
    a prompt in one cached forward, a chunk after it, then one token per forward give, at
    every position, the logits of the full forward without a cache (float64). The cache is
    twice the sequence, so its rope table is longer than the full forward's."""
    from megatron.core.inference.contexts import StaticInferenceContext

    _build(name, tmp_path)
    ours, _ = model_from_hf(tmp_path, params_dtype=torch.float64)
    ours.eval()
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = ours(ids, None, None)
        context = StaticInferenceContext(1, 2 * SEQ)
        steps = []
        for start, stop in [(0, 3), (3, 5)] + [(i, i + 1) for i in range(5, SEQ)]:
            positions = torch.arange(start, stop)[None]
            steps.append(ours(ids[:, start:stop], positions, None, inference_context=context))
            context.increment_sequence_len_offset(stop - start)
    assert len(context.key_value_memory_dict) == BASE["num_hidden_layers"]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-12, atol=1e-12)


def test_negative_control_each_routing_rule_shows_in_the_logits(tmp_path):
    """The V3 comparison would catch each routing rule left out: group-limited selection,
    the expert bias on the selection, the routed scaling factor, the sigmoid scores."""
    (_, _, ours, config), (hf_logits, _, _, _) = _run("v3", tmp_path)
    router = ours.decoder.layers[1].mlp.router
    bias = router.expert_bias.clone()
    changes = {
        "no groups": lambda: setattr(config, "moe_router_num_groups", None)
        or setattr(config, "moe_router_group_topk", None),
        "no expert bias": lambda: router.expert_bias.zero_(),
        "no scaling": lambda: setattr(config, "moe_router_topk_scaling_factor", None),
        "softmax": lambda: setattr(router, "score_function", "softmax"),
    }
    for change, apply in changes.items():
        saved = dict(vars(config))
        apply()
        with torch.no_grad():
            logits = ours(_batch()[0], None, None)
        err = ((logits - hf_logits).abs().max() / hf_logits.abs().max()).item()
        assert err > 1e-6, f"{change}: went unnoticed ({err:.2e})"
        vars(config).update(saved)
        router.expert_bias.copy_(bias)
        router.score_function = "sigmoid"


def _v3(**change):
    from tests.unit_tests.hf.test_hf_refusals import BASE

    return {**BASE["deepseek_v3"], **change}


def _v2(**change):
    from tests.unit_tests.hf.test_hf_refusals import BASE

    return {**BASE["deepseek_v2"], **change}


YARN_V3 = _v3()["rope_parameters"]


@pytest.mark.parametrize(
    "raw, message",
    [
        (_v3(rms_norm_eps=1e-5), "rms_norm_eps=1e-05 .*expected 1e-6"),
        (_v3(rope_interleave=False), "rope_interleave=false .*interleaved"),
        (_v3(rope_parameters={**YARN_V3, "attention_factor": 1.2}), "no attention_factor"),
        (_v3(rope_parameters={**YARN_V3, "mscale": 0}), "mscale set when mscale_all_dim is"),
        (_v3(rope_parameters={**YARN_V3, "truncate": False}), "truncate true"),
        (_v3(rope_parameters={**YARN_V3, "rope_type": "linear"}), "rope_type default or yarn"),
        (_v3(topk_group=1), "topk_group=1 .*num_experts_per_tok \\(4\\) / 2"),
        (_v3(norm_topk_prob=False), "norm_topk_prob=false .*expected true"),
        (_v3(topk_method="greedy"), "topk_method=\"greedy\" .*noaux_tc"),
        (_v3(scoring_func="softmax"), "scoring_func=\"softmax\""),
        (_v3(num_key_value_heads=2), "num_key_value_heads=2 .*num_attention_heads"),
        (_v3(attention_bias=True), "attention_bias=true"),
        (_v3(q_lora_rank=0), "q_lora_rank=0"),
        (_v3(head_dim=8), "head_dim=8 .*qk_rope_head_dim \\(4\\)"),
        (_v3(n_group=3), "n_group=3 .*divisor of n_routed_experts"),
        (_v3(moe_layer_freq=2), "moe_layer_freq=2"),
        (_v2(topk_method="group_limited_greedy", n_group=4, topk_group=1),
         "topk_group=1 .*num_experts_per_tok \\(2\\) / 1"),
        (_v2(topk_method="noaux_tc"), "topk_method=\"noaux_tc\""),
        (_v2(norm_topk_prob=True), "norm_topk_prob=true"),
        (_v2(mlp_bias=True), "mlp_bias=true"),
    ],
)  # fmt: skip
def test_deepseek_configs_we_cannot_express_are_refused_by_name(raw, message):
    from megatron.training.hf.config import architecture_from_config

    with pytest.raises(ValueError, match=message):
        architecture_from_config(raw)


def test_multi_token_prediction_layers_are_refused_by_name():
    """The hook for multi-token prediction: V3's layers after num_hidden_layers."""
    from megatron.training.hf.config import architecture_from_config
    from megatron.training.hf.families import REGISTRY

    arch = architecture_from_config(_v3())
    keys = ["model.layers.1.mlp.gate.weight", "model.layers.2.eh_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.2.eh_proj.weight.*multi-token"):
        REGISTRY["deepseek_v3"].check_keys(arch, keys, "ckpt")
    REGISTRY["deepseek_v3"].check_keys(arch, keys[:1], "ckpt")


MLA_SETTINGS = dict(
    normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
    disable_bias_linear=True, norm_epsilon=1e-6, multi_latent_attention=True, kv_lora_rank=8,
    qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, qk_layernorm=True,
    untie_embeddings_and_output_weights=True, num_experts=8, moe_ffn_hidden_size=16,
    moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1],
)  # fmt: skip
FROM_SCRATCH = {
    "deepseek_v3": dict(
        MLA_SETTINGS, q_lora_rank=12, rope_type="rope", moe_router_topk=4,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.01, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
    ),
    "deepseek_v2": dict(
        MLA_SETTINGS, rope_type="yarn", rotary_scaling_factor=4.0,
        original_max_position_embeddings=8, mscale=0.9, mscale_all_dim=0.8,
        moe_router_topk=2, moe_router_pre_softmax=True,
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FROM_SCRATCH))
def test_a_deepseek_model_trained_from_scratch_exports_to_transformers(family, tmp_path):
    """The trainer's flags build the model, train two steps (the expert bias moves) and
    --export-hf writes the family whose transformers model computes our logits."""
    from megatron.training import TrainingConfig
    from megatron.training.training import pretrain
    from tests.unit_tests.dist_utils import fresh_layout, rel_error
    from tests.unit_tests.hf.hf_models import token_ids, transformers_logits

    out = tmp_path / "exported"
    config = TrainingConfig(
        num_layers=2, seq_length=16, global_batch_size=4, train_iters=2, progress=False,
        export_hf=str(out), **FROM_SCRATCH[family],
    )  # fmt: skip
    with fresh_layout():
        pretrain(config)
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    ids = token_ids() % config.vocab_size
    model, _ = model_from_hf(out)
    model.eval()
    if family == "deepseek_v3":
        assert model.decoder.layers[1].mlp.router.expert_bias.abs().sum() > 0
    with torch.no_grad():
        ours = model(ids, None, None)
    err = rel_error(transformers_logits(out, ids), ours)
    assert err <= 1e-5, f"{family}: relative error {err:.2e}"


def test_lora_on_the_mla_projections_exports_a_peft_adapter_peft_loads(tmp_path):
    """Adapters on every MLA projection (q down/up, kv down/up, output), written in PEFT's
    format under transformers' module names: peft's model computes our logits (float64)."""
    from peft import PeftModel
    from safetensors.torch import save_file

    from megatron.core.config_rules import LORA_MLA_TARGETS
    from megatron.core.transformer.lora import LoRAConfig, apply_lora
    from megatron.training.hf.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_config, to_peft

    hf = _build("v3", tmp_path / "v3")
    ours, _ = model_from_hf(tmp_path / "v3", params_dtype=torch.float64)
    targets = LORA_MLA_TARGETS + ("linear_proj",)
    lora = LoRAConfig(target_modules=targets, dim=4, alpha=8.0, params_dtype=torch.float64,
                      lora_B_init_method="normal")  # fmt: skip
    added = apply_lora(ours, lora)
    kinds = {name.rsplit(".", 1)[-1] for name in added}
    assert kinds == {"linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                     "linear_kv_up_proj", "linear_proj"}  # fmt: skip
    adapters = {n: p.detach() for n, p in ours.named_parameters() if ".adapter." in n}
    arch, _ = read_hf_config(tmp_path / "v3")
    tensors, modules = to_peft(adapters, arch, lora)
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa" in modules
    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file(tensors, str(folder / ADAPTER_WEIGHTS))
    config = peft_config(arch, lora, modules, str(tmp_path / "v3"))
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config))
    tokens = _batch()[0]
    patches, _ = _patches("v3")
    with torch.no_grad():
        ours.eval()
        logits = ours(tokens, None, None)
        for patch in patches:
            patch.start()
        try:
            base = hf(input_ids=tokens).logits
            adapted = PeftModel.from_pretrained(hf, str(folder)).double()
            peft_logits = adapted(input_ids=tokens).logits
        finally:
            for patch in reversed(patches):
                patch.stop()
    torch.testing.assert_close(logits, peft_logits, rtol=1e-12, atol=1e-12)
    assert (logits - base).abs().max() > 1e-6  # the adapters change the model


@pytest.mark.slow
def test_lora_on_deepseek_v3_exports_the_trained_expert_bias_merged_only(tmp_path):
    """LoRA training moves the expert bias (a buffer, no adapter): the adapter-only export
    is refused by name, the merged one carries the trained bias."""
    from megatron.training import TrainingConfig
    from megatron.training.hf.checkpoint import export_hf
    from megatron.training.training import pretrain
    from tests.unit_tests.dist_utils import fresh_layout

    _build("v3", tmp_path / "base")
    config = TrainingConfig(
        hf_model=str(tmp_path / "base"), seq_length=16, global_batch_size=4, train_iters=2,
        progress=False, lora_dim=2, save=str(tmp_path / "ckpt"),
        lora_target_modules=["linear_q_down_proj", "linear_kv_up_proj", "linear_proj"],
    )  # fmt: skip
    with fresh_layout():
        pretrain(config)
    with pytest.raises(ValueError, match="a PEFT adapter cannot carry it: export with --merge"):
        export_hf(tmp_path / "ckpt", tmp_path / "adapter")
    export_hf(tmp_path / "ckpt", tmp_path / "merged", merge_lora=True)
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    base = SafetensorsReader(tmp_path / "base").read(key, (slice(None),))
    merged = SafetensorsReader(tmp_path / "merged").read(key, (slice(None),))
    assert not torch.equal(base, merged)
    assert torch.allclose(merged - base, torch.zeros_like(base), atol=2 * 1e-3 + 1e-7)


# The released checkpoints' config.json (DeepSeek's own remote-code keys; V3 in its bf16 form,
# without the fp8 quantization_config, which is refused for every family).
COMMON_RELEASED = dict(
    attention_bias=False, attention_dropout=0.0, aux_loss_alpha=0.001, bos_token_id=100000,
    eos_token_id=100001, ep_size=1, hidden_act="silu", initializer_range=0.02,
    max_position_embeddings=163840, moe_layer_freq=1, pretraining_tp=1, rms_norm_eps=1e-6,
    rope_theta=10000, seq_aux=True, tie_word_embeddings=False, torch_dtype="bfloat16",
    use_cache=True, auto_map={"AutoConfig": "configuration_deepseek.DeepseekV2Config"},
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
)  # fmt: skip
V2_LITE = dict(
    COMMON_RELEASED, model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"],
    first_k_dense_replace=1, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    n_group=1, n_routed_experts=64, n_shared_experts=2, norm_topk_prob=False,
    num_attention_heads=16, num_experts_per_tok=6, num_hidden_layers=27, num_key_value_heads=16,
    q_lora_rank=None, routed_scaling_factor=1.0, scoring_func="softmax", topk_group=1,
    topk_method="greedy", vocab_size=102400,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=0.707, mscale_all_dim=0.707,
                      original_max_position_embeddings=4096, type="yarn"),
)  # fmt: skip
V3 = dict(
    COMMON_RELEASED, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
    first_k_dense_replace=3, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    n_group=8, n_routed_experts=256, n_shared_experts=1, norm_topk_prob=True,
    num_attention_heads=128, num_experts_per_tok=8, num_hidden_layers=61, num_key_value_heads=128,
    num_nextn_predict_layers=1, q_lora_rank=1536, routed_scaling_factor=2.5,
    scoring_func="sigmoid", topk_group=4, topk_method="noaux_tc", vocab_size=129280,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096, type="yarn"),
)  # fmt: skip


def test_the_released_deepseek_configs_read_as_their_models():
    from megatron.training.hf.config import architecture_from_config

    lite = architecture_from_config(V2_LITE)
    assert (lite.q_lora_rank, lite.moe_router_num_groups, lite.moe_router_pre_softmax) == (
        None, None, True)  # fmt: skip
    assert lite.moe_layer_freq == (0,) + (1,) * 26 and lite.moe_router_topk_scaling_factor is None
    assert (lite.rope_type, lite.mscale, lite.mscale_all_dim) == ("yarn", 0.707, 0.707)
    assert lite.moe_shared_expert_intermediate_size == 2 * 1408
    v3 = architecture_from_config(V3)
    assert (v3.moe_router_num_groups, v3.moe_router_group_topk) == (8, 4)
    assert (v3.moe_router_score_function, v3.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert v3.moe_layer_freq == (0,) * 3 + (1,) * 58 and v3.moe_router_topk_scaling_factor == 2.5
    assert (v3.q_lora_rank, v3.rotary_scaling_factor, v3.original_max_position_embeddings) == (
        1536, 40.0, 4096)  # fmt: skip
