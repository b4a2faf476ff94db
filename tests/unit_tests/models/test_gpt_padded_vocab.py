"""Padded vocabularies (SPEC section 19): a GPT whose table has ``vocab_size`` rows, of which
ids >= ``true_vocab_size`` are padding, gives the loss and every gradient of the unpadded
model at every TP and every padding: the padded logits take no probability (-inf), the
padded rows start at zero and get zero gradient. The reference is the unpadded one-process
model in float64, run on the same weights; a negative control (padded logits left in the
softmax) must fail the comparison.
"""

from typing import Dict, Optional

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.dist_utils import assert_no_failures, rel_error, reset_layout

TRUE_VOCAB, SEQ, BATCH = 13, 8, 2


def _config(tp: int = 1, **overrides) -> TransformerConfig:
    fields = dict(
        num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=4,
        ffn_hidden_size=24, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.3, params_dtype=torch.float64,
        tensor_model_parallel_size=tp,
    )  # fmt: skip
    fields.update(overrides)
    return TransformerConfig(**fields)


def _build(vocab: int, tp: int = 1, groups=None, tied: bool = False, **kwargs) -> GPTModel:
    return GPTModel(
        _config(tp),
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab,
        SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
        pg_collection=groups,
        **kwargs,
    )


def _batch():
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ), labels


def _loss_and_grads(model: GPTModel) -> "tuple[torch.Tensor, Dict[str, torch.Tensor]]":
    tokens, positions, labels = _batch()
    loss = model(tokens, positions, labels=labels).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _vocab_rows(name: str) -> bool:
    return name in ("embedding.word_embeddings.weight", "output_layer.weight")


def _reference(tied: bool):
    """(weights, loss, gradients) of the unpadded one-process model (built and run before
    any parallel_state layout exists)."""
    reference = _build(TRUE_VOCAB, groups=ProcessGroupCollection(), tied=tied)
    loss, grads = _loss_and_grads(reference)
    return {n: p.detach().clone() for n, p in reference.named_parameters()}, loss, grads


def _compare(
    vocab: int, tp: int, tied: bool, groups=None, leak: bool = False, reference=None
) -> list:
    """Failures of the padded model (``vocab`` rows, this TP) against the unpadded one."""
    weights, ref_loss, ref_grads = reference or _reference(tied)
    padded = _build(vocab, tp, groups, tied=tied, true_vocab_size=TRUE_VOCAB)
    rank = 0 if groups is None else groups.tp.rank()
    failures = []
    with torch.no_grad():  # the same true weights (the init already draws them alike)
        for name, param in padded.named_parameters():
            full = weights[name]
            if _vocab_rows(name):
                block = param.shape[0]
                rows = torch.zeros(vocab, full.shape[1], dtype=full.dtype)
                rows[:TRUE_VOCAB] = full
                expected = rows[rank * block : (rank + 1) * block]
                if not torch.equal(param, expected):
                    failures.append(f"{name}: init is not the unpadded rows then zeros")
            elif getattr(param, "tensor_model_parallel", False):
                blocks = full.chunk(tp * param.partition_stride, dim=param.partition_dim)
                expected = torch.cat(blocks[rank::tp], dim=param.partition_dim)
            else:
                expected = full
            param.copy_(expected)
    if leak:  # negative control: the padded logits stay in the softmax
        padded.exclude_padded_vocab = lambda logits: logits
    loss, grads = _loss_and_grads(padded)
    if not rel_error(loss, ref_loss) <= 1e-12:
        failures.append(f"loss {loss.item():.12f} != unpadded {ref_loss.item():.12f}")
    params = dict(padded.named_parameters())
    for name, grad in grads.items():
        full, param = ref_grads[name], params[name]
        if _vocab_rows(name):
            block = grad.shape[0]
            rows = torch.zeros(vocab, full.shape[1], dtype=full.dtype)
            rows[:TRUE_VOCAB] = full
            expected = rows[rank * block : (rank + 1) * block]
        elif getattr(param, "tensor_model_parallel", False):
            blocks = full.chunk(tp * param.partition_stride, dim=param.partition_dim)
            expected = torch.cat(blocks[rank::tp], dim=param.partition_dim)
        else:
            expected = full
        if not rel_error(grad, expected) <= 1e-10:
            failures.append(f"{name}: gradient differs ({rel_error(grad, expected):.2e})")
    return failures


