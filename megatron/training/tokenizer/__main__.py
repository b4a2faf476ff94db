"""``python -m megatron.training.tokenizer train ...``: train a tokenizer (see
``megatron.training.tokenizer.train_tokenizer``)."""

import sys

from megatron.training.errors import run_tool
from megatron.training.tokenizer.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(run_tool(main, "megatron.training.tokenizer"))
