"""The ``LoRAConfig`` of a run, from its ``--lora-*`` options' ``library=`` declarations: for
the trainer (``lora_config``) and for a checkpoint's recorded run settings
(``lora_of_settings``: the HuggingFace export, PEFT adapters), one path for both.
"""

from dataclasses import fields
from typing import Any, Dict, Optional

from megatron.core.transformer.lora import LoRAConfig
from megatron.training.arguments import TrainingConfig, flag_of
from megatron.training.options import LORA_CONFIG, library_table, library_values


def lora_config(config: TrainingConfig) -> LoRAConfig:
    """The ``LoRAConfig`` of a run's ``--lora-*`` flags (errors name the flags)."""
    table = library_table(TrainingConfig, LORA_CONFIG)
    flags = {sets.field: flag_of(name) for name, sets in table if sets.field != "seed"}
    return LoRAConfig(**library_values(config, None, LORA_CONFIG), flags=flags)


def lora_of_settings(settings: Dict[str, Any]) -> Optional[LoRAConfig]:
    """The ``LoRAConfig`` a checkpoint's run settings record (None: no adapters); a setting
    an older run did not record takes its option's default."""
    if not settings.get("lora_dim"):
        return None
    options = {f.name for f in fields(TrainingConfig)}
    recorded = {k: v for k, v in settings.items() if k in options and v is not None}
    return lora_config(TrainingConfig(**recorded))
