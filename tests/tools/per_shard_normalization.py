"""pytest plugin for the negative control: the old per-shard normalization, from outside.

``pytest -p tests.tools.per_shard_normalization ...`` replaces
``megatron.core.pipeline_parallel.schedules.reduce_loss_across_cp`` when pytest starts with
the behaviour megatron-core had (each CP shard divides its loss by its own count), so the
parity bucket must fail on uneven masks. Importing the module alone patches nothing.
"""

import torch

from megatron.core.pipeline_parallel import schedules


def per_shard_normalization(loss_sum, num_tokens, cp_group):
    """S_c / max(N_c, 1): the count is never reduced over the CP group."""
    return loss_sum / torch.clamp(num_tokens, min=1)


def pytest_configure(config) -> None:
    """Loaded as a plugin: swap the normalization for the whole session."""
    schedules.reduce_loss_across_cp = per_shard_normalization
