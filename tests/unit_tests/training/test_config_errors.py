"""An error about a library config field names the trainer flag that set it, with the value
the user typed (``config_errors.name_the_flags``): real library messages, one per kind of
mapping (same name, renamed field, one-word field, --compile's fusions), and a trainer run
that fails inside the library (``--attention-backend fused`` on the CPU).
"""

import math

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.cp_attention.kernel_choice import check_backend_window
from megatron.training import TrainingConfig
from megatron.training.cli import main as cli_main
from megatron.training.config_errors import name_the_flags

pytestmark = pytest.mark.world(1)


def _library_error(make) -> str:
    with pytest.raises((ValueError, NotImplementedError)) as error:
        make()
    return str(error.value)


def test_transformer_config_errors_name_the_flags():
    message = _library_error(
        lambda: TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=3
        )
    )
    config = TrainingConfig(num_attention_heads=4, num_query_groups=3)
    assert name_the_flags(message, config) == (
        f"--num-attention-heads 4, --num-query-groups 3: {message}"
    )


def test_a_field_the_trainer_sets_under_another_name_names_its_flag():
    """window_size and attention_backend (same names); gated_linear_unit <- --swiglu and
    bias_activation_fusion <- --compile (LIBRARY_NAMES)."""
    message = _library_error(lambda: check_backend_window("fused", (4, 0)))
    config = TrainingConfig(attention_backend="fused", window_size=[4, 0])
    assert (
        name_the_flags(message, config)
        == f"--attention-backend fused, --window-size 4 0: {message}"
    )
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    gelu_tanh = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, bias_activation_fusion=True,
        activation_func=lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    )  # fmt: skip
    message = _library_error(lambda: MLP(gelu_tanh, MLPSubmodules()))
    assert "gated_linear_unit=False" in message  # the real library message
    assert name_the_flags(message, TrainingConfig(compile=True)).startswith(
        "--compile, --swiglu (not given): MLP: bias_activation_fusion=True"
    )


def test_one_word_fields_only_as_name_equals_and_flagged_messages_unchanged():
    message = _library_error(lambda: OptimizerConfig(fp16=True, loss_scale=math.inf))
    assert name_the_flags(message, TrainingConfig(fp16=True, loss_scale=math.inf)) == (
        f"--loss-scale inf: {message}"
    )
    assert name_the_flags("lr=0.5 is too large", TrainingConfig(lr=0.5)) == (
        "--lr 0.5: lr=0.5 is too large"
    )
    plain = "the fp16 gradients overflowed; lower the lr"  # words, not fields
    assert name_the_flags(plain, TrainingConfig(fp16=True)) == plain
    trainer = "--seq-length 64: num_layers is fine"  # already names a flag
    assert name_the_flags(trainer, TrainingConfig()) == trainer


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refuses the cuDNN kernel")
def test_attention_backend_fused_on_the_cpu_names_the_flag(capsys):
    """Before: 'attention kernel 'cudnn' (attention_backend / ...) needs CUDA tensors'."""
    status = cli_main(["--attention-backend", "fused", "--train-iters", "1", "--no-progress"])
    assert status == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("megatron.training: error: --attention-backend fused: attention "
                           "kernel 'cudnn' (attention_backend")  # fmt: skip
    assert line.endswith("needs CUDA tensors, got cpu")
