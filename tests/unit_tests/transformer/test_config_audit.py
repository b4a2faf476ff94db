"""Every ``TransformerConfig`` field (its own and ``ModelParallelConfig``'s) is honoured or
refused by name (SPEC section 8, issue 21): nothing accepted and ignored.

For each field of ``dataclasses.fields(TransformerConfig)`` the audit sets a non-default
value (``NON_DEFAULT``) on a small GPT's config and checks that either construction raises
an error naming the field, or the model's loss or gradients differ from the baseline's.
The exceptions are short explicit lists, each entry with its reason:

* ``SPEED_ONLY``: no numerical effect by design (fusion switches, placement, overlap); the
  audit checks the loss and gradients stay equal to the baseline's (within rounding).
* ``OWNED_ELSEWHERE``: read by another part (layout, schedules, DDP, the mixed-precision
  wrapper) whose own tests check them; the entry names where.
* ``WARNED``: accepted with a warning naming the field (the audit checks the warning).

A field in no list and not in ``NON_DEFAULT`` fails the audit, with a message saying where
to add it: a new field is classified when it is added, not discovered later.
"""

import dataclasses
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

pytestmark = pytest.mark.world(1)

VOCAB, SEQ = 32, 8

BASE = dict(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=4,
    ffn_hidden_size=32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    init_method_std=0.2,
)


@dataclasses.dataclass
class With:
    """A non-default ``value`` that matters only with ``context`` (other fields), which the
    baseline of that check gets too."""

    value: object
    context: dict

    def __init__(self, value, **context):
        self.value, self.context = value, context


MOE = dict(num_moe_experts=4, add_bias_linear=False)

