"""Sampling from a model (SPEC section 20): ``python -m megatron.training.generate``.

- The key/value cache is exact: a prompt run in one cached forward, a chunk of tokens after
  it, then one token per forward give, at every position, the logits of the full forward
  without a cache.
- Greedy tokens equal transformers' ``generate(do_sample=False)`` on the same HuggingFace
  model (Llama with grouped-query attention and RoPE; GPT-2 with learned positions; Gemma 2
  and 3; DeepSeek-V3's multi-latent attention and MoE), with a margin guard: each chosen
  token leads the runner-up by more than rounding could move.
- The command line at TP 2 x PP 2 prints the one-process tokens (Llama, DeepSeek-V3); with a
  seed, sampling is reproducible; padded vocabulary rows are never chosen.
"""

import contextlib
import io

import pytest
import torch

from megatron.core.inference.contexts import StaticInferenceContext
from megatron.training.generate import Sampling, _choose, generate, main
from megatron.training.hf import model_from_hf
from tests.unit_tests.dist_utils import fresh_layout, rel_error, reset_layout
from tests.unit_tests.hf.hf_models import (
    DEEPSEEK_V3_CONFIG,
    GEMMA2_CONFIG,
    GEMMA3_CONFIG,
    GPT2_CONFIG,
    HAVE_TRANSFORMERS,
    LLAMA_CONFIG,
    SKIP_REASON,
    write_random_hf_model,
)

PROMPT = [3, 17, 42, 5, 99, 8]
NEW = 8
# std 0.5: logits spread enough that greedy choices are far from ties
STD = 0.5
# the families, Gemma's windows, soft-caps and local RoPE base, and multi-latent attention
# (DeepSeek-V3) through the cache
CONFIGS = [LLAMA_CONFIG, GPT2_CONFIG, GEMMA2_CONFIG, GEMMA3_CONFIG, DEEPSEEK_V3_CONFIG]
IDS = ["llama", "gpt2", "gemma2", "gemma3", "deepseek_v3"]


@pytest.mark.world(1)
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_the_cached_forward_equals_the_full_forward(tmp_path, config):
    model, ids, full = _model_and_full_logits(tmp_path, config)
    with torch.no_grad():
        context = StaticInferenceContext(1, len(PROMPT))
        steps = []
        for start, stop in ((0, 3), (3, 5)):  # the prompt (causal), then a chunk after it
            steps.append(model(ids[:, start:stop], torch.arange(start, stop)[None],
                               inference_context=context))  # fmt: skip
            context.increment_sequence_len_offset(stop - start)
        steps += _one_token_steps(model, ids, context, 5)  # then one token at a time
    assert rel_error(torch.cat(steps, dim=1), full) <= 1e-6


def _model_and_full_logits(tmp_path, config):
    """(the model of ``config`` with random weights, PROMPT's ids, their full forward's
    logits)."""
    path = write_random_hf_model(tmp_path / "m", config, std=STD)
    model, _ = model_from_hf(path)
    model.eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        return model, ids, model(ids, torch.arange(len(PROMPT))[None])


def _one_token_steps(model, ids, context, start: int) -> list:
    """The logits of ids[start:], one cached forward per token."""
    steps = []
    for i in range(start, ids.shape[1]):
        steps.append(model(ids[:, i : i + 1], torch.tensor([[i]]), inference_context=context))
        context.increment_sequence_len_offset(1)
    return steps


@pytest.mark.world(1)
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_static_decoding_steps_equal_the_full_forward(tmp_path, config):
    """The decoding step of static shapes that ``--enable-cuda-graph`` captures
    (``enable_static_decode``: the offset on the device, keys written at it, attention over
    the whole buffer masked past it and before a window, RoPE angles gathered at it; Gemma's
    soft-caps in float32 scores), run eagerly here: after a cached prompt, one token per
    forward gives the full forward's logits; the cache is longer than the sequence, so the
    mask matters (without it the zero keys past the offset would take part). Attention sinks
    (GPT-OSS): ``test_hf_gpt_oss.py``."""
    model, ids, full = _model_and_full_logits(tmp_path, config)
    with torch.no_grad():
        context = StaticInferenceContext(1, 2 * len(PROMPT))
        steps = [model(ids[:, :3], torch.arange(3)[None], inference_context=context)]
        context.increment_sequence_len_offset(3)
        context.enable_static_decode(torch.device("cpu"))
        steps += _one_token_steps(model, ids, context, 3)
        assert int(context.static_offset) == context.sequence_len_offset == len(PROMPT)
        with pytest.raises(ValueError, match="2 tokens in a forward after enable_static_decode"):
            model(ids[:, :2], torch.arange(2)[None], inference_context=context)
    assert rel_error(torch.cat(steps, dim=1), full) <= 1e-6


