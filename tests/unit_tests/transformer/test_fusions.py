"""megatron-core's fusion switches (``bias_activation_fusion``, ``bias_dropout_fusion``,
``apply_rope_fusion``, ``persist_layer_norm``, ``cross_entropy_loss_fusion``) as compiled
functions: the same gradients as the unfused model within the dtype's rounding, against the
float64 dense reference of the parity tests.

torch.compile is slow on a small CPU (minutes per test on 2 shared cores), so the compiled
runs are marked slow; the default run takes the same fused code paths uncompiled
(``torch.compiler.set_stance("force_eager")``: the functions run as written), which checks
the fused paths' math but not the compiler.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from tests.unit_tests.dist_utils import rel_error
from tests.unit_tests.models import test_gpt_parity as parity
from tests.unit_tests.transformer.test_mixed_precision import _one_process_step

pytestmark = [pytest.mark.world(1), pytest.mark.timeout(600)]

FUSIONS = dict(
    bias_activation_fusion=True,
    bias_dropout_fusion=True,
    apply_rope_fusion=True,
    persist_layer_norm=True,
    cross_entropy_loss_fusion=True,
)


COMPILED = [pytest.param(True, marks=pytest.mark.slow, id="compiled"),
            pytest.param(False, id="uncompiled")]  # fmt: skip


@pytest.fixture
def compiled(request):
    if request.param:
        yield True
        return
    with torch.compiler.set_stance("force_eager"):
        yield False


@pytest.mark.parametrize("compiled", COMPILED, indirect=True)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_fusion_on_gives_the_unfused_gradients(arch, compiled):
    """fp32: fused and unfused main_grads both equal the float64 reference to 1e-5 (GPT-2
    style: LayerNorm, biases, exact GELU; Llama style: RMSNorm, SwiGLU, RoPE)."""
    reference = parity.dense_reference("averaged", arch)[0][0]
    plain, _ = _one_process_step(arch, bf16=False)
    fused, gpt = _one_process_step(arch, bf16=False, **FUSIONS)
    assert type(gpt.decoder.final_layernorm).__name__.startswith("Fused")
    for name in reference:
        assert rel_error(plain[name], reference[name]) <= 1e-5, name
        assert rel_error(fused[name], reference[name]) <= 1e-5, name


@pytest.mark.parametrize("compiled", COMPILED, indirect=True)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_fused_cross_entropy_matches_the_unfused_one_in_bf16(smoothing, compiled):
    """bf16 logits: the fused loss (float32 inside) equals the unfused loss of the float32
    logits; the gradient equals it to bf16's rounding of the result (2^-8 relative)."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 2, 50, generator=gen) * 3).to(torch.bfloat16)
    target = torch.randint(0, 50, (6, 2), generator=gen)
    weights = torch.rand(6, 2, generator=gen)
    fused_in = logits.clone().requires_grad_()
    plain_in = logits.float().requires_grad_()
    fused = fused_vocab_parallel_cross_entropy(fused_in, target, label_smoothing=smoothing)
    plain = vocab_parallel_cross_entropy(plain_in, target, label_smoothing=smoothing)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    (fused * weights).sum().backward()
    (plain * weights).sum().backward()
    assert fused_in.grad.dtype == torch.bfloat16
    assert rel_error(fused_in.grad, plain_in.grad) <= 2**-8


def test_bias_activation_fusion_refuses_other_activations():
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               activation_func=F.relu, bias_activation_fusion=True)  # fmt: skip
    submodules = MLPSubmodules(tensor_parallel.ColumnParallelLinear, None,
                               tensor_parallel.RowParallelLinear)  # fmt: skip
    with pytest.raises(ValueError, match="bias_activation_fusion=True fuses SwiGLU"):
        MLP(config, submodules)
