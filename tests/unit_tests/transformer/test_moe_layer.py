"""One-process checks of the MoE layer (megatron.core.transformer.moe): the layer equals a
per-token loop written here, SequentialMLP and GroupedMLP agree, the expert-bias update,
the pure token counts, float64 end to end, and refusals by name."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

pytestmark = pytest.mark.world(1)

VOCAB, SEQ = 32, 8


def _config(**overrides) -> TransformerConfig:
    base = dict(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
        num_moe_experts=4,
        moe_ffn_hidden_size=8,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        params_dtype=torch.float64,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**{**base, **overrides})


def _gpt(config, grouped=False) -> GPTModel:
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=grouped)
    return GPTModel(
        config,
        spec,
        VOCAB,
        SEQ,
        position_embedding_type="rope",
        pg_collection=ProcessGroupCollection(),
        seed=3,
    )


def _batch():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    padding = torch.zeros(2, SEQ, dtype=torch.bool)
    padding[1, 5:] = True
    return tokens, torch.arange(SEQ).expand(2, SEQ), padding


def _reference_moe(layer, x: torch.Tensor) -> torch.Tensor:
    """Per-token loop: sum_j p_j FFN_{e_j}(x) + gate * shared(x), from the layer's weights."""
    config = layer.config
    out = torch.zeros_like(x)
    logits = x @ layer.router.weight.t()
    for t in range(x.shape[0]):
        top = torch.topk(logits[t], config.moe_router_topk)
        probs = torch.softmax(top.values, dim=-1)
        for j in range(config.moe_router_topk):
            expert = layer.experts.local_experts[int(top.indices[j])]
            gate, up = (x[t] @ expert.linear_fc1.weight.t()).chunk(2)
            out[t] += probs[j] * ((F.silu(gate) * up) @ expert.linear_fc2.weight.t())
    return out


