"""The GPT's tensor-parallel specifics on 2 ranks (TP = 2): a TP shard is the slice of the
one-rank model's weight, gathered logits (``parallel_output=False``) give the same loss and
gradients as vocab-parallel ones, and sequence parallelism marks exactly the replicated
decoder parameters. Configuration errors name the field and value (one process).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.device import comm_device
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.dist_utils import assert_no_failures, rel_error, reset_layout

VOCAB, SEQ = 32, 8


def make_config(**overrides) -> TransformerConfig:
    """A small Llama-style configuration (RMSNorm, SwiGLU, GQA) with overrides."""
    fields = dict(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=24,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build(config, pg_collection=None, **kwargs) -> GPTModel:
    return GPTModel(
        config,
        get_gpt_layer_local_spec(normalization=config.normalization),
        VOCAB,
        SEQ,
        position_embedding_type="rope",
        pg_collection=pg_collection,
        **kwargs,
    )


@pytest.mark.world(2)
def test_tp_shards_gathered_logits_and_sequence_parallel_marks():
    """(1) Every TP=2 parameter equals its slice of the TP=1 model's (qkv per query group,
    fc1 [gate | up] with stride 2, vocabulary rows, fc2 / proj columns). (2) Gathered and
    vocab-parallel logits: same per-token losses and gradients. (3) Under SP, exactly the
    parameters not split over TP are marked ``sequence_parallel``."""
    reset_layout()
    full = dict(build(make_config(), ProcessGroupCollection()).named_parameters())
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        groups = ProcessGroupCollection.use_mpu_process_groups()
        rank = groups.tp.rank()
        failures = []
        split = build(make_config(tensor_model_parallel_size=2), groups)
        for name, param in split.named_parameters():
            expected = full[name]
            if getattr(param, "tensor_model_parallel", False):
                blocks = expected.chunk(2 * param.partition_stride, dim=param.partition_dim)
                expected = torch.cat(blocks[rank::2], dim=param.partition_dim)
            if not torch.equal(param.detach(), expected.detach()):
                failures.append(f"{name}: not the slice of the one-rank weight")

        gen = torch.Generator().manual_seed(3)
        tokens, labels = (
            torch.randint(0, VOCAB, (2, SEQ), generator=gen).to(comm_device()) for _ in range(2)
        )
        positions = torch.arange(SEQ, device=comm_device()).expand(2, SEQ)
        results = []
        for parallel_output in (True, False):
            model = build(make_config(tensor_model_parallel_size=2), groups,
                          parallel_output=parallel_output).double()  # fmt: skip
            losses = model(tokens, positions, labels=labels)
            losses.sum().backward()
            logits = model(tokens, positions)
            width = VOCAB // 2 if parallel_output else VOCAB
            if logits.shape != (2, SEQ, width):
                failures.append(f"parallel_output={parallel_output}: logits {logits.shape}")
            results.append((losses.detach(), {n: p.grad for n, p in model.named_parameters()}))
        (loss_a, grads_a), (loss_b, grads_b) = results
        if rel_error(loss_b, loss_a) > 1e-12:
            failures.append("gathered logits give other losses")
        failures += [
            f"{n}: grads differ" for n in grads_a if rel_error(grads_b[n], grads_a[n]) > 1e-12
        ]

        try:
            GPTModel(make_config(tensor_model_parallel_size=2), get_gpt_layer_local_spec(), 31,
                     SEQ, pg_collection=groups)  # fmt: skip
            failures.append("vocab_size 31 at TP = 2 was accepted")
        except ValueError as error:
            if "vocab_size (31)" not in str(error):
                failures.append(f"unclear vocabulary error: {error}")

        sp = build(make_config(tensor_model_parallel_size=2, sequence_parallel=True), groups)
        for name, param in sp.named_parameters():
            replicated = not getattr(param, "tensor_model_parallel", False)
            should = replicated and name.startswith("decoder.")
            if bool(getattr(param, "sequence_parallel", False)) != should:
                failures.append(f"{name}: sequence_parallel should be {should}")
        marked = [n for n, p in sp.named_parameters() if getattr(p, "sequence_parallel", False)]
        if "decoder.final_layernorm.weight" not in marked:
            failures.append(f"final norm not marked: {marked}")
        assert_no_failures(failures)
    finally:
        reset_layout()


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(tensor_model_parallel_size=3, num_attention_heads=4, num_query_groups=None),
         r"num_attention_heads \(4\) must be a positive multiple of tensor_model_parallel_size "
         r"\(3\)"),
        (dict(tensor_model_parallel_size=4, num_attention_heads=4),
         r"num_query_groups \(2\) must be a positive multiple of tensor_model_parallel_size \(4\)"),
        (dict(num_query_groups=3), r"num_attention_heads \(4\) must be a positive multiple of "
         r"num_query_groups \(3\)"),
        (dict(tensor_model_parallel_size=2, ffn_hidden_size=25),
         r"ffn_hidden_size \(25\) must be a positive multiple of tensor_model_parallel_size"),
        (dict(sequence_parallel=True), r"sequence_parallel"),
        (dict(normalization="L2Norm"),
         r"normalization must be 'LayerNorm' or 'RMSNorm', got 'L2Norm'"),
        (dict(label_smoothing=1.5), r"label_smoothing must be in \[0, 1\), got 1.5"),
    ],
)  # fmt: skip
def test_config_names_the_field_and_value(overrides, message):
    """TransformerConfig rejects TP splits that do not divide, SP without TP, unknown norms."""
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)