# field -> a value different from the default (and from BASE) that a model could honour
NON_DEFAULT = {
    "num_layers": 3,
    "hidden_size": 24,
    "num_attention_heads": 2,
    "softmax_scale": 0.9,
    "num_query_groups": 2,
    "ffn_hidden_size": 24,
    "kv_channels": 8,
    "hidden_dropout": 0.3,
    "fp32_residual_connection": True,
    "apply_residual_connection_post_layernorm": True,
    "layernorm_epsilon": 0.5,
    "add_bias_linear": False,
    "add_qkv_bias": With(True, add_bias_linear=False),
    "gated_linear_unit": True,
    "activation_func": F.silu,
    "num_moe_experts": With(4, add_bias_linear=False),
    "mtp_num_layers": 1,
    "rotary_interleaved": True,
    "window_size": (2, 0),
    "window_attn_skip_freq": With(2, window_size=(2, 0)),
    "softmax_type": "learnable",
    "glu_linear_offset": With(1.0, gated_linear_unit=True),
    "activation_func_clamp_value": With(0.05, gated_linear_unit=True),
    # YaRN fields: refused by name unless GPTModel(position_embedding_type="yarn")
    "yarn_rotary_scaling_factor": 4.0,
    "yarn_original_max_position_embeddings": 16,
    "yarn_beta_fast": 16.0,
    "yarn_beta_slow": 2.0,
    "yarn_mscale": 0.5,
    "yarn_mscale_all_dim": 0.5,
    "sandwich_layernorm": True,
    "embedding_scale_sqrt_hidden": True,
    "attn_logit_softcapping": 1.0,
    "final_logit_softcapping": 1.0,
    "local_rotary_base": With(100.0, window_size=(2, 0)),
    "normalization": "RMSNorm",
    "qk_layernorm": True,
    "qk_layernorm_whole_projection": With(True, qk_layernorm=True, normalization="RMSNorm"),
    "test_mode": True,
    "multi_latent_attention": True,
    "init_method": torch.nn.init.xavier_uniform_,
    "output_layer_init_method": torch.nn.init.xavier_normal_,
    "init_method_std": 0.5,
    "embedding_init_method": torch.nn.init.xavier_uniform_,
    "embedding_init_method_std": 0.7,
    "label_smoothing": 0.2,
    "perform_initialization": False,
    "distribute_saved_activations": True,
    "params_dtype": torch.float64,
    # mixture of experts (each in a MoE model: experts need add_bias_linear=False)
    "moe_shared_expert_intermediate_size": With(16, **MOE),
    "moe_shared_expert_gate": With(True, moe_shared_expert_intermediate_size=16, **MOE),
    "moe_layer_freq": With(2, **MOE),
    "moe_ffn_hidden_size": With(8, **MOE),
    "moe_router_load_balancing_type": With("seq_aux_loss", moe_aux_loss_coeff=0.5, **MOE),
    "moe_router_topk": With(1, moe_router_pre_softmax=True, **MOE),
    "moe_enable_routing_replay": With(True, **MOE),
    "moe_router_topk_limited_devices": With(1, **MOE),
    "moe_router_padding_for_quantization": With(True, **MOE),
    "moe_router_padding_for_fp8": With(True, **MOE),
    "moe_router_num_groups": With(2, **MOE),
    "moe_router_group_topk": With(1, **MOE),
    "moe_router_pre_softmax": With(True, **MOE),
    "moe_router_topk_scaling_factor": With(2.0, **MOE),
    "moe_router_score_function": With("sigmoid", **MOE),
    "moe_router_dtype": With("fp64", **MOE),
    "moe_router_force_load_balancing": With(True, **MOE),
    "moe_aux_loss_coeff": With(0.5, **MOE),
    "moe_z_loss_coeff": With(0.5, **MOE),
    "moe_input_jitter_eps": With(0.1, **MOE),
    "moe_token_dropping": With(True, **MOE),
    "moe_enable_deepep": With(True, **MOE),
    "moe_flex_dispatcher_backend": With("hybridep", **MOE),
    "moe_expert_capacity_factor": With(1.0, **MOE),
    "moe_pad_expert_input_to_capacity": With(True, **MOE),
    "moe_token_drop_policy": With("position", **MOE),
    "moe_layer_recompute": With(True, **MOE),
    "moe_permute_fusion": With(True, **MOE),
    "moe_router_fusion": With(True, **MOE),
    "moe_apply_probs_on_input": With(True, moe_router_topk=1, moe_router_pre_softmax=True, **MOE),
    "moe_latent_size": With(8, **MOE),
    "moe_deepep_num_sms": With(10, **MOE),
    "moe_hybridep_num_sms": With(8, **MOE),
    "moe_extended_tp": With(True, **MOE),
    "overlap_moe_expert_parallel_comm": With(True, **MOE),
    # FP8 (megatron.core.fp8): the implemented fields change the GEMMs, the rest are refused
    "fp8": With("hybrid", fp8_recipe="tensorwise"),
    "fp8_margin": With(8, fp8="hybrid", fp8_recipe="tensorwise"),
    "fp8_wgrad": With(False, fp8="hybrid", fp8_recipe="tensorwise"),
    "fp8_param": True,
    "fp8_quantizer_factory": "package.factory",
    "fp8_interval": 2,
    "fp8_amax_history_len": 4,
    "fp8_amax_compute_algo": "max",
    "fp8_dot_product_attention": True,
    "fp8_multi_head_attention": True,
    "tp_only_amax_red": True,
    "first_last_layers_bf16": True,
    "num_layers_at_start_in_bf16": 2,
    "num_layers_at_end_in_bf16": 2,
    "activation_func_fp8_input_store": True,
    "use_kitchen": True,
    "use_kitchen_attention": True,
    "kitchen_attention_backend": "fa",
    "fp4": "e2m1",
    "fp4_recipe": "custom",
    "fp4_param": True,
    "fp4_quantizer_factory": "package.factory",
}

