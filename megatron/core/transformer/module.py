"""The base class of megatron modules: an ``nn.Module`` that keeps its config."""

from typing import Any, Dict, Optional, Tuple

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


class MegatronModule(torch.nn.Module):
    """``torch.nn.Module`` with ``self.config``; pipeline chunks add ``set_input_tensor``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: Tuple[Tuple[int, int, int], ...] = (),
        metadata: Optional[dict] = None,
    ) -> Dict[str, Any]:
        """Sharded state dict for ``dist_checkpointing``: every parameter a ShardedTensor of
        its global tensor (split over TP by its ``partition_dim``), ``_extra_state`` a
        ShardedObject; children with their own ``sharded_state_dict`` use it
        (``transformer.utils.module_sharded_state_dict``)."""
        from megatron.core.transformer.utils import module_sharded_state_dict

        return module_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The module's ``state_dict`` (megatron-core's name for it)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)


def leave_as_allocated(weight: torch.Tensor) -> None:
    """The ``init_method`` the GPT's layers are built with: a no-op, because GPTModel fills
    every parameter afterwards from its own seeded generator (layout-independent)."""
