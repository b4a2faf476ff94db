"""What the command line settles before any worker starts: the settings a ``--load``
checkpoint recorded, every input path and every output path.

``adopt_checkpoint_settings``: ``--load`` of one of our checkpoints takes the model and data
settings it recorded (the fields of ``kind=MODEL`` and ``kind=DATA``, ``--hf-model``, and
for a resumed run ``--seed``, which draws its data)
for every flag the command line leaves out (megatron's ``--use-checkpoint-args``, here the
default), so resuming needs only ``--load``; a flag that contradicts the checkpoint is
refused naming both values, one setting per line, as are optimizer settings the resume
would not honour (``checkpointing.compare_run_settings`` / ``compare_optimizer_settings``).

``check_input_paths``: ``--data-path``, ``--valid-data-path``, ``--tokenizer``,
``--hf-model`` and ``--load`` exist and are what they must be (a file, a folder, an indexed
prefix, a checkpoint; with ``--dpo``, the reference source a resumed checkpoint recorded),
each error naming the flag, the path and what was expected; ``check_dpo_reference``:
``--dpo-reference-hf-model``'s folder and architecture (once the settings are resolved).

``check_output_paths``: the output folders can be folders, ``--save`` overwrites no
checkpoints the run does not resume, and an ``--export-hf`` model has a HuggingFace family,
so nothing is found only after training.
"""

import os
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron.training.arguments import TrainingConfig, flag_of
from megatron.training.errors import UsageError
from megatron.training.options import DATA, MODEL, fields_of_kind

# Settings --load adopts when the command line leaves them out.
ADOPTED = fields_of_kind(TrainingConfig, MODEL, DATA) + ("hf_model",)


def adopt_checkpoint_settings(
    config: TrainingConfig, explicit: Sequence[str]
) -> Tuple[TrainingConfig, List[str]]:
    """(``config`` with the recorded model and data settings of the ``--load`` checkpoint
    for the fields not in ``explicit``, the names adopted). No checkpoint (the auto-resume
    idiom's empty ``--save`` directory) or one without recorded settings: unchanged. Raises
    a ``SettingsConflict`` when an explicit flag contradicts the checkpoint."""
    if not config.load:
        return config, []
    from megatron.core import dist_checkpointing  # torch: only for a --load
    from megatron.training.checkpointing import (
        compare_optimizer_settings,
        compare_run_settings,
        resolve_checkpoint,
    )
    from megatron.training.resume_rules import resumed_run_settings

    directory, _ = resolve_checkpoint(
        config.load, config.save, config.ckpt_step, config.exit_on_missing_checkpoint
    )
    if directory is None:
        return config, []
    common = dist_checkpointing.load_common_state_dict(str(directory))
    saved: Dict[str, Any] = common.get("run_settings") or {}
    names = {f.name for f in fields(config)}
    tokenizer_vocab = saved.get("data_path") and not saved.get("hf_model")
    adopted_names = ADOPTED + (() if config.finetune else resumed_run_settings(saved))
    changes = {
        name: _as_field(saved[name], getattr(config, name))
        for name in adopted_names
        if name in saved
        and name in names
        and name not in explicit
        and _as_field(saved[name], getattr(config, name)) != getattr(config, name)
        # the vocabulary of a --data-path run without --hf-model is the tokenizer's
        and not (name == "vocab_size" and tokenizer_vocab)
    }
    adopted = replace(config, **changes)
    current = _settings(adopted)
    if adopted.data_path and not adopted.hf_model:
        current.pop("vocab_size")  # the tokenizer's, known once it is read (in the workers)
    load_optim = not (adopted.no_load_optim or adopted.finetune)
    compare_run_settings(saved, current, directory, adopted.finetune, load_optim)
    if load_optim:
        compare_optimizer_settings(
            saved,
            current,
            directory,
            adopted.override_opt_param_scheduler,
            adopted.use_checkpoint_opt_param_scheduler,
        )
    return adopted, sorted(changes)


