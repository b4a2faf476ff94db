"""Checkpoint save/load time and size: ``dist_checkpointing`` against ``torch.save``.

The state is what the trainer would checkpoint for a ~1B-parameter GPT (hidden 2048, 20
layers, 16 heads, vocab 32768): bf16 parameters plus the optimizer's fp32 main parameters,
``exp_avg`` and ``exp_avg_sq`` (14 bytes per parameter), built with ``GPTModel`` and
``get_megatron_optimizer(bf16=True)`` on the default device (the GPU when there is one). The
floor is ``torch.save`` / ``torch.load(weights_only=True)`` of the same tensors in one file.

Per repeat, alternating: save with each method (fsync'd), the bytes on disk, a load with the
files in the page cache ("warm") and one after evicting them with
``posix_fadvise(DONTNEED)`` ("cold"). Medians over ``--repeats``; JSON on stdout and in
``--json``. ``--tiny``: a small model, for the CPU; ``--cpu``: ~27M parameters (hidden 512,
6 layers, vocab 8192; ~380 MB of state), for the CPU.

The cost of the integrity check: "dist_checkpointing (no checksum)" is the same save and load
with the per-item CRC-32 switched off (``storage.item_checksums`` returns nothing and no
``checksums.json`` is written, so the read-back at save and the check at load do not run).

    python tests/benchmarks/bench_checkpoint.py --json results/checkpoint_h200.json   # 1 GPU
    python tests/benchmarks/bench_checkpoint.py --cpu --json results/checkpoint_cpu.json
    python tests/benchmarks/bench_checkpoint.py --tiny                                # CPU
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing import storage
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig

FULL = dict(hidden_size=2048, num_attention_heads=16, num_layers=20, vocab=32768, seq=2048)
TINY = dict(hidden_size=64, num_attention_heads=4, num_layers=2, vocab=512, seq=64)
CPU = dict(hidden_size=512, num_attention_heads=8, num_layers=6, vocab=8192, seq=512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small model (CPU)")
    parser.add_argument("--cpu", action="store_true", help="~380 MB of state (CPU)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group(backend, rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    shape = TINY if args.tiny else CPU if args.cpu else FULL
    started = time.perf_counter()
    model, optimizer = build(shape)
    build_s = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)

    rows: Dict[str, List[float]] = {}
    for _ in range(args.repeats):
        for name, method in (
            ("dist_checkpointing", DistCheckpointing),
            ("dist_checkpointing (no checksum)", WithoutChecksums),
            ("torch.save", TorchSave),
        ):
            target = root / "".join(c if c.isalnum() else "_" for c in name)
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            bench = method(model, optimizer, target)
            for key, value in bench.run().items():
                rows.setdefault(f"{name}/{key}", []).append(value)
            shutil.rmtree(target, ignore_errors=True)
    components = checksum_components(model, optimizer, root / "components")
    result = {
        "checksum_components_s": components,
        "device": torch.cuda.get_device_name(0) if backend == "nccl" else "cpu",
        "torch": torch.__version__,
        "parameters": params,
        "model": shape,
        "state_bytes_in_memory": state_bytes(model, optimizer),
        "build_s": round(build_s, 2),
        "repeats": args.repeats,
        "median": {k: round(statistics.median(v), 4) for k, v in rows.items()},
        "all": {k: [round(x, 4) for x in v] for k, v in rows.items()},
    }
    med = result["median"]
    for what in ("save_s", "load_warm_s", "load_cold_s", "bytes"):
        ours, floor = med[f"dist_checkpointing/{what}"], med[f"torch.save/{what}"]
        result.setdefault("ratio_to_torch_save", {})[what] = round(ours / floor, 3)
        plain = med[f"dist_checkpointing (no checksum)/{what}"]
        result.setdefault("ratio_checksum_on_to_off", {})[what] = round(ours / plain, 3)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    dist.destroy_process_group()


def build(shape: Dict[str, int]):
    """A bf16 GPT and an Adam optimizer with fp32 main params and (zero) moments."""
    config = TransformerConfig(
        num_layers=shape["num_layers"],
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        bf16=True,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=shape["vocab"],
        max_sequence_length=shape["seq"],
        share_embeddings_and_output_weights=False,
    ).to(torch.bfloat16)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-4, bf16=True, params_dtype=torch.bfloat16), [model]
    )
    optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True)  # create state
    return model, optimizer


def state_bytes(model, optimizer) -> int:
    tensors = list(model.state_dict().values())
    for state in optimizer.optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    tensors += [
        p for group in optimizer.chained_optimizers[0].fp32_from_float16_groups for p in group
    ]
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


class DistCheckpointing:
    """``dist_checkpointing.save`` / ``load`` of the model and optimizer sharded dicts."""

    def __init__(self, model, optimizer, directory: Path):
        self.model, self.optimizer, self.directory = model, optimizer, directory

    def save(self) -> None:
        model_state = self.model.sharded_state_dict()
        state = {"model": model_state, "optimizer": self.optimizer.sharded_state_dict(model_state)}
        dist_checkpointing.save(state, str(self.directory))

    def load(self) -> None:
        model_state = self.model.sharded_state_dict()
        request = {
            "model": model_state,
            "optimizer": self.optimizer.sharded_state_dict(model_state, is_loading=True),
        }
        loaded = dist_checkpointing.load(request, str(self.directory))
        self.model.load_state_dict(loaded["model"])
        self.optimizer.load_state_dict(loaded["optimizer"])

    def run(self) -> Dict[str, float]:
        return _measure(self.save, self.load, self.directory)


def checksum_components(model, optimizer, directory: Path) -> Dict[str, float]:
    """The two parts of the check, timed alone on one saved checkpoint: the read-back and
    CRC-32 of every stored item (what save adds) and the CRC-32 of the same bytes already in
    memory (what load adds)."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    DistCheckpointing(model, optimizer, directory).save()
    infos = list(storage.read_metadata(directory).storage_data.values())
    start = time.perf_counter()
    storage.item_checksums(directory, infos)
    read_back_and_crc = time.perf_counter() - start
    payloads = []
    for info in infos:
        with open(directory / info.relative_path, "rb") as f:
            f.seek(info.offset)
            payloads.append(f.read(info.length))
    start = time.perf_counter()
    for payload in payloads:
        zlib.crc32(payload)
    crc_only = time.perf_counter() - start
    size = sum(len(p) for p in payloads)
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "items": len(infos),
        "item_bytes": size,
        "save_read_back_and_crc_s": round(read_back_and_crc, 4),
        "load_crc_s": round(crc_only, 4),
        "crc_gb_per_s": round(size / crc_only / 1e9, 3),
    }


