"""Multi-latent attention against transformers' DeepseekV3ForCausalLM (dense layers), float64:
logits, loss and every gradient, at one process and at TP 2 (with and without SP); the
negative control: the shared rope key's gradient not summed over TP fails at TP 2."""

import functools
from typing import Optional
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from tests.unit_tests.dist_utils import Layout, assert_no_failures, gather_failures, use_layout
from tests.unit_tests.models.naming import reference_names


def _transformers():
    """transformers, imported only by the tests that compare with it directly (a 2-rank
    launch of the default run does not pay its import)."""
    return pytest.importorskip("transformers")


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
    transformers = _transformers()
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


def _config(rope_type: str, q_lora_rank, layout: Optional[Layout] = None, **extra):
    layout = layout or Layout()
    rope = dict(
        rotary_scaling_factor=YARN["factor"],
        beta_fast=YARN["beta_fast"],
        beta_slow=YARN["beta_slow"],
        mscale=YARN["mscale"],
        mscale_all_dim=YARN["mscale_all_dim"],
        original_max_position_embeddings=YARN["original_max_position_embeddings"],
    )
    fields = dict(
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
        tensor_model_parallel_size=layout.tp,
        sequence_parallel=layout.sp,
        context_parallel_size=layout.cp,
        pipeline_model_parallel_size=layout.pp,
        pipeline_dtype=torch.float64,
        **rope,
    )
    return MLATransformerConfig(**{**fields, **extra})


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


def _hf_names(q_lora_rank) -> dict:
    """Our one-chunk parameter name -> (HF name, TP split dim or None; "fc1": gate and up)."""
    names = {
        "embedding.word_embeddings.weight": ("model.embed_tokens.weight", 0),
        "decoder.final_layernorm.weight": ("model.norm.weight", None),
        "output_layer.weight": ("lm_head.weight", 0),
    }
    for layer in range(LAYERS):
        names.update(_mapping(layer, q_lora_rank))
        mlp = f"model.layers.{layer}.mlp."
        names[f"decoder.layers.{layer}.mlp.linear_fc1.weight"] = (mlp, "fc1")
    return names


def _shard(full: torch.Tensor, dim, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's shard of a one-process tensor (fc1: of each of its two halves)."""
    if dim == "fc1":
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return full if dim is None else full.chunk(tp, dim)[rank]


def _hf_reference(hf, q_lora_rank) -> dict:
    """Our one-process name -> (HF's weight, HF's gradient) in our layout."""
    hf_params, reference = dict(hf.named_parameters()), {}
    for name, (hf_name, dim) in _hf_names(q_lora_rank).items():
        if dim == "fc1":
            parts = [hf_params[hf_name + k] for k in ("gate_proj.weight", "up_proj.weight")]
            reference[name] = (
                torch.cat([p.detach() for p in parts]),
                torch.cat([p.grad for p in parts]),
            )
        else:
            param = hf_params[hf_name]
            reference[name] = (param.detach(), param.grad)
    return reference


def _load(chunk: GPTModel, reference: dict, q_lora_rank, tp: int, rank: int) -> dict:
    """Copy the reference weights into ``chunk`` (this TP rank's shards); name -> param."""
    dims, ours = _hf_names(q_lora_rank), dict(reference_names(chunk))
    with torch.no_grad():
        for name, param in ours.items():
            param.copy_(_shard(reference[name][0], dims[name][1], tp, rank))
    return ours


def _grad_mismatches(ours: dict, reference: dict, q_lora_rank, tp, rank, attr="grad") -> list:
    """Names whose gradient differs from the reference's shard by more than 1e-10 relative."""
    dims, bad = _hf_names(q_lora_rank), []
    for name, param in ours.items():
        expected = _shard(reference[name][1], dims[name][1], tp, rank)
        got = getattr(param, attr)
        err = (got - expected).abs().max().item() / expected.abs().max().item()
        if err > 1e-10:
            bad.append(f"{name}: {err:.2e}")
    return bad


def _hf_loss(hf, tokens, labels, mask):
    """HF's masked mean cross entropy (float64 norms) with its backward run."""
    modeling = _transformers().models.deepseek_v3.modeling_deepseek_v3
    with mock.patch.object(modeling.DeepseekV3RMSNorm, "forward", _rms_norm_float64):
        out = hf(input_ids=tokens)
    per_token = torch.nn.functional.cross_entropy(
        out.logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none"
    )
    loss = (per_token * mask.reshape(-1)).sum() / mask.sum()
    loss.backward()
    return out.logits, loss


def _batch():
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, SEQ, dtype=torch.float64)
    mask[0, : SEQ - 2] = 0  # valid tokens on one CP shard only
    mask[1, :3] = 0
    return tokens, torch.roll(tokens, -1, 1), mask


