"""``python -m megatron.training.hf import|export``: HuggingFace <-> dist checkpoints.

python -m megatron.training.hf import --hf DIR --out CKPT [--dtype bfloat16] [--allow-non-finite]
    [--overwrite]
python -m megatron.training.hf export --load CKPT --out DIR [--dtype ...] [--max-shard-size 2GB]
    [--overwrite] [--merge-lora]
    (a checkpoint with LoRA adapters: a PEFT adapter folder, or the merged model with
    --merge-lora)
"""

import argparse
import re
import resource
import sys
import time
from typing import Optional, Sequence

from megatron.training.errors import UsageError, is_usage_error, one_line
from megatron.training.hf.checkpoint import DTYPES, export_hf, import_hf
from megatron.training.options import HelpFormatter

PROG = "python -m megatron.training.hf"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; 0 on success, 2 with a one-line error otherwise."""
    parser = build_parser()
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        if args.command == "import":
            check_import_target(args.out, args.overwrite)
            where = import_hf(
                args.hf, args.out, dtype=args.dtype, allow_non_finite=args.allow_non_finite
            )
            what = f"imported {args.hf} into {where}"
        else:
            where = export_hf(
                args.load,
                args.out,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                overwrite=args.overwrite,
                merge_lora=args.merge_lora,
            )
            what = f"exported {args.load} to {where}"
    except Exception as err:  # a known error is one line; anything else is a bug
        if not (is_usage_error(err) or isinstance(err, RuntimeError)):
            raise
        print(f"megatron.training.hf: error: {one_line(err)}", file=sys.stderr)
        return 2
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{what} in {time.perf_counter() - started:.1f} s (peak resident memory {peak:.2f} GiB)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=HelpFormatter,
        description="Convert HuggingFace models (config.json + safetensors) to dist_checkpointing "
        "checkpoints that the trainer's --load reads at any layout, and back",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser(
        "import", help="HuggingFace directory -> CKPT/iter_0000000", formatter_class=HelpFormatter
    )
    imp.add_argument("--hf", required=True, metavar="DIR", help="HuggingFace model directory")
    imp.add_argument("--out", required=True, metavar="CKPT", help="checkpoint directory to write")
    imp.add_argument(
        "--dtype", choices=sorted(DTYPES), help="stored dtype (default: config.json's)"
    )
    imp.add_argument(
        "--allow-non-finite",
        action="store_true",
        help="import weights holding NaN or infinite values (refused by default)",
    )
    imp.add_argument(
        "--overwrite",
        action="store_true",
        help="import into a folder that already holds checkpoints (its tracker then names "
        "the imported iteration 0)",
    )
    exp = sub.add_parser(
        "export", help="checkpoint -> HuggingFace directory", formatter_class=HelpFormatter
    )
    exp.add_argument("--load", required=True, metavar="CKPT", help="a --save directory or iter_*")
    exp.add_argument("--out", required=True, metavar="DIR", help="HuggingFace directory to write")
    exp.add_argument("--dtype", choices=sorted(DTYPES), help="written dtype (default: stored)")
    exp.add_argument(
        "--merge-lora",
        action="store_true",
        help="a checkpoint with LoRA adapters: write the merged model (W + alpha/r B A) instead "
        "of the PEFT adapter folder",
    )
    exp.add_argument(
        "--max-shard-size",
        type=parse_size,
        default="2GiB",  # argparse parses a string default: DEFAULT_MAX_SHARD_SIZE
        metavar="SIZE",
        help="largest safetensors file, e.g. 2GB, 500MB",
    )
    exp.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty folder that is not an earlier export (its model files "
        "are replaced)",
    )
    return parser


def check_import_target(out: str, overwrite: bool) -> None:
    """``import --out CKPT`` does not write over checkpoints (a trainer's ``--save`` folder,
    an earlier import) unless ``--overwrite``: the import's tracker would name iteration 0."""
    from megatron.training.preflight import saved_checkpoints  # no torch

    held = saved_checkpoints(out)
    if held and not overwrite:
        shown = ", ".join(held[:3]) + (" ..." if len(held) > 3 else "")
        raise UsageError(
            f"--out {out} already holds checkpoints ({shown}); the import would move its "
            "tracker back to iteration 0: choose a new folder, or pass --overwrite"
        )


def parse_size(text: str) -> int:
    """``2GB`` -> 2e9 bytes, ``512MiB``, ``1000`` (bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"--max-shard-size {text!r}: expected a number with an optional unit "
            f"({', '.join(u for u in _UNITS if u)})"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


if __name__ == "__main__":
    sys.exit(main())