class WithoutChecksums(DistCheckpointing):
    """The same save and load with the per-item CRC-32 switched off."""

    def run(self) -> Dict[str, float]:
        with _checksums_off():
            return super().run()


@contextlib.contextmanager
def _checksums_off():
    """No read-back and CRC at save, no checksums.json, so nothing checked at load."""
    saved = storage.item_checksums, storage.write_checksums
    storage.item_checksums = lambda directory, infos: {}
    storage.write_checksums = lambda directory, items, files: None
    try:
        yield
    finally:
        storage.item_checksums, storage.write_checksums = saved


class TorchSave(DistCheckpointing):
    """The floor: ``torch.save`` of the same tensors to one file, ``torch.load`` back."""

    def save(self) -> None:
        path = self.directory / "state.pt"
        with open(path, "wb") as f:
            torch.save(
                {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, f
            )
            f.flush()
            os.fsync(f.fileno())

    def load(self) -> None:
        device = next(self.model.parameters()).device
        state = torch.load(self.directory / "state.pt", map_location=device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def _measure(save, load, directory: Path) -> Dict[str, float]:
    _sync()
    start = time.perf_counter()
    save()
    _sync()
    save_s = time.perf_counter() - start
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    start = time.perf_counter()
    load()
    _sync()
    warm = time.perf_counter() - start
    _evict(directory)
    start = time.perf_counter()
    load()
    _sync()
    cold = time.perf_counter() - start
    return {"save_s": save_s, "load_warm_s": warm, "load_cold_s": cold, "bytes": float(size)}


def _evict(directory: Path) -> None:
    """Drop the files' pages from the page cache (no root needed for our own files)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
