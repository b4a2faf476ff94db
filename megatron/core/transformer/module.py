"""The base class of megatron modules: an ``nn.Module`` that keeps its config."""

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


class MegatronModule(torch.nn.Module):
    """``torch.nn.Module`` with ``self.config``; pipeline chunks add ``set_input_tensor``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The module's ``state_dict`` (megatron-core's name for it)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)


def leave_as_allocated(weight: torch.Tensor) -> None:
    """The ``init_method`` the GPT's layers are built with: a no-op, because GPTModel fills
    every parameter afterwards from its own seeded generator (layout-independent)."""
