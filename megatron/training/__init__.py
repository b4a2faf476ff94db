"""megatron.training: supervised fine-tuning of a small GPT under any CP/PP/VPP/DP layout.

Run ``python -m megatron.training --help``. In-process use: ``pretrain(TrainingConfig(...))``
runs a whole job; ``train`` one training run (its loop: ``megatron.training.loop``).
"""

from megatron.training.arguments import Layout, TrainingConfig, validate_config

__all__ = ["Layout", "TrainingConfig", "validate_config", "pretrain", "train"]


def __getattr__(name):
    """``pretrain`` and ``train`` import torch and the model only when first used."""
    if name in ("pretrain", "train"):
        from megatron.training import training

        return getattr(training, name)
    raise AttributeError(f"module 'megatron.training' has no attribute {name!r}")