SPEED_ONLY = {
    "bias_activation_fusion": "fused bias + activation kernel: same values",
    "masked_softmax_fusion": "fused masked softmax kernel: same values",
    "persist_layer_norm": "persistent LayerNorm kernel: same values",
    "memory_efficient_layer_norm": "LayerNorm kernel that saves less memory: same values",
    "bias_dropout_fusion": "fused bias + dropout + add: same values",
    "apply_rope_fusion": "fused rotary kernel: same values",
    "cross_entropy_loss_fusion": "fused cross-entropy kernel: same values",
    "apply_query_key_layer_scaling": "scales QK^T by 1/layer and the softmax input back: the "
    "same attention in exact arithmetic (an fp16 overflow guard)",
    "attention_softmax_in_fp32": "softmax precision; this core computes it in float32 anyway",
    "use_cpu_initialization": "where the full weights are built (always on CPU here)",
    "overlap_p2p_comm": "overlaps pipeline messages with compute (schedules)",
    "attention_backend": "which attention kernel; every kernel computes the same attention "
    "(tests/unit_tests/transformer kernel tests)",
    "recompute_granularity": "activation recomputation: memory for compute, same values",
    "recompute_method": "activation recomputation (which layers): same values",
    "recompute_num_layers": "activation recomputation (how many layers): same values",
    "recompute_modules": "selective recomputation (which modules): same values",
    "moe_grouped_gemm": "GroupedMLP computes the same experts as SequentialMLP "
    "(test_moe_layer.py: equal outputs and gradients)",
    "moe_use_legacy_grouped_gemm": "chooses between Transformer Engine's grouped GEMMs; the "
    "local spec has one",
    "moe_token_dispatcher_type": "how tokens travel to the experts' ranks; the same values "
    "(test_moe_layouts.py)",
    "moe_shared_expert_overlap": "megatron-core overlaps the shared expert with the dispatch; "
    "here they run one after the other: same values",
}

# SPEED_ONLY values other than ``not default``
SPEED_VALUES = {
    "attention_backend": "unfused",
    "recompute_granularity": "full",
    "recompute_method": "block",
    "recompute_num_layers": 1,
    "recompute_modules": ["mlp", "layernorm"],
    "moe_token_dispatcher_type": "alltoall",
}

OWNED_ELSEWHERE = {
    "yarn_correction_range_round_to_int": "read by GPTModel(position_embedding_type='yarn') "
    "only (tests/unit_tests/hf/test_hf_gpt_oss.py: HuggingFace's truncate false)",
    # (1 + w) with w starting at 0 computes what w starting at 1 does: a fresh model cannot
    # tell; tests/unit_tests/hf/test_hf_gemma.py's negative control (w read without the 1)
    # checks that the norms honour it
    "layernorm_zero_centered_gamma": "the norms (torch_norm.ZeroCenteredRMSNorm; "
    "test_hf_gemma.py)",
    # layout: tests/unit_tests/models/test_gpt_parity.py checks they leave gradients unchanged
    "tensor_model_parallel_size": "layout (TP parity tests)",
    "pipeline_model_parallel_size": "layout (PP parity tests)",
    "virtual_pipeline_model_parallel_size": "layout (VPP parity tests)",
    "sequence_parallel": "layout (SP parity tests)",
    "context_parallel_size": "layout (CP parity tests)",
    "hierarchical_context_parallel_sizes": "layout (a2a+p2p CP tests)",
    "cp_comm_type": "layout: the CP exchange (tests/unit_tests/transformer/test_cp_attention*)",
    "expert_model_parallel_size": "layout (test_moe_layouts.py, the MoE parity bucket)",
    "expert_tensor_parallel_size": "layout (test_moe_layouts.py, the MoE parity bucket)",
    "moe_router_enable_expert_bias": "the expert-bias update in finalize_model_grads (the "
    "bias starts at zero; test_moe_layer.py checks the update and its effect on routing)",
    "moe_router_bias_update_rate": "the expert-bias update in finalize_model_grads "
    "(test_moe_layer.py)",
    "moe_per_layer_logging": "track_moe_metrics' per-layer scalars (logging only)",
    "mtp_loss_scaling_factor": "the MTP loss weight, read with mtp_num_layers and an MTP "
    "block spec (tests/unit_tests/models/test_multi_token_prediction.py)",
    # schedules and DDP: tests/unit_tests/pipeline_parallel, tests/unit_tests/distributed
    "calculate_per_token_loss": "the schedules' loss normalization (test_cp_loss_normalization)",
    "timers": "schedules (callbacks)",
    "finalize_model_grads_func": "schedules (test_schedules.py)",
    "grad_scale_func": "schedules (loss scaling; test_schedules.py)",
    "no_sync_func": "schedules (gradient sync; test_schedules.py)",
    "grad_sync_func": "schedules (test_schedules.py)",
    "param_sync_func": "schedules (test_schedules.py)",
    "enable_autocast": "schedules' forward_step autocast (test_schedule_helpers.py)",
    "autocast_dtype": "schedules' forward_step autocast (test_schedule_helpers.py)",
    "pipeline_dtype": "p2p messages (test_p2p.py)",
    "variable_seq_lengths": "p2p shape exchange (test_p2p.py)",
    "batch_p2p_comm": "p2p batching (test_p2p.py)",
    "batch_p2p_sync": "p2p batching (test_p2p.py)",
    "deallocate_pipeline_outputs": "schedules (test_schedule_helpers.py)",
    "microbatch_group_size_per_vp_stage": "interleaved schedule order (test_schedules.py)",
    "num_microbatches_with_partial_activation_checkpoints": "activation recomputation "
    "(schedules / recompute)",
    "gradient_accumulation_fusion": "weight gradients into main_grad under DDP "
    "(test_grad_accumulation_fusion.py)",
    "bf16": "the bf16 wrapper Float16Module and the trainer (mixed precision tests)",
    "fp16": "the fp16 wrapper Float16Module and the loss scaler (mixed precision tests)",
    "fp8_recipe": "read with fp8 only (as megatron-core does); test_fp8_config.py checks "
    "'tensorwise' is honoured and every other recipe refused by name with fp8",
}

