"""``python tools/preprocess_data.py ...`` = ``python -m megatron.training.preprocess_data``."""

from megatron.training.preprocess_data import main

if __name__ == "__main__":
    main()