def check_input_paths(
    config: TrainingConfig, adopted: Sequence[str] = ()
) -> Optional[Dict[str, Any]]:
    """Each input path of ``config`` exists and has the expected form; a
    ``FileNotFoundError`` / ``ValueError`` naming the flag (and "recorded in the
    checkpoint" for a path ``--load`` adopted). Returns the reference source of a resumed
    DPO run, checked (``dpo_reference.reference_source``, for ``pretrain``), else None."""

    def flag(name: str, option: str) -> str:
        return f"{option} (recorded in the --load checkpoint)" if name in adopted else option

    # an evaluation of --valid-data-path (--skip-train) reads no training data
    validation_only = config.skip_train and config.valid_data_path
    for name, option in (("data_path", "--data-path"), ("valid_data_path", "--valid-data-path")):
        path = getattr(config, name, None)
        if path and not (name == "data_path" and validation_only):
            _check_data_path(flag(name, option), path)
    tokenizer = config.tokenizer
    if tokenizer not in (None, "byte-level") and not os.path.exists(tokenizer):
        raise FileNotFoundError(
            f"{flag('tokenizer', '--tokenizer')} {tokenizer!r}: no such file or folder "
            "(expected 'byte-level', a tokenizers JSON file or a HuggingFace tokenizer folder)"
        )
    if config.hf_model:
        path = Path(config.hf_model)
        if path.is_file():
            raise NotADirectoryError(
                f"{flag('hf_model', '--hf-model')} {config.hf_model} is a file; expected the "
                f"model's folder (config.json + safetensors), e.g. {path.parent}"
            )
        if not path.is_dir():
            raise FileNotFoundError(
                f"{flag('hf_model', '--hf-model')} {config.hf_model}: no such folder "
                "(expected a HuggingFace model folder with config.json + safetensors)"
            )
    if config.load:
        from megatron.training.checkpointing import resolve_checkpoint  # torch: only here

        resolve_checkpoint(
            config.load, config.save, config.ckpt_step, config.exit_on_missing_checkpoint
        )
        if config.dpo:  # a resumed DPO run's reference source still exists
            from megatron.training.dpo_reference import reference_source

            return reference_source(config)
    return None


def check_dpo_reference(config: TrainingConfig) -> None:
    """``--dpo-reference-hf-model DIR`` (with ``--dpo``; settings resolved, after
    ``--hf-model``) is a HuggingFace model folder of the policy's architecture: an error
    naming the flag and the folder before any worker starts."""
    if config.dpo and config.dpo_reference_hf_model:
        check_reference_architecture(config)


def check_reference_architecture(config: Any) -> None:
    """``--dpo-reference-hf-model DIR`` is a HuggingFace model folder that builds the
    policy's model: each model setting its config.json gives equals the run's (resolved
    settings: after ``--hf-model``). Else a ValueError / FileNotFoundError naming the flag,
    the folder and what was expected. The command line checks it before any worker starts
    (``preflight.check_dpo_reference``); the trainer again when it builds the reference."""
    from megatron.training.hf.config import read_hf_config, training_settings
    from megatron.training.model_settings import resolved_model

    source = config.dpo_reference_hf_model
    try:
        arch, _ = read_hf_config(source)
    except (FileNotFoundError, NotADirectoryError, ValueError) as err:
        raise type(err)(
            f"--dpo-reference-hf-model {source}: {err} (expected a HuggingFace model folder "
            "with config.json + safetensors, of the policy's architecture)"
        ) from None
    settings = training_settings(arch)
    mine = resolved_model(config)
    theirs = resolved_model({**mine, **settings})
    differ = [
        f"{flag_of(name)} {mine[name]} (its config.json gives {theirs[name]})"
        for name in settings
        if mine[name] != theirs[name]
    ]
    if differ:
        raise ValueError(
            f"--dpo-reference-hf-model {source} is not the policy's architecture: the run has "
            f"{'; '.join(differ)}; the reference must have the policy's architecture and "
            "tokenizer"
        )


def _check_data_path(option: str, path: str) -> None:
    """A JSONL file, or an indexed dataset (PREFIX, PREFIX.bin or PREFIX.idx with both)."""
    if os.path.isdir(path):
        raise IsADirectoryError(
            f"{option} {path!r} is a folder; expected a JSONL file or the prefix of an "
            "indexed dataset (PREFIX.bin + PREFIX.idx)"
        )
    if os.path.isfile(path) and not path.endswith((".bin", ".idx")):
        return
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
        raise FileNotFoundError(
            f"{option} {path!r}: no such file, and no {prefix}.bin + {prefix}.idx pair "
            "(expected a JSONL file or the prefix of an indexed dataset written by python -m "
            "megatron.training.preprocess_data)"
        )


def _as_field(saved: Any, current: Any) -> Any:
    """A recorded value in the field's form (a checkpoint records tuples as lists)."""
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved


def _settings(config: TrainingConfig) -> Dict[str, Any]:
    """The plain values of ``config`` (as a checkpoint records them)."""
    simple = (int, float, str, bool, type(None))
    return {
        f.name: getattr(config, f.name)
        for f in fields(config)
        if isinstance(getattr(config, f.name), simple)
    }


def adoption_note(adopted: Sequence[str], load: Optional[str]) -> Optional[str]:
    """One line saying which settings ``--load`` took from the checkpoint, or None."""
    if not adopted:
        return None

    shown = ", ".join(flag_of(name) for name in adopted[:8])
    more = f" and {len(adopted) - 8} more" if len(adopted) > 8 else ""
    return f"--load {load}: the checkpoint's recorded settings are used for {shown}{more}"


# ----------------------------------------------------------------------------- outputs