@pytest.mark.world(1)
@pytest.mark.parametrize("vocab", [16, 128], ids=["pad3", "pad115"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_padded_vocab_equals_unpadded_tp1(vocab, tied):
    reset_layout()
    assert_no_failures(_compare(vocab, 1, tied))


@pytest.mark.world(1)
def test_padded_logits_left_in_the_softmax_fail_the_comparison():
    """Negative control: without the exclusion the loss and gradients differ."""
    reset_layout()
    failures = _compare(16, 1, tied=False, leak=True)
    assert any(f.startswith("loss") for f in failures), failures


@pytest.mark.world(1)
def test_padded_logits_are_minus_infinity_and_bad_sizes_are_refused():
    reset_layout()
    model = _build(16, true_vocab_size=TRUE_VOCAB)
    assert model.true_vocab_size == TRUE_VOCAB and model.vocab_size == 16
    tokens, positions, _ = _batch()
    logits = model(tokens, positions)
    assert torch.isinf(logits[..., TRUE_VOCAB:]).all() and torch.isfinite(logits[..., :13]).all()
    assert _build(16).true_vocab_size == 16
    with pytest.raises(ValueError, match="true_vocab_size"):
        _build(16, true_vocab_size=17)
    with pytest.raises(NotImplementedError, match="label_smoothing"):
        GPTModel(
            _config(label_smoothing=0.1),
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            16,
            SEQ,
            true_vocab_size=TRUE_VOCAB,
        )


def _tp_groups(tp: int) -> Optional[ProcessGroupCollection]:
    reset_layout()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return ProcessGroupCollection.use_mpu_process_groups()


@pytest.mark.parametrize(
    "tp, vocab",
    [
        pytest.param(2, 14, id="tp2-pad1", marks=pytest.mark.world(2)),
        pytest.param(2, 16, id="tp2-pad3", marks=pytest.mark.world(2)),
        pytest.param(2, 64, id="tp2-pad51", marks=pytest.mark.world(2)),
        pytest.param(4, 16, id="tp4-pad3", marks=pytest.mark.world(4)),
        pytest.param(4, 32, id="tp4-pad19-one-rank-all-padding", marks=pytest.mark.world(4)),
    ],
)
def test_padded_vocab_equals_unpadded(tp, vocab):
    reset_layout()
    references = {tied: _reference(tied) for tied in (True, False)}
    groups = _tp_groups(tp)
    try:
        failures = []
        for tied, reference in references.items():
            failures += _compare(vocab, tp, tied, groups=groups, reference=reference)
    finally:
        reset_layout()
    assert_no_failures(failures)


@pytest.mark.world(2)
def test_trainer_pads_a_vocabulary_tp_does_not_divide():
    """--vocab-size 67 at TP = 2 (refused before padding existed) with
    --make-vocab-size-divisible-by 8: the table has 80 rows here and 72 in the one-process
    comparison run, and the two runs agree (the padding changes no result)."""
    from megatron.training import TrainingConfig
    from megatron.training.training import pretrain
    from tests.unit_tests.dist_utils import fresh_layout

    with fresh_layout():
        result = pretrain(
            TrainingConfig(
                vocab_size=67,
                make_vocab_size_divisible_by=8,
                tensor_model_parallel_size=2,
                seq_length=16,
                global_batch_size=4,
                micro_batch_size=1,
                train_iters=2,
                progress=False,
                compare_single_process=True,
                compare_tolerance=1e-5,
            )
        )
    assert result.passed and len(result.records) == 2
