"""``python -m megatron.training.tokenizer train ...``: train a tokenizer (see
``megatron.training.tokenizer.train_tokenizer``)."""

from megatron.training.tokenizer.train_tokenizer import main

if __name__ == "__main__":
    main()