def test_moe_layer_equals_a_per_token_loop():
    model = _gpt(_config())
    layer = model.decoder.layers[0].mlp
    x = torch.randn(SEQ, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    layer.eval()
    with torch.no_grad():
        output, bias = layer(x)
        expected = _reference_moe(layer, x.reshape(-1, 16)).view_as(x)
    assert bias is None
    assert (output - expected).abs().max() < 1e-13


def test_grouped_and_sequential_experts_agree():
    config = _config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    results = []
    for grouped in (False, True):
        model = _gpt(config, grouped)
        tokens, positions, padding = _batch()
        loss = model(tokens, positions, labels=tokens, padding_mask=padding).sum()
        loss.backward()
        experts = model.decoder.layers[0].mlp.experts
        if grouped:
            fc1 = experts.weight1.grad.view(4, 16, -1).transpose(1, 2)
        else:
            fc1 = torch.stack([e.linear_fc1.weight.grad for e in experts.local_experts])
        results.append((loss.detach(), fc1, model.decoder.layers[0].mlp.router.weight.grad))
        moe_utils.clear_aux_losses_tracker()
    for a, b in zip(*results):
        assert (a - b).abs().max() <= 1e-12 * max(b.abs().max(), 1)


def test_router_losses_attached_after_the_experts_give_the_same_gradients():
    """A MoELayer attaches its router losses to its output (``defer_router_losses``, so a
    GPU's host-side loss ops overlap the expert GEMMs): every gradient and tracked loss
    equals the router attaching them to its probabilities, as the router alone does."""
    config = _config(
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
        moe_aux_loss_coeff=[0.1, 0.05],
        moe_z_loss_coeff=0.01,
    )
    results = []
    for defer in (True, False):
        model = _gpt(config)
        for layer in model.decoder.layers:
            assert layer.mlp.router.defer_router_losses  # the layer's setting
            layer.mlp.router.defer_router_losses = defer
        tokens, positions, padding = _batch()
        model(tokens, positions, labels=tokens, padding_mask=padding).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        tracked = {
            name: entry["values"].clone()
            for name, entry in moe_utils.get_moe_layer_wise_logging_tracker().items()
        }
        results.append((grads, tracked))
        moe_utils.clear_aux_losses_tracker()
    (deferred, tracked_deferred), (direct, tracked_direct) = results
    assert deferred.keys() == direct.keys()
    for name in direct:
        assert torch.allclose(deferred[name], direct[name], rtol=1e-12, atol=1e-15), name
    assert tracked_deferred.keys() == tracked_direct.keys() and len(tracked_direct) >= 3
    for name in tracked_direct:
        assert torch.equal(tracked_deferred[name], tracked_direct[name]), name
    router_grad = direct["decoder.layers.0.mlp.router.weight"]
    model = _gpt(_config())  # no router losses: a different router gradient (the control)
    tokens, positions, padding = _batch()
    model(tokens, positions, labels=tokens, padding_mask=padding).sum().backward()
    assert not torch.allclose(model.decoder.layers[0].mlp.router.weight.grad, router_grad)
    moe_utils.clear_aux_losses_tracker()


def test_float64_model_routes_in_float64():
    model = _gpt(_config())
    layer = model.decoder.layers[0].mlp
    x = torch.randn(SEQ, 2, 16, dtype=torch.float64)
    probs, _ = layer.router(x)
    assert probs.dtype == torch.float64 and layer.router.gating(x).dtype == torch.float64


def test_the_tracker_takes_no_entry_of_another_model():
    """A float32 model's entry (same layer count) must not round a float64 model's losses:
    the tracker starts a new entry in the loss's dtype (found when a float32 trainer test ran
    before the float64 layout test in one launch)."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    tracker.clear()
    try:
        moe_utils.save_to_aux_losses_tracker("z_loss", torch.tensor(0.1), 1, 2)
        exact = torch.tensor(0.1 + 1e-12, dtype=torch.float64)
        moe_utils.clear_aux_losses_tracker()
        moe_utils.save_to_aux_losses_tracker("z_loss", exact, 1, 2)
        values = tracker["z_loss"]["values"]
        assert values.dtype == torch.float64 and values[0].item() == exact.item()
    finally:
        tracker.clear()


def test_token_counts_are_pure():
    routing_map = torch.tensor([[True, False], [True, True], [False, True]])
    valid = torch.tensor([True, True, False])
    before = (routing_map.clone(), valid.clone())
    counts = moe_utils.micro_batch_token_counts(routing_map, valid, None)
    assert counts.per_expert.tolist() == [2, 1] and int(counts.tokens) == 2
    assert counts.per_expert.dtype == torch.int64
    assert torch.equal(routing_map, before[0]) and torch.equal(valid, before[1])
    assert counts.per_expert.data_ptr() != counts.local_per_expert.data_ptr()


def test_count_per_expert_equals_bincount():
    """The device-side count (no host sync on CUDA) is bincount's, unused experts (the last
    one included) counted zero; the input is not modified."""
    experts = torch.tensor([3, 0, 3, 5, 0, 3], dtype=torch.int64)
    before = experts.clone()
    counts = moe_utils.count_per_expert(experts, 8)
    assert counts.dtype == torch.int64
    assert torch.equal(counts, torch.bincount(experts, minlength=8))
    assert counts.tolist() == [2, 0, 0, 3, 0, 1, 0, 0]
    assert torch.equal(experts, before)
    assert moe_utils.count_per_expert(experts[:0], 4).tolist() == [0, 0, 0, 0]


def test_expert_bias_update_after_the_step_changes_routing():
    config = _config(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.5,
    )
    model = _gpt(config)
    tokens, positions, padding = _batch()
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    model(tokens, positions, labels=tokens, padding_mask=padding).sum().backward()
    router = model.decoder.layers[0].mlp.router
    counts = router.local_tokens_per_expert.clone()
    assert int(counts.sum()) == 2 * int((~padding).sum())  # k = 2 routes per valid token
    _update_router_expert_bias([model], None)  # finalize_model_grads' step, one process
    expected = 0.5 * torch.sign(counts.double().mean() - counts.double())
    assert torch.equal(router.expert_bias, expected.to(router.expert_bias.dtype))
    assert int(router.local_tokens_per_expert.sum()) == 0
    moe_utils.clear_aux_losses_tracker()


def test_the_expert_bias_stays_float32_in_a_bf16_model():
    """megatron-core keeps the expert bias in float32 whatever the model's dtype: a bf16
    model (Float16Module's ``.bfloat16()``) still takes an update of 1e-3 on a bias of 0.5,
    which bf16 (spacing 2**-8 there) would round away."""
    config = _config(
        params_dtype=torch.float32,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3,
    )
    model = _gpt(config).bfloat16()
    router = model.decoder.layers[0].mlp.router
    assert router.expert_bias.dtype == torch.float32
    assert router.gating(torch.zeros(2, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16
    router.expert_bias.fill_(0.5)
    router.local_tokens_per_expert.copy_(torch.tensor([1, 2, 4, 5]))
    _update_router_expert_bias([model], None)
    assert router.expert_bias.tolist() == pytest.approx([0.501, 0.501, 0.499, 0.499], abs=1e-6)
    assert model.state_dict()["decoder.layers.0.mlp.router.expert_bias"].dtype == torch.float32


def test_block_spec_mixes_dense_and_moe_layers():
    config = _config(num_layers=4, moe_layer_freq=[1, 0, 0, 1])
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(config, spec, VOCAB, SEQ, pg_collection=ProcessGroupCollection())
    kinds = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    assert kinds == ["MoELayer", "MLP", "MLP", "MoELayer"]


def test_padding_mask_must_match_the_local_tokens():
    model = _gpt(_config())
    router = model.decoder.layers[0].mlp.router
    with pytest.raises(ValueError, match="padding_mask has 15 entries"):
        router(torch.randn(SEQ, 2, 16, dtype=torch.float64), torch.zeros(5, 3, dtype=torch.bool))


@pytest.mark.parametrize(
    "field, value, extra",
    [
        ("moe_expert_capacity_factor", 1.0, {}),
        ("moe_router_load_balancing_type", "global_aux_loss", {}),
        ("moe_router_load_balancing_type", "sinkhorn", {}),
        ("moe_router_topk_limited_devices", 2, {}),
        ("moe_input_jitter_eps", 0.01, {}),
        ("moe_router_force_load_balancing", True, {}),
        ("moe_token_dispatcher_type", "flex", {}),
        ("moe_permute_fusion", True, {}),
        ("sequence_parallel", False, {"tensor_model_parallel_size": 2}),
    ],
)
def test_layout_dependent_settings_are_refused_by_name(field, value, extra):
    with pytest.raises((NotImplementedError, ValueError)) as error:
        _config(**{field: value, **extra})
    named = "tensor_model_parallel_size" if field == "sequence_parallel" else field
    assert named in str(error.value)
