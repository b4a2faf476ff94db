"""HuggingFace conversion of a ~1.24B-parameter Llama: time and peak host memory.

Writes a random checkpoint shaped like Llama 3.2 1B (16 layers, hidden 2048, 32 heads, 8
key/value heads, FFN 8192, vocab 128256, tied embeddings, llama3 rope scaling) in bf16 with
``safetensors`` directly — no transformers — one shard at a time (at most ``--shard-gb`` of
tensors in memory), then runs ``python -m megatron.training.hf import`` and ``export`` in
fresh processes. Each command reports its own wall time and peak resident memory
(``ru_maxrss``); the script checks that the export gives back every tensor bit for bit
(reading both files tensor by tensor) and prints one JSON record.

    python tests/benchmarks/bench_hf_convert.py                 # ~2.5 GB on disk (x3)
    python tests/benchmarks/bench_hf_convert.py --small         # a 4-layer, hidden-512 one
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LLAMA_1B = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
)
SMALL = dict(
    LLAMA_1B,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=32000,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a small model (CI smoke)")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a tmp)")
    parser.add_argument("--shard-gb", type=float, default=1.0, help="input shard size, GB")
    parser.add_argument("--json", default=None, help="also write the record here")
    args = parser.parse_args()
    config = SMALL if args.small else LLAMA_1B
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-hf-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        record = run(config, root, int(args.shard_gb * 1e9))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(record, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


def run(config: dict, root: Path, shard_bytes: int) -> dict:
    started = time.perf_counter()
    parameters, size = write_random_llama(root / "hf", config, shard_bytes)
    written = time.perf_counter() - started
    imported = command(["import", "--hf", str(root / "hf"), "--out", str(root / "ckpt")])
    exported = command(["export", "--load", str(root / "ckpt"), "--out", str(root / "out")])
    same = compare(root / "hf", root / "out")
    return {
        "model": f"Llama-shaped, {config['num_hidden_layers']} layers, hidden "
        f"{config['hidden_size']}, vocab {config['vocab_size']}, bf16",
        "parameters": parameters,
        "safetensors_bytes": size,
        "write_random_checkpoint_s": round(written, 1),
        "import": imported,
        "export": exported,
        "export_equals_original_bitwise": same,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }


def write_random_llama(directory: Path, config: dict, shard_bytes: int):
    """Random bf16 tensors of the Llama layout, one shard in memory at a time; returns
    (parameter count, bytes)."""
    from safetensors.torch import save_file

    from megatron.training.hf.config import architecture_from_config
    from megatron.training.hf.weights import hf_shapes, our_full_shapes, parameter_sources

    arch = architecture_from_config(config)
    shapes = hf_shapes(arch, parameter_sources(arch), our_full_shapes(arch))
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(0)
    shards, pending, pending_bytes, total, count = [], {}, 0, 0, 0
    weight_map = {}

    def flush():
        nonlocal pending, pending_bytes
        name = f"part-{len(shards):05d}.safetensors"
        save_file(pending, str(directory / name), metadata={"format": "pt"})
        shards.append(name)
        pending, pending_bytes = {}, 0

    for key, shape in shapes.items():
        tensor = torch.empty(shape, dtype=torch.bfloat16)
        tensor.normal_(0.0, 0.02, generator=generator)
        nbytes = tensor.numel() * 2
        if pending and pending_bytes + nbytes > shard_bytes:
            flush()
        pending[key] = tensor
        pending_bytes += nbytes
        weight_map[key] = len(shards)
        total += nbytes
        count += tensor.numel()
    flush()
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for old, new in zip(shards, names):
        os.replace(directory / old, directory / new)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: names[i] for k, i in weight_map.items()},
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return count, total


def command(args) -> dict:
    """Run ``python -m megatron.training.hf ARGS``; its own report of time and memory."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "megatron.training.hf", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - started
    match = re.search(r"in ([\d.]+) s \(peak resident memory ([\d.]+) GiB\)", done.stdout)
    return {
        "conversion_s": float(match.group(1)),
        "process_wall_s": round(wall, 1),
        "peak_rss_gib": float(match.group(2)),
    }


def compare(original: Path, exported: Path) -> bool:
    """Every tensor of ``original`` equals ``exported``'s, read one at a time."""
    from megatron.training.hf.weights import SafetensorsReader

    a, b = SafetensorsReader(original), SafetensorsReader(exported)
    if sorted(a.keys()) != sorted(b.keys()):
        return False
    for key in a.keys():
        everything = (slice(None),) * len(a.shape(key))
        if not torch.equal(a.read(key, everything), b.read(key, everything)):
            return False
    return True


if __name__ == "__main__":
    main()
