"""``python tools/preprocess_data.py ...`` = ``python -m megatron.training.preprocess_data``."""

import sys

from megatron.training.errors import run_tool
from megatron.training.preprocess_data import main

if __name__ == "__main__":
    sys.exit(run_tool(main, "megatron.training.preprocess_data"))