@pytest.mark.world(1)
def test_static_decoding_refuses_what_it_cannot_capture(tmp_path):
    """An empty cache, and ``--enable-cuda-graph`` off a CUDA GPU, are refused by name."""
    from megatron.training.errors import UsageError

    model, _, _ = _model_and_full_logits(tmp_path, LLAMA_CONFIG)
    with pytest.raises(ValueError, match="the cache is empty; run the prompt through it first"):
        StaticInferenceContext(1, 8).enable_static_decode(torch.device("cpu"))
    with pytest.raises(UsageError, match="--enable-cuda-graph: the model is on cpu, not a CUDA"):
        generate([model], PROMPT, 2, vocab_size=128, cuda_graph=True)


@pytest.mark.world(1)
@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=SKIP_REASON)
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_greedy_tokens_equal_transformers_generate(tmp_path, config):
    import transformers

    path = write_random_hf_model(tmp_path / "m", config, std=STD)
    model, _ = model_from_hf(path)
    model.eval()
    ours = generate([model], PROMPT, NEW, vocab_size=128)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([PROMPT]),
            do_sample=False,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    theirs = out.sequences[0, len(PROMPT) :].tolist()
    margins = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
    assert min(margins) > 1e-4, f"a near tie makes the comparison meaningless: {margins}"
    assert ours == theirs


@pytest.mark.world(1)
def test_sampling_is_reproducible_and_padded_rows_are_never_chosen():
    logits = torch.randn(40, generator=torch.Generator().manual_seed(0))
    logits[32:] = 100.0  # "padded" rows with huge logits, sliced off by the vocabulary size
    sampling = Sampling(temperature=1.0, top_k=10, top_p=0.9, seed=3)

    def draws(seed):
        generator = torch.Generator().manual_seed(seed)
        return [_choose(logits[:32], sampling, generator) for _ in range(20)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)
    assert all(t < 32 for t in draws(3))
    top10 = set(torch.topk(logits[:32], 10).indices.tolist())
    assert set(draws(5)) <= top10
    assert _choose(logits[:32], Sampling(), torch.Generator()) == int(logits[:32].argmax())


def _cli(path, *extra) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), fresh_layout():
        code = main(["--hf-model", str(path), "--prompt-ids", " ".join(map(str, PROMPT)),
                     "--max-new-tokens", str(NEW), *extra])  # fmt: skip
    assert code == 0
    return out.getvalue().strip()


@pytest.mark.world(4)
@pytest.mark.parametrize("config", [LLAMA_CONFIG, DEEPSEEK_V3_CONFIG], ids=["llama", "deepseek_v3"])
def test_greedy_tokens_are_the_same_at_every_layout(config):
    """TP 2 x PP 2 (this launch's 4 ranks) prints the one-process model's greedy tokens
    (DeepSeek-V3: multi-latent attention's cache split by heads over TP, its MoE layer under
    sequence parallelism)."""
    import tempfile
    from pathlib import Path

    import torch.distributed as dist

    shared = [tempfile.mkdtemp(prefix="generate-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    path = Path(shared[0]) / "m"
    if dist.get_rank() == 0:
        write_random_hf_model(path, config, std=STD)
    dist.barrier()
    reset_layout()  # the one-process model: no parallel_state groups left by earlier tests
    model, _ = model_from_hf(path)
    model.eval()
    expected = " ".join(map(str, generate([model], PROMPT, NEW, vocab_size=128)))
    printed = _cli(path, "--tp", "2", "--pp", "2")
    if dist.get_rank() == 0:
        assert printed == expected
    else:
        assert printed == ""  # only rank 0 prints
