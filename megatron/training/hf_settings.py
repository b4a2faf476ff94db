"""``--hf-model DIR``: the run's model settings from a HuggingFace directory's config.json.

The converter (``megatron.training.hf``) says what the directory's architecture is in the
trainer's terms (``training_settings``); this module decides how that meets the command line.
"""

from dataclasses import fields, replace
from pathlib import Path

from megatron.training.arguments import flag_of
from megatron.training.hf.config import read_hf_config, training_settings
from megatron.training.hf.target import check_export_target


def resolve_hf_model(config, explicit=None):
    """``config`` (a ``TrainingConfig``) with ``--hf-model DIR``'s model settings filled in.

    Each model option not given explicitly takes config.json's value; one given explicitly
    with another value is a ValueError naming the flag and both values. ``explicit``: the
    fields given on the command line (None: those that differ from their defaults). With
    ``--data-path`` (or ``--valid-data-path``) and no ``--tokenizer``, the tokenizer is DIR's
    (``tokenizer.json``).
    The HuggingFace paths are checked first (``check_hf_paths``). Idempotent.
    """
    check_hf_paths(config)
    if config.hf_model is None:
        return config
    try:
        arch, _ = read_hf_config(config.hf_model)
    except (FileNotFoundError, NotADirectoryError) as err:
        raise type(err)(f"--hf-model: {err}") from None
    defaults = {f.name: f.default for f in fields(config)}
    changes, conflicts = {}, []
    for name, value in training_settings(arch).items():
        current = getattr(config, name)
        if current == value or (name == "mtp_num_layers" and current == 0):
            continue  # --mtp-num-layers 0: the checkpoint's MTP layers dropped
        given = name in explicit if explicit is not None else current != defaults[name]
        if not given:
            changes[name] = value
        else:
            conflicts.append(f"{flag_of(name)} {current} (config.json gives {value})")
    if conflicts:
        raise ValueError(
            f"--hf-model {config.hf_model} sets the model from its config.json, but "
            f"{'; '.join(conflicts)}; leave these flags out"
        )
    changes.update(_adapter_targets(config, arch, explicit, defaults))
    tokenizer = Path(config.hf_model) / "tokenizer.json"
    text = config.data_path or config.valid_data_path  # the tokenizer of either file
    if text is not None and config.tokenizer is None and tokenizer.is_file():
        changes["tokenizer"] = str(config.hf_model)
    resolved = replace(config, **changes)
    if resolved.lora_dim is not None and resolved.export_hf and not resolved.merge_lora:
        from megatron.training.hf.peft import check_peft_form
        from megatron.training.lora_settings import lora_config

        check_peft_form(arch, lora_config(resolved))  # before the run, not at its export
    return resolved


def _adapter_targets(config, arch, explicit, defaults) -> dict:
    """With ``--hf-adapter``: the adapter's rank and alpha (its adapter_config.json's ``r``
    and ``lora_alpha``) as ``--lora-dim`` / ``--lora-alpha`` when ``--lora-dim`` was not
    given, and its layers (``target_modules`` and exclusions) as ``--lora-target-modules`` /
    ``--lora-exclude-modules`` unless these were given."""
    if not config.hf_adapter or not Path(config.hf_adapter).is_dir():
        return {}  # a missing folder is refused by name with the other adapter checks
    from megatron.training.hf.peft import lora_settings_of_peft

    settings = lora_settings_of_peft(config.hf_adapter, arch)
    changes = {}
    if config.lora_dim is None:
        changes = {n: settings[n] for n in ("lora_dim", "lora_alpha")}
    targets = ("lora_target_modules", "lora_exclude_modules")
    given = [
        n
        for n in targets
        if (n in explicit if explicit is not None else getattr(config, n) != defaults[n])
    ]
    if not given:
        changes.update({n: settings[n] for n in targets})
    return changes


def check_hf_paths(config) -> None:
    """Before anything runs: ``--export-hf`` names a folder an export may write (new, empty
    or an earlier export; never a file or another model's folder) and is not ``--hf-model``
    (the export would replace the model the run reads)."""
    if config.export_hf is None:
        return
    target = Path(config.export_hf)
    if config.hf_model is not None and target.resolve() == Path(config.hf_model).resolve():
        raise ValueError(
            f"--export-hf {config.export_hf} is --hf-model's folder; the export would replace "
            "the model this run starts from: choose another folder"
        )
    check_export_target(target, flag="--export-hf")