WARNED = {
    "attention_dropout": (0.3, r"attention_dropout=0.3 is not applied"),
}


def _config(**overrides) -> TransformerConfig:
    return TransformerConfig(**{**BASE, **overrides})


def _run(config: TransformerConfig):
    """(loss, {name: grad}) of one forward/backward of a fixed batch (rope positions)."""
    torch.manual_seed(0)
    model = GPTModel(
        config,
        get_gpt_decoder_block_spec(config, False, normalization=config.normalization),
        VOCAB,
        SEQ,
        position_embedding_type="rope",
        pg_collection=ProcessGroupCollection(),
        seed=7,
    )
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    positions = torch.arange(SEQ).expand(2, SEQ)
    loss = model(tokens, positions, labels=labels).double().mean()
    loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _same(a, b, tol: float) -> bool:
    """Same gradient names and shapes, and loss and each gradient within relative error
    ``tol`` (in norm)."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    if grads_a.keys() != grads_b.keys():
        return False
    if any(grads_a[n].shape != grads_b[n].shape for n in grads_a):
        return False
    pairs = [(loss_a, loss_b)] + [(grads_a[n], grads_b[n]) for n in grads_a]
    return all((x - y).norm() <= tol * max(y.norm(), 1e-30) for x, y in pairs)


@pytest.fixture(scope="module")
def baseline():
    return _run(_config())


def _all_fields():
    return [f.name for f in dataclasses.fields(TransformerConfig)]


LISTS = {
    "NON_DEFAULT": NON_DEFAULT,
    "SPEED_ONLY": SPEED_ONLY,
    "OWNED_ELSEWHERE": OWNED_ELSEWHERE,
    "WARNED": WARNED,
}


def _unclassified(names):
    return [name for name in names if not any(name in lst for lst in LISTS.values())]


def test_every_field_is_classified():
    lists = LISTS
    unclassified = _unclassified(_all_fields())
    assert not unclassified, (
        f"TransformerConfig fields in no list of {__file__}: {unclassified}. Add each to "
        "NON_DEFAULT (a value the GPT must honour: its loss or gradients change, or "
        "construction refuses it naming the field), SPEED_ONLY (no numerical effect: the "
        "audit checks the output is unchanged), OWNED_ELSEWHERE (read by another part, with "
        "the test that checks it) or WARNED; a field nothing implements must be refused by "
        "name in TransformerConfig.__post_init__ and listed in NON_DEFAULT."
    )
    twice = [n for n in _all_fields() if sum(n in lst for lst in lists.values()) > 1]
    assert not twice, f"fields in more than one list: {twice}"
    stale = [n for lst in lists.values() for n in lst if n not in _all_fields()]
    assert not stale, f"listed fields TransformerConfig no longer has: {stale}"


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_a_non_default_value_is_honoured_or_refused_by_name(name, baseline):
    value, context = NON_DEFAULT[name], {}
    if isinstance(value, With):
        value, context = value.value, value.context
        baseline = _run(_config(**context))
    default = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}[name]
    assert value != default and value != BASE.get(name, default), f"{name}: not a change"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = _run(_config(**{**context, name: value}))
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as error:
        assert name in str(error), f"{name}={value!r} refused without naming it: {error}"
        return
    assert not _same(result, baseline, tol=0.0), (
        f"{name}={value!r} was accepted and changed neither the loss nor any gradient: "
        "implement it, or refuse it by name in TransformerConfig.__post_init__"
    )


# Fields that switch a ``jit_fuser`` (torch.compile) function on. Compiling takes tens of
# seconds of CPU per field, so the default run takes the fused code paths uncompiled
# (``force_eager``: the same functions run as written) and ``-m slow`` compiles them, as
# tests/unit_tests/transformer/test_fusions.py does.
COMPILED_FIELDS = {
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",
}

SPEED_CASES = [
    case
    for name in sorted(SPEED_ONLY)
    for case in (
        [
            pytest.param(name, True, marks=pytest.mark.slow, id=f"{name}-compiled"),
            pytest.param(name, False, id=f"{name}-eager"),
        ]
        if name in COMPILED_FIELDS
        else [pytest.param(name, None, id=name)]
    )
]


@pytest.mark.parametrize("name, compiled", SPEED_CASES)
def test_speed_only_fields_leave_the_numbers_alone(name, compiled, baseline):
    default = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}[name]
    value = SPEED_VALUES.get(name, not default)
    context = {}
    if name.startswith("recompute_") and name != "recompute_granularity":
        context = {"recompute_granularity": "full", "recompute_method": "uniform"}
        context.update(recompute_num_layers=1)
        if name == "recompute_modules":
            context = {"recompute_granularity": "selective"}
    elif name == "recompute_granularity":
        context = {"recompute_method": "uniform", "recompute_num_layers": 1}
    eager = torch.compiler.set_stance("force_eager") if compiled is False else nullcontext()
    try:
        with eager:
            result = _run(_config(**{**context, name: value}))
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as error:
        assert name in str(error), f"{name}={value!r} refused without naming it: {error}"
        return
    assert _same(result, baseline, tol=1e-5), f"{name}={value!r} changed the numbers"


@pytest.mark.parametrize("name", sorted(WARNED))
def test_warned_fields_say_so(name):
    value, message = WARNED[name]
    with pytest.warns(UserWarning, match=message):
        _run(_config(**{name: value}))


def test_a_new_field_in_no_list_is_reported():
    """Negative control: a config class with one more field fails the classification."""

    @dataclasses.dataclass
    class Extended(TransformerConfig):
        brand_new_switch: bool = False

    names = [f.name for f in dataclasses.fields(Extended)]
    assert _unclassified(names) == ["brand_new_switch"]


def test_the_audit_catches_an_ignored_field(baseline, monkeypatch):
    """Negative control: with GPTModel reading no ``label_smoothing`` (its loss made
    without it), the audit's check fails for that field."""
    real = GPTModel.compute_language_model_loss

    def ignoring(self, labels, logits):
        saved = self.config.label_smoothing
        self.config.label_smoothing = 0.0
        try:
            return real(self, labels, logits)
        finally:
            self.config.label_smoothing = saved

    monkeypatch.setattr(GPTModel, "compute_language_model_loss", ignoring)
    with pytest.raises(AssertionError, match="accepted and changed neither"):
        test_a_non_default_value_is_honoured_or_refused_by_name("label_smoothing", baseline)