def _one_process(rope_type, q_lora_rank, reference=None, groups=None):
    """Our model on one process (``groups``: of one rank each, inside a launch) from the
    reference's weights (None: its own seeded ones): (model, name -> param, logits, loss)."""
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
    config = _config(rope_type, q_lora_rank)
    model = GPTModel(config, spec, VOCAB, 32, position_embedding_type="rope", pg_collection=groups)
    ours = dict(reference_names(model))
    if reference is not None:
        _load(model, reference, q_lora_rank, 1, 0)
    tokens, labels, mask = _batch()
    with torch.no_grad():
        logits = model(tokens, None, None)
    loss = (model(tokens, None, None, labels=labels) * mask).sum() / mask.sum()
    loss.backward()
    return ours, logits, loss


def _run(rope_type, q_lora_rank):
    """One process: (our logits, HF logits, our loss, HF loss, gradient mismatches)."""
    hf = _hf_model(rope_type, q_lora_rank)
    hf_logits, hf_loss = _hf_loss(hf, *_batch())
    reference = _hf_reference(hf, q_lora_rank)
    ours, logits, loss = _one_process(rope_type, q_lora_rank, reference)
    return logits, hf_logits, loss, hf_loss, _grad_mismatches(ours, reference, q_lora_rank, 1, 0)


@functools.lru_cache(maxsize=None)
def _single_rank_groups() -> ProcessGroupCollection:
    """Every group of this rank alone (every rank creates every group)."""
    single = None
    for rank in range(dist.get_world_size()):
        group = dist.new_group([rank])
        if rank == dist.get_rank():
            single = group
    names = ("tp", "pp", "cp", "dp", "dp_cp", "embd", "pos_embd", "mp", "tp_cp", "tp_dp_cp")
    return ProcessGroupCollection(**{name: single for name in names})


def _own_reference(rope_type: str, q_lora_rank) -> dict:
    """Our one-process model's (seeded) weights and gradients, built inside a launch on
    groups of one rank (equal to transformers': ``test_mla_matches_deepseek_v3``)."""
    ours, _, _ = _one_process(rope_type, q_lora_rank, groups=_single_rank_groups())
    return {name: (param.detach(), param.grad) for name, param in ours.items()}


@pytest.mark.world(1)
@pytest.mark.parametrize("rope_type,q_lora_rank", [("rope", 8), ("yarn", 8), ("yarn", None)])
def test_mla_matches_deepseek_v3(rope_type, q_lora_rank):
    """Logits, loss and every gradient equal transformers' in float64."""
    logits, hf_logits, loss, hf_loss, bad = _run(rope_type, q_lora_rank)
    torch.testing.assert_close(logits, hf_logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, hf_loss, rtol=1e-12, atol=1e-12)
    assert not bad, bad


def _distributed_step(
    layout: Layout, rope_type: str, q_lora_rank, reference, per_shard: bool = False, **extra
) -> list:
    """One step through DDP, the schedule and finalize_model_grads (per-token loss: the
    masked sum over the whole batch divided by its valid tokens; ``per_shard``: each CP
    shard's own masked mean, then averaged, megatron-core's normalization the seed reports);
    gradient mismatches."""
    use_layout(layout)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    config = _config(rope_type, q_lora_rank, layout, calculate_per_token_loss=True, **extra)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
    pp_rank = groups.pp.rank()
    gpt = GPTModel(
        config,
        spec,
        VOCAB,
        32,
        pre_process=pp_rank == 0,
        post_process=pp_rank == layout.pp - 1,
        position_embedding_type="rope",
        pg_collection=groups,
    )
    tp_rank = groups.tp.rank()
    ours = _load(gpt, reference, q_lora_rank, layout.tp, tp_rank)
    chunk = DistributedDataParallel(config, DistributedDataParallelConfig(), gpt, groups)
    config.finalize_model_grads_func = finalize_model_grads
    tokens, labels, mask = _batch()
    batch = dict(tokens=tokens, labels=labels, loss_mask=mask)
    batch = get_batch_on_this_cp_rank(batch, groups.cp)

    def forward_step(data_iterator, model):
        output = model(batch["tokens"], None, None, labels=batch["labels"])

        def loss_func(output_tensor):
            loss_sum = (output_tensor * batch["loss_mask"]).sum()
            count = batch["loss_mask"].sum()
            if per_shard:
                return loss_sum / count.clamp(min=1), torch.tensor(1, dtype=torch.int), {}
            return loss_sum, count.to(torch.int), {}

        return output, loss_func

    chunk.zero_grad_buffer()
    get_forward_backward_func(layout.pp)(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=chunk,
        num_microbatches=1,
        seq_length=SEQ,
        micro_batch_size=2,
        pg_collection=groups,
    )
    return _grad_mismatches(ours, reference, q_lora_rank, layout.tp, tp_rank, "main_grad")


RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
CASES = [
    (Layout(tp=2), {}),
    (Layout(tp=2, sp=True), {}),
    (Layout(tp=2, sp=True), RECOMPUTE),
    (Layout(tp=2, sp=True), dict(q_lora_rank=None)),
    (Layout(cp=2), dict(recompute_granularity="selective")),
    (Layout(cp=2), {}),
    (Layout(cp=2), dict(cp_comm_type="p2p")),
    (Layout(cp=2), dict(cp_comm_type="a2a")),
    (Layout(pp=2), {}),
]


@pytest.mark.world(2)
@pytest.mark.parametrize(
    "layout, extra",
    CASES,
    ids=lambda c: c.id if isinstance(c, Layout) else "-".join(map(str, c.values())),
)
def test_mla_layouts_match_one_process(layout, extra):
    """Every main_grad after one step at tp2, tp2-sp (with full recompute; without q LoRA),
    cp2 with an uneven mask (all_gather, p2p, a2a: K and V head dims differ; selective
    recompute), pp2 equals the one-process model's gradient shard (yarn, q LoRA)."""
    extra = dict(extra)
    q_lora_rank = extra.pop("q_lora_rank", 8)
    reference = _own_reference("yarn", q_lora_rank)
    failures = _distributed_step(layout, "yarn", q_lora_rank, reference, **extra)
    assert_no_failures(gather_failures(failures))


@pytest.mark.slow
@pytest.mark.world(4)
@pytest.mark.parametrize(
    "layout",
    [Layout(tp=2, sp=True, cp=2), Layout(cp=2, pp=2), Layout(tp=2, pp=2), Layout(tp=2, dp=2)],
    ids=lambda c: c.id,
)
def test_mla_4_rank_layouts_match_one_process(layout):
    """The same at 4 ranks: tp2-sp x cp2, cp2 x pp2, tp2 x pp2, tp2 x dp2."""
    reference = _own_reference("yarn", 8)
    assert_no_failures(gather_failures(_distributed_step(layout, "yarn", 8, reference)))


@pytest.mark.slow
@pytest.mark.world(2)
@pytest.mark.parametrize(
    "layout", [Layout(tp=2, sp=True), Layout(cp=2), Layout(pp=2)], ids=lambda c: c.id
)
def test_mla_layouts_match_deepseek_v3(layout):
    """The same against transformers' gradients directly."""
    hf = _hf_model("yarn", 8)
    _hf_loss(hf, *_batch())
    reference = _hf_reference(hf, 8)
    assert_no_failures(gather_failures(_distributed_step(layout, "yarn", 8, reference)))


@pytest.mark.world(2)
def test_negative_control_rope_key_grad_not_summed_over_tp(monkeypatch):
    """Without the TP sum of the shared rope key's gradient (megatron-core 0.16.1,
    Megatron-LM #1699) the kv down projection's gradient is wrong at tp2."""
    reference = _own_reference("rope", 8)
    monkeypatch.setattr(MLASelfAttention, "_shared_rope_key", lambda self, k_pe: k_pe)
    bad = _distributed_step(Layout(tp=2), "rope", 8, reference)
    assert any("linear_kv_down_proj" in entry for entry in bad), bad