# checkpointing.TRACKER_FILENAME and dist_checkpointing's CONFIG_FNAME (no torch here).
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_METADATA = "metadata.json"
_OUTPUT_FOLDERS = (
    ("save", "the checkpoints"),
    ("save_metrics", "metrics.jsonl and loss.png"),
    ("tensorboard_dir", "the TensorBoard event files"),
    ("wandb_save_dir", "the W&B run files"),
)


def check_output_paths(config: TrainingConfig) -> None:
    """Before anything trains: each output folder (``--save``, ``--save-metrics``,
    ``--tensorboard-dir``, ``--wandb-save-dir``) can be a folder; ``--save`` does not
    overwrite checkpoints this run does not resume (``check_save_target``); an
    ``--export-hf`` model has a HuggingFace family (``check_export_family``). Errors name
    the flag, the path and what would have been written there."""

    for name, what in _OUTPUT_FOLDERS:
        path = getattr(config, name)
        if path:
            _check_output_folder(flag_of(name), path, what)
    check_save_target(config)
    check_export_family(config)


def _check_output_folder(flag: str, path: str, what: str) -> None:
    """``path`` is a folder, or can be made one (its nearest existing parent is a folder)."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(
            f"{flag} {path} is a file; expected a folder (new or existing) for {what}"
        )
    parent = next((p for p in target.parents if p.exists()), Path("."))
    if not target.exists() and not parent.is_dir():
        raise NotADirectoryError(
            f"{flag} {path}: {parent} is a file, so the folder for {what} cannot be made there"
        )


def saved_checkpoints(folder: str) -> List[str]:
    """What in ``folder`` says it holds checkpoints: the tracker file and the complete
    ``iter_NNNNNNN`` directories (empty when none, or no such folder)."""
    root = Path(folder)
    if not root.is_dir():
        return []
    held = [TRACKER_FILENAME] if (root / TRACKER_FILENAME).is_file() else []
    held += sorted(
        p.name
        for p in root.glob("iter_*")
        if p.name[len("iter_") :].isdigit() and (p / CHECKPOINT_METADATA).is_file()
    )
    return held


def check_save_target(config: TrainingConfig) -> None:
    """``--save DIR`` that already holds checkpoints is written only by the run that resumes
    them: ``--load DIR`` (megatron's auto-resume idiom) or ``--load DIR/iter_N``, without
    ``--finetune`` (which starts again at iteration 0). Anything else would overwrite them
    and move the tracker: a UsageError naming the flags."""
    save = config.save
    held = saved_checkpoints(save) if save and not config.skip_train else []
    if not held:
        return
    load = Path(config.load).resolve() if config.load else None
    inside = load is not None and Path(save).resolve() in (load, load.parent)
    if inside and not config.finetune:
        return
    shown = _held(save, held)
    if inside:
        raise UsageError(
            f"--finetune --load {config.load} --save {save}: a fine-tuning run starts again at "
            f"iteration 0, so its checkpoints would overwrite the ones it starts from ({shown}); "
            "--save to another folder"
        )
    started = f"--load {config.load} does not resume them" if load else "this run starts anew"
    raise UsageError(
        f"--save {save} already holds checkpoints ({shown}) and {started}: they would be "
        f"overwritten; resume them with --load {save}, or --save to a new folder"
    )


def _held(folder: str, held: Sequence[str]) -> str:
    """The checkpoints in ``folder``, as a short phrase."""
    tracker = Path(folder) / TRACKER_FILENAME
    if TRACKER_FILENAME in held:
        text = tracker.read_text().strip()
        return f"{TRACKER_FILENAME} names iteration {text}"
    return ", ".join(held[:3]) + (" ..." if len(held) > 3 else "")


def check_export_family(config: TrainingConfig) -> None:
    """``--export-hf DIR`` of a model that did not come from ``--hf-model`` (whose
    config.json the export writes back): a HuggingFace family must write its settings, else
    a ValueError saying where the weights would have gone."""
    if not config.export_hf or config.hf_model or _loads_hf_config(config):
        return
    from megatron.training.hf.config import architecture_from_model_settings  # no torch

    settings = {f.name: getattr(config, f.name) for f in fields(config)}
    try:
        architecture_from_model_settings(settings)
    except ValueError as err:
        raise UsageError(
            f"--export-hf {config.export_hf}: the trained model would be written there after "
            f"training, but {str(err).removeprefix('export: ')}"
        ) from None


def _loads_hf_config(config: TrainingConfig) -> bool:
    """Whether the ``--load`` checkpoint records a HuggingFace config.json (an import, or a
    ``--hf-model`` run): the export writes that one back."""
    if not config.load:
        return False
    from megatron.core import dist_checkpointing  # torch: only for a --load
    from megatron.training.checkpointing import resolve_checkpoint

    directory, _ = resolve_checkpoint(
        config.load, config.save, config.ckpt_step, config.exit_on_missing_checkpoint
    )
    if directory is None:
        return False
    common = dist_checkpointing.load_common_state_dict(str(directory))
    return bool(common.get("hf_config") or (common.get("run_settings") or {}).get("hf_config"))
