"""The size of a LoRA adapter-only checkpoint against the full checkpoint of the same model
(issue 32: "smaller than 1% of the model for rank 8 on the benchmark model").

    python tests/benchmarks/bench_lora_checkpoint.py [--seq 512] [--json out.json]

Model: ``bench_trainer_gpu.py``'s ~1.1B Llama-style shape, ``--bf16``, one process (CUDA when
there is one, else the CPU: ~18 GB of memory for the full run). Two one-iteration trainer
runs save a checkpoint each: the full model (``--save``: bf16 weights' fp32 main copies and
Adam state, as a resume needs), and LoRA rank 8, alpha 16 on every linear layer with
``--save-trainable-params-only`` (the adapters with their Adam state). Reported: each
checkpoint's bytes on disk (every file under its iteration directory), the model's
parameter bytes in bf16, and the ratios.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmarks.bench_trainer_gpu import Shape, _count_params, trainer_config  # noqa: E402


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from megatron.training.training import pretrain

    shape = Shape(seq=args.seq, microbatches=1)
    run = argparse.Namespace(warmup=0, steps=1)
    out = {}
    with tempfile.TemporaryDirectory() as root:
        full = Path(root) / "full"
        pretrain(trainer_config(shape, run, save=str(full)))
        out["full_bytes"] = directory_bytes(full)
        lora = Path(root) / "lora"
        pretrain(
            trainer_config(
                shape,
                run,
                save=str(lora),
                save_trainable_params_only=True,
                lora_dim=8,
                lora_alpha=16.0,
            )
        )
        out["adapter_bytes"] = directory_bytes(lora)
    out["params"] = _count_params(shape)
    out["bf16_weight_bytes"] = 2 * out["params"]
    out["adapter_over_full"] = out["adapter_bytes"] / out["full_bytes"]
    out["adapter_over_bf16_weights"] = out["adapter_bytes"] / out["bf16_weight_bytes"]
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
