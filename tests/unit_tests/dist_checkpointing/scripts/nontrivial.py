"""Shared by ``test_mcore_checkpoint.py`` (our package) and ``mcore_deepseek_save.py`` (run
with megatron-core on its path): torch only, no ``megatron`` import."""

import torch


def nontrivial_norms_and_expert_biases(model: torch.nn.Module) -> None:
    """Norm weights drawn from U(0.5, 1.5) and expert biases from U(-0.2, 0.2) (initialized
    to ones and zeros, a load that skipped them would not show)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.uniform_(-0.2, 0.2)