@pytest.mark.world(2)
def test_negative_control_per_shard_loss_normalization_at_cp2():
    """Each CP shard normalizing by its own valid tokens (megatron-core 0.16.1 without
    per-token loss; #7452 finding 9, the seed) moves the MLA model's gradient at cp2 with the
    uneven mask: the check catches it."""
    reference = _own_reference("yarn", 8)
    bad = _distributed_step(Layout(cp=2), "yarn", 8, reference, per_shard=True)
    assert gather_failures(bad), "per-shard normalization went unnoticed"


@pytest.mark.world(1)
def test_mla_bad_input_is_refused_by_name():
    """A plain TransformerConfig with multi_latent_attention, an unknown rope_type, an odd
    rope dim and a non-positive rank are refused naming the field and value."""
    with pytest.raises(NotImplementedError, match="multi_latent_attention=True needs an MLA"):
        TransformerConfig(
            num_layers=1, hidden_size=8, num_attention_heads=2, multi_latent_attention=True
        )
    with pytest.raises(ValueError, match="rope_type must be 'rope' or 'yarn', got 'llama3'"):
        _config("llama3", 8)
    with pytest.raises(ValueError, match=r"qk_pos_emb_head_dim \(3\) must be even"):
        _config("rope", 8, qk_pos_emb_head_dim=3)
    with pytest.raises(ValueError, match="kv_lora_rank must be a positive integer, got 0"):
        _config("rope", 8, kv_lora_rank=0)


@pytest.mark.world(1)
def test_yarn_rotary_embedding_matches_transformers():
    """megatron-core's ``YarnRotaryEmbedding``: the frequencies and the cos/sin scale equal
    transformers' yarn parameters (float32), the angles are positions x frequencies."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )

    hf = _hf_model("yarn", 8)
    rope_init = _transformers().modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"]
    inv_freq, attention_factor = rope_init(hf.config)
    ours = YarnRotaryEmbedding(
        4,
        rotary_base=10000.0,
        scaling_factor=YARN["factor"],
        original_max_position_embeddings=YARN["original_max_position_embeddings"],
        beta_fast=YARN["beta_fast"],
        beta_slow=YARN["beta_slow"],
        mscale=YARN["mscale"],
        mscale_all_dim=YARN["mscale_all_dim"],
    )
    assert torch.equal(ours.inv_freq, inv_freq.float())
    angles, mscale = ours(6)
    assert mscale == pytest.approx(attention_factor, rel=1e-15) and mscale != 1.0
    expected = torch.outer(torch.arange(6, dtype=torch.float32), inv_freq.float())
    assert torch.equal(angles[:, 0, 0], torch.cat((expected, expected), dim=-1))


@pytest.mark.world(1)
@pytest.mark.parametrize("rope_type", ["rope", "yarn"])
def test_mla_rotates_with_megatron_cores_rotary_embedding(rope_type):
    """MLASelfAttention holds megatron-core's ``rotary_pos_emb`` (``RotaryEmbedding``, or
    ``YarnRotaryEmbedding`` with its cos/sin scale) and rotates with its angles: one
    implementation of the rope tables, read from its cache (``cached_angles``), none of its
    own."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )

    config = _config(rope_type, 8)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
    model = GPTModel(config, spec, VOCAB, 32, position_embedding_type="rope")
    attention = model.decoder.layers[0].self_attention
    held = attention.rotary_pos_emb
    assert type(held) is {"rope": RotaryEmbedding, "yarn": YarnRotaryEmbedding}[rope_type]
    expected = held(SEQ)
    expected = expected if rope_type == "yarn" else (expected, 1.0)
    angles, mscale = attention._angles(SEQ, torch.device("cpu"))
    assert torch.equal(angles, expected[0]) and mscale == expected[1]
    assert (mscale != 1.0) == (rope_type == "yarn")
    assert held.cached_angles(SEQ, torch.device("cpu"))[0] is angles
    assert "_angles_cache" not in vars(attention)


@pytest.mark.world(1)
def test_mla_per_layer_cp_comm_type_follows_global_layer_numbers():
    """A ``cp_comm_type`` list gives MLA layer n entry n - 1, the rule ``Attention`` follows
    (one ``layer_cp_comm_type`` for both)."""
    config = _config("rope", 8, cp_comm_type=["a2a", "p2p"])
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
    model = GPTModel(config, spec, VOCAB, 32, position_embedding_type="rope")
    got = [layer.self_attention.core_attention.cp_comm_type for layer in model.decoder.layers]
    assert got == ["a2a", "p2p"]
