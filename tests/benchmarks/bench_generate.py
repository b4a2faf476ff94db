"""Decoding speed of ``megatron.training.generate`` with the key/value cache (eager, and on a
GPU with each decoding step one captured CUDA graph: ``--enable-cuda-graph``), against the
same model recomputing the whole sequence for every new token (no cache), in one launch.

    python tests/benchmarks/bench_generate.py [--layers 16 ...] [--mla] [--fp32] [--cpu]
        [--window N] [--softcap C] [--sinks]

The model: the 1.1B Llama-style model of ``bench_trainer_gpu.py`` (random weights, bf16 on
a GPU; ``--cpu`` a tiny float32 one); ``--mla``: its attention multi-latent instead
(DeepSeek-V2-Lite's dims: kv_lora_rank 512, q/k head dim 128 + 64 rope, v head dim 128, no
q LoRA, plain rope). A prompt of ``--prompt`` tokens, ``--new`` tokens
decoded greedily; tokens/s = new tokens / wall time of the whole generation (prefill
included), median of ``--repeats``. The tokens are compared with the eager cache's (in
float32 they agree; in bf16 the attention orders round differently, so a near tie of a random
model may flip); ``--fp32``: the model in float32 on the GPU too. ``--window``, ``--softcap``,
``--sinks``: a sliding window of N keys, attention logit soft-capping, learnable attention
sinks (the explicit-scores path of the static decoding step).
"""

import argparse
import statistics
import time

import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.training.generate import generate


def build(args, device) -> torch.nn.Module:
    mla = {}
    if args.mla:
        mla = dict(q_lora_rank=None, rope_type="rope")
        if args.cpu:
            mla.update(kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    config = (MLATransformerConfig if args.mla else TransformerConfig)(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        ffn_hidden_size=args.ffn,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=not (args.cpu or args.fp32),
        params_dtype=torch.float32 if args.cpu or args.fp32 else torch.bfloat16,
        use_cpu_initialization=True,
        window_size=None if args.window is None else (args.window, 0),
        attn_logit_softcapping=args.softcap,
        softmax_type="learnable" if args.sinks else "vanilla",
        **mla,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm", multi_latent_attention=args.mla),
        args.vocab,
        args.prompt + args.new,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        seed=1,
    )
    model = model if args.cpu or args.fp32 else Float16Module(config, model)
    return model.to(device).eval()


def without_cache(model, prompt, new, vocab) -> list:
    """Greedy decoding recomputing every position at each step."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out = []
    with torch.no_grad():
        for _ in range(new):
            logits = model(ids, torch.arange(ids.shape[1], device=device)[None])
            token = int(logits[0, -1, :vocab].float().argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mla", action="store_true", help="multi-latent attention")
    parser.add_argument("--fp32", action="store_true", help="float32 on the GPU too")
    parser.add_argument("--window", type=int, help="a sliding window of N keys")
    parser.add_argument("--softcap", type=float, help="attention logit soft-capping")
    parser.add_argument("--sinks", action="store_true", help="learnable attention sinks")
    parser.add_argument("--cpu", action="store_true", help="a tiny float32 model on the CPU")
    args = parser.parse_args()
    if args.cpu:
        args.layers, args.hidden, args.heads, args.groups, args.ffn = 2, 64, 4, 2, 128
        args.vocab, args.prompt, args.new = 256, 32, 16
    if args.mla:  # every head has its own keys (num_query_groups is not MLA's)
        args.groups = args.heads
    device = torch.device("cpu" if args.cpu else "cuda")
    model = build(args, device)
    prompt = torch.randint(
        0, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(0)
    )
    prompt = prompt.tolist()
    sync = (lambda: None) if args.cpu else torch.cuda.synchronize
    results = {}
    variants = [("kv-cache", lambda: generate([model], prompt, args.new, args.vocab))]
    if not args.cpu:
        graphed = lambda: generate([model], prompt, args.new, args.vocab, cuda_graph=True)  # noqa
        variants.append(("kv-cache-graph", graphed))
    variants.append(("no-cache", lambda: without_cache(model, prompt, args.new, args.vocab)))
    for name, run in variants:
        times, tokens = [], None
        for _ in range(args.repeats + 1):  # the first is a warm-up
            sync()
            start = time.perf_counter()
            tokens = run()
            sync()
            times.append(time.perf_counter() - start)
        results[name] = (statistics.median(times[1:]), tokens)
        print(f"# {name}: {args.new / results[name][0]:,.1f} tokens/s", flush=True)
    print(
        "| variant | tokens/s | speed-up | same tokens as kv-cache |\n| --- | ---: | ---: | --- |"
    )
    base, reference = results["no-cache"][0], results["kv-cache"][1]
    for name, (t, tokens) in results.items():
        first = next((i for i, (x, y) in enumerate(zip(tokens, reference)) if x != y), None)
        same = "yes" if first is None else f"no, from token {first}"
        print(f"| {name} | {args.new / t:,.1f} | {base / t:.2f}x | {same} |")


if __name__ == "__main__":
    main()
