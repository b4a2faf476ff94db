"""Where a full fine-tuning DPO run's reference comes from, so that ``--load`` resumes it.

The reference is the run's starting weights. Its checkpoints record their source in the run
settings (``REFERENCE_SOURCE_KEY``): the seeded initialization (``--seed``), ``--hf-model``
DIR, or the checkpoint iteration ``--load X --finetune`` started from (absolute paths, with
a fingerprint of the files, ``lora_base.base_fingerprint``). A resume (``--load`` without
``--finetune``) rebuilds the reference from that source, never from the resumed weights, so
the resumed run equals the uninterrupted one; a source that is gone or holds other weights
is refused by name. LoRA's reference (the base with its adapters off), ``--dpo-reference-hf-
model`` and ``--dpo-reference-free`` need no record.
"""

from pathlib import Path
from typing import Any, Dict, Optional

from megatron.training.arguments import TrainingConfig
from megatron.training.errors import UsageError

REFERENCE_SOURCE_KEY = "dpo_reference"
SEED, HF_MODEL, FINETUNE = "--seed", "--hf-model", "--load --finetune"


def copies_starting_weights(config: TrainingConfig) -> bool:
    """Whether the run's reference is a frozen copy of its starting weights (full fine-tuning
    DPO without ``--dpo-reference-hf-model`` / ``--dpo-reference-free``)."""
    return bool(
        config.dpo
        and config.lora_dim is None
        and not (config.dpo_reference_free or config.dpo_reference_hf_model)
    )


def reference_source(config: TrainingConfig) -> Optional[Dict[str, Any]]:
    """The source of the run's reference as its checkpoints record it (None when the
    reference is not the starting weights): the recorded one when ``--load`` resumes a
    checkpoint (checked: ``check_source``), else where this run's starting weights come from.
    A resumed checkpoint that records none is refused (UsageError naming ``--load``)."""
    if not copies_starting_weights(config):
        return None
    directory = _load_directory(config)
    if directory is None:  # a fresh start (or the auto-resume idiom's empty --save)
        return _fresh_source(config)
    if config.finetune:
        return _source(FINETUNE, str(directory), config.seed)
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(directory))
    recorded = (common.get("run_settings") or {}).get(REFERENCE_SOURCE_KEY)
    if not recorded:
        raise UsageError(
            f"--load {config.load} with --dpo: checkpoint {directory} records no DPO reference "
            "(an SFT, LoRA or reference-free run's, or a DPO run's saved before checkpoints "
            "recorded it), so a resume would not know the reference, the run's starting "
            "weights; pass --finetune to start DPO from its weights, or "
            "--dpo-reference-hf-model DIR"
        )
    check_source(recorded, f"--load {config.load}: checkpoint {directory}")
    return dict(recorded)


def check_source(source: Dict[str, Any], where: str) -> None:
    """Refuse (UsageError naming the recorded flag and path) a recorded reference source
    that is gone or whose files are not the recorded ones."""
    if source.get("flag") == SEED:
        return
    from megatron.training.lora_base import base_fingerprint

    path = source.get("path")
    if not path or not Path(path).is_dir():
        raise UsageError(
            f"{where} resumes a DPO run whose reference, its starting weights, came from "
            f"{source.get('flag')} {path}, which no longer exists; put those weights back at "
            "that path (the reference is rebuilt from them), or pass --finetune to start a "
            "new DPO run from the checkpoint's weights"
        )
    now = base_fingerprint(path)
    if now != source.get("fingerprint"):
        raise UsageError(
            f"{where} resumes a DPO run whose reference came from {source.get('flag')} {path} "
            f"(fingerprint {source.get('fingerprint')}), but that folder now holds other "
            f"weights (fingerprint {now}); restore the original weights there, or pass "
            "--finetune to start a new DPO run from the checkpoint's weights"
        )


def describe_source(source: Dict[str, Any]) -> str:
    """``from --seed 1234``, ``from --hf-model /abs/dir``, ..."""
    if source["flag"] == SEED:
        return f"from --seed {source['seed']}"
    return f"from {source['flag']} {source['path']}"


def _fresh_source(config: TrainingConfig) -> Dict[str, Any]:
    if config.hf_model:
        return _source(HF_MODEL, config.hf_model, config.seed)
    return {"flag": SEED, "seed": config.seed}


def _source(flag: str, path: str, seed: int) -> Dict[str, Any]:
    """{flag, absolute path, fingerprint, seed} (the seed: the weights a source does not
    give, e.g. a padded vocabulary's rows)."""
    from megatron.training.lora_base import base_fingerprint

    absolute = str(Path(path).resolve())
    return {"flag": flag, "path": absolute, "fingerprint": base_fingerprint(absolute), "seed": seed}


def _load_directory(config: TrainingConfig) -> Optional[Path]:
    """The checkpoint directory ``--load`` names (None without one)."""
    if not config.load:
        return None
    from megatron.training.checkpointing import resolve_checkpoint

    directory, _ = resolve_checkpoint(
        config.load, config.save, config.ckpt_step, config.exit_on_missing_checkpoint
    )
    return directory
