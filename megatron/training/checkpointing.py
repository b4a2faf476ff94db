"""Saving and resuming training: ``--save DIR``, ``--load DIR``, ``--save-interval N``.

The front of the checkpoint modules, and the load: ``checkpoint_layout.py`` (megatron's
directory layout, what a checkpoint holds, the run's records), ``checkpoint_save.py`` (the
save and the tracker), ``resume_rules.py`` (what a resume may change), ``rng_state.py`` (each
rank's RNG states); every public name of theirs is importable from here.

Nothing that changes what is loaded happens silently (``load_checkpoint``): ``--load`` with no
checkpoint is an error naming it, except megatron's auto-resume idiom (``--load`` = ``--save``);
the saved settings that change the model (and the data path) must equal the run's; every
tensor the model asks for must be in the checkpoint and every tensor in it must be asked
for, except the parts deliberately not loaded (``--finetune``, ``--no-load-optim``,
``--no-load-rng``, RNG states at another layout), each said in a line. ``load_checkpoint``
skips any ``iter_*`` directory without ``metadata.json``.

The model and optimizer are stored by global keys and boxes, so a run may resume at another
(TP, CP, PP, VPP, DP) layout. Each rank's RNG states are restored when the layout is the
same. Tests patch the resume rules where the load looks them up
(``checkpointing.compare_run_settings``, ``checkpointing.apply_optimizer_settings``).
"""

import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.communication import all_gather_object, broadcast_object, world_group
from megatron.core.dist_checkpointing import storage
from megatron.core.dist_checkpointing.core import CONFIG_FNAME
from megatron.training.checkpoint_layout import (  # noqa: F401 - the front's names
    OPTIMIZER_KEY_PREFIX,
    TRACKER_FILENAME,
    checkpoint_dir,
    directory_bytes,
    find_latest_checkpoint,
    is_adapter,
    iteration_of,
    layout_record,
    model_keys,
    model_sharded_state_dict,
    select,
    settings_record,
)
from megatron.training.checkpoint_save import save_checkpoint  # noqa: F401
from megatron.training.initialize import is_rank_zero
from megatron.training.lora_base import LORA_BASE_KEY, check_lora_base
from megatron.training.resume_rules import (  # noqa: F401 - the front's names
    APPLIED,
    DATA_SETTINGS,
    FRESH_ONLY,
    LORA_SETTINGS,
    MODEL_SETTINGS,
    OPTIMIZER_RESUME_RULES,
    OPTIMIZER_SETTINGS,
    SCHEDULE,
    apply_optimizer_settings,
    compare_optimizer_settings,
    compare_run_settings,
)
from megatron.training.rng_state import RNG_KEY_PREFIX, rng_object, set_rng_state


def load_checkpoint(
    load_dir: str,
    model: List[torch.nn.Module],
    optimizer,
    opt_param_scheduler=None,
    layout: Optional[Dict[str, Any]] = None,
    *,
    save_dir: Optional[str] = None,
    run_settings: Optional[Dict[str, Any]] = None,
    ckpt_step: Optional[int] = None,
    finetune: bool = False,
    load_optim: bool = True,
    load_rng: bool = True,
    train_iters: Optional[int] = None,
    exit_on_missing_checkpoint: bool = False,
    override_scheduler: bool = False,
    use_checkpoint_scheduler: bool = False,
    base_source: Optional[str] = None,
    base_flag: str = "--hf-model / --pretrained-checkpoint",
) -> Tuple[int, int, List[str]]:
    """Collective: restore model, optimizer (and scheduler) from the checkpoint that
    ``--load load_dir`` names (``resolve_checkpoint``). Returns (iteration,
    consumed_samples, notes); (0, 0, notes) only for the auto-resume idiom (``save_dir`` is
    ``load_dir`` and holds no checkpoint yet).

    Refused with an error naming the flags: ``run_settings`` that change the model (or the
    data, unless ``finetune``) against the saved ones (``compare_run_settings``); a
    checkpoint beyond ``train_iters``; keys the model asks for that the checkpoint lacks,
    and keys the checkpoint holds that nothing asks for (other than the optimizer state
    without ``load_optim`` and RNG states not restored). ``finetune``: the model only,
    iteration 0 (megatron's ``--finetune``). RNG states are restored only when the saved
    ``layout`` equals ``layout`` (and ``load_rng``). With the optimizer state, each optimizer
    setting that differs from the saved one is applied or refused
    (``compare_optimizer_settings``; ``override_scheduler`` / ``use_checkpoint_scheduler``:
    megatron's ``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler``).

    LoRA: a checkpoint of adapters only (``--save-trainable-params-only``) loads the model's
    adapters, and needs ``base_source`` (the ``--hf-model`` or ``--pretrained-checkpoint``
    the frozen base was loaded from, given by ``base_flag``), whose files must be those the
    checkpoint recorded (``lora_base.check_lora_base``); with ``finetune``, a checkpoint
    without adapters (a base model) loads into a model with adapters, which keep their fresh
    initialization.
    """
    directory, notes = _agree_or_raise(
        lambda: resolve_checkpoint(load_dir, save_dir, ckpt_step, exit_on_missing_checkpoint)
    )
    if directory is None:
        return 0, 0, notes
    started = time.perf_counter()
    common = dist_checkpointing.load_common_state_dict(str(directory))
    saved_iteration = int(common.get("iteration", 0))
    where = f"--load {load_dir}: checkpoint {directory}"
    optimizer_notes = _check_resume(
        common, run_settings, directory, where, finetune, load_optim, train_iters,
        (override_scheduler, use_checkpoint_scheduler),
    )  # fmt: skip
    load_optim = load_optim and not finetune
    restore_rng = load_rng and not finetune and common.get("layout") == dict(layout or {})
    model_state = model_sharded_state_dict(model)
    part = _model_part(common, model_state, where, finetune, base_source, base_flag, notes)
    if part is not None:
        model_state = select(model_state, adapters=part == "adapters")
    request: Dict[str, Any] = dict(model_state)
    if load_optim:
        request["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=True)
    if restore_rng:
        request["rng_state"] = rng_object(data=None)
    loaded, missing, unexpected = dist_checkpointing.load(
        request, str(directory), strict="return_all"
    )
    skipped = () if load_optim else (OPTIMIZER_KEY_PREFIX,)
    skipped += () if restore_rng else (RNG_KEY_PREFIX,)
    _check_keys(directory, missing, unexpected, skipped)
    _load_model(model, loaded, part, directory)
    if load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
        apply_optimizer_settings(optimizer, run_settings or {}, override_scheduler)
        if opt_param_scheduler is not None and "opt_param_scheduler" in loaded:
            opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if restore_rng:
        set_rng_state(loaded["rng_state"])
    iteration = 0 if finetune else saved_iteration
    consumed = 0 if finetune else int(loaded.get("consumed_samples", 0))
    notes.append(
        f"loaded checkpoint of iteration {saved_iteration} from {directory} "
        f"({directory_bytes(directory) / 1e6:.1f} MB, {time.perf_counter() - started:.2f} s)"
    )
    notes += optimizer_notes
    notes += _load_notes(
        iteration, finetune, load_optim, load_rng, restore_rng, train_iters,
        (common.get("layout"), dict(layout or {})),
    )  # fmt: skip
    return iteration, consumed, notes


def _check_resume(
    common: Dict[str, Any],
    run_settings: Optional[Dict[str, Any]],
    directory: Path,
    where: str,
    finetune: bool,
    load_optim: bool,
    train_iters: Optional[int],
    scheduler_flags: Tuple[bool, bool],
) -> List[str]:
    """Refuse a resume the checkpoint's record does not allow (``compare_run_settings``, an
    iteration beyond ``train_iters``, a model-only checkpoint with the optimizer state asked
    for); returns the optimizer settings' notes (``compare_optimizer_settings``)."""
    saved_iteration = int(common.get("iteration", 0))
    if run_settings is not None:
        compare_run_settings(
            common.get("run_settings"), run_settings, directory, finetune, load_optim
        )
    load_optim = load_optim and not finetune
    optimizer_notes = []
    if run_settings is not None and load_optim:
        optimizer_notes = compare_optimizer_settings(
            common.get("run_settings"), run_settings, directory, *scheduler_flags
        )
    if not finetune and train_iters is not None and saved_iteration > train_iters:
        raise ValueError(
            f"{where} is at iteration {saved_iteration}, beyond --train-iters {train_iters}; "
            "raise --train-iters, or pass --finetune to train its weights from iteration 0"
        )
    if not finetune and "args" in common and "run_settings" not in common:
        raise ValueError(
            f"{where} was written by Megatron-LM's trainer (its common.pt holds Megatron-LM's "
            "args, not this trainer's run record): its optimizer, scheduler and RNG states are "
            "in Megatron-LM's own layouts and are not read here; pass --finetune to train its "
            "model weights from iteration 0 (the model flags must describe its model)"
        )
    if load_optim and _model_only(common, directory):
        raise ValueError(
            f"{where} holds no optimizer state (model weights only: written by python -m "
            "megatron.training.hf import, or megatron-core's dist_checkpointing.save of a "
            "model's sharded_state_dict); pass --finetune to train its weights from iteration "
            "0, or --no-load-optim"
        )
    return optimizer_notes


def _model_only(common: Dict[str, Any], directory: Path) -> bool:
    """Whether the checkpoint holds model weights only: marked so (``hf import``), or not
    written by this trainer (no run record; an SGD run of ours may store no state) and
    without any stored ``optimizer.*`` tensor (the stored keys read only then)."""
    if common.get("model_only"):
        return True
    if "run_settings" in common:
        return False
    stored = storage.stored_tensor_shapes(storage.read_metadata(directory))
    return not any(key.startswith(OPTIMIZER_KEY_PREFIX) for key in stored)


def _model_part(
    common: Dict[str, Any],
    model_state: Dict[str, Any],
    where: str,
    finetune: bool,
    base_source: Optional[str],
    base_flag: str,
    notes: List[str],
) -> Optional[str]:
    """Which part of a LoRA model the checkpoint gives: None (all of it), "adapters" (a
    ``--save-trainable-params-only`` checkpoint, on the base it recorded) or "base" (a model
    without adapters, with ``finetune``: the adapters start fresh, said in ``notes``)."""
    has_adapters = any(is_adapter(k) for k in model_keys(model_state))
    if common.get("trainable_params_only"):
        if not has_adapters:
            raise ValueError(
                f"{where} holds LoRA adapters only (--save-trainable-params-only); pass "
                "--lora-dim and the base model (--hf-model or --pretrained-checkpoint) it was "
                "trained on"
            )
        if base_source is None:
            raise ValueError(
                f"{where} holds LoRA adapters only; the frozen base must come from --hf-model "
                "or --pretrained-checkpoint"
            )
        check_lora_base(
            common.get(LORA_BASE_KEY), base_flag, base_source, where, base_weights(base_source)
        )
        return "adapters"
    if has_adapters and not (common.get("run_settings") or {}).get("lora_dim"):
        if not finetune:
            raise ValueError(
                f"{where} is a model without LoRA adapters; to train adapters on it pass "
                "--finetune (or --pretrained-checkpoint)"
            )
        notes.append("the checkpoint is a base model: the LoRA adapters start fresh")
        return "base"
    return None


def _load_model(
    model: List[torch.nn.Module], loaded: Dict[str, Any], part: Optional[str], directory: Path
) -> None:
    """Load each chunk's state; with ``part``, only the other part's keys may be missing."""
    chunks = [getattr(chunk, "module", chunk) for chunk in model]
    for i, chunk in enumerate(chunks):
        state = loaded["model" if len(chunks) == 1 else f"model{i}"]
        result = chunk.load_state_dict(state, strict=part is None)
        if part is not None:  # only the keys of the other part may be left out
            wrong = [k for k in result.missing_keys if is_adapter(k) == (part == "adapters")]
            if wrong or result.unexpected_keys:
                raise dist_checkpointing.CheckpointingException(
                    f"--load: checkpoint {directory}: {_few(wrong + result.unexpected_keys)} "
                    "not loaded"
                )


def _load_notes(
    iteration: int,
    finetune: bool,
    load_optim: bool,
    load_rng: bool,
    restore_rng: bool,
    train_iters: Optional[int],
    layouts: Tuple[Any, Dict[str, Any]],
) -> List[str]:
    """The lines saying what the load deliberately left out (and when nothing is left)."""
    notes = []
    if finetune:
        notes.append("--finetune: model weights only; training starts at iteration 0")
    elif not load_optim:
        notes.append(
            "--no-load-optim: optimizer state not loaded (Adam moments start at zero; the "
            f"learning-rate schedule continues from iteration {iteration})"
        )
    if not finetune and not restore_rng:
        notes.append(
            "--no-load-rng: RNG states not restored"
            if not load_rng
            else f"layout changed ({layouts[0]} -> {layouts[1]}): RNG states "
            "not restored (weights, optimizer state and data position are)"
        )
    if not finetune and train_iters is not None and iteration == train_iters:
        notes.append(f"the checkpoint is at --train-iters {train_iters}: nothing left to train")
    return notes


def resolve_checkpoint(
    load_dir: str,
    save_dir: Optional[str] = None,
    ckpt_step: Optional[int] = None,
    exit_on_missing_checkpoint: bool = False,
) -> Tuple[Optional[Path], List[str]]:
    """(the checkpoint directory ``--load load_dir`` names, notes).

    ``load_dir`` may be a complete checkpoint's own directory (``.../iter_0000004``), or a
    ``--save`` directory: then ``DIR/iter_<ckpt_step>`` when ``ckpt_step`` is given, else the
    newest complete checkpoint (``find_latest_checkpoint``). A path with no checkpoint is an
    error naming ``--load``, except megatron's auto-resume idiom (``save_dir`` is the same
    directory): then (None, notes) and the notes say "starting from scratch", unless
    ``exit_on_missing_checkpoint`` (megatron's ``--exit-on-missing-checkpoint``).
    """
    root = Path(load_dir)
    same_as_save = save_dir is not None and _same_path(load_dir, save_dir)
    auto_resume = same_as_save and not exit_on_missing_checkpoint
    scratch = f"--load {load_dir} is the --save directory and holds no checkpoint yet: "
    scratch += "starting from scratch"
    if same_as_save:
        hint = " (and --exit-on-missing-checkpoint refuses to start from scratch)"
    else:
        hint = (
            " (to resume automatically when a checkpoint exists, pass the same DIR to --save "
            "and --load)"
        )
    if not root.exists():
        if auto_resume:
            return None, [scratch]
        raise ValueError(
            f"--load {load_dir}: no such directory; expected a --save directory or one "
            f"checkpoint's iter_NNNNNNN directory{hint}"
        )
    if not root.is_dir():
        raise ValueError(f"--load {load_dir} is a file; expected a checkpoint directory")
    if dist_checkpointing.check_is_distributed_checkpoint(str(root)):
        step = iteration_of(root)
        if ckpt_step is not None and step is not None and step != ckpt_step:
            raise ValueError(
                f"--ckpt-step {ckpt_step} contradicts --load {load_dir}, the checkpoint of "
                f"iteration {step}; give the --save directory with --ckpt-step, or one of them"
            )
        return root, []
    if iteration_of(root) is not None:
        raise ValueError(
            f"--load {load_dir}: an incomplete checkpoint (no {CONFIG_FNAME}: its save did not "
            f"finish); load the --save directory {root.parent} to take its newest complete "
            "checkpoint"
        )
    if ckpt_step is not None:
        directory = checkpoint_dir(load_dir, ckpt_step)
        if not dist_checkpointing.check_is_distributed_checkpoint(str(directory)):
            have = sorted(
                p.name
                for p in root.glob("iter_*")
                if dist_checkpointing.check_is_distributed_checkpoint(str(p))
            )
            raise ValueError(
                f"--ckpt-step {ckpt_step}: {directory} is not a complete checkpoint; "
                f"{load_dir} holds {', '.join(have) if have else 'none'}"
            )
        return directory, []
    iteration, notes = find_latest_checkpoint(load_dir)
    if iteration is None:
        if auto_resume:
            return None, notes + [scratch]
        skipped = f" ({'; '.join(notes)})" if notes else ""
        raise ValueError(
            f"--load {load_dir}: no complete checkpoint in this directory{skipped}; expected "
            f"iter_NNNNNNN/ directories with {CONFIG_FNAME}, as --save writes them{hint}"
        )
    return checkpoint_dir(load_dir, iteration), notes


def _check_keys(directory: Path, missing, unexpected, skipped: Tuple[str, ...]) -> None:
    """Every rank: refuse keys the model asked for that the checkpoint lacks (any rank's)
    and checkpoint keys nothing asked for, except the parts deliberately not loaded and
    modules' ``_extra_state`` objects (no weights: megatron-core's linears store None there,
    Transformer Engine's its FP8 scaling state, which this package does not use; a
    checkpoint written by megatron-core has them for modules this package has not)."""
    unexpected = set().union(*all_gather_object(sorted(unexpected), world_group()))
    dropped = sorted(k for k in missing if not k.startswith(skipped) and not _extra_state(k))
    problems = []
    if unexpected:
        problems.append(f"the model asks for {_few(unexpected)}, which the checkpoint lacks")
    if dropped:
        problems.append(
            f"the checkpoint holds {_few(dropped)}, which this model does not ask for (they "
            "would be dropped)"
        )
    if problems:
        raise dist_checkpointing.CheckpointingException(
            f"--load: checkpoint {directory} does not fit this model: {'; '.join(problems)}"
        )


def _extra_state(key: str) -> bool:
    """A module's ``_extra_state`` object (``...linear_fc1._extra_state/shard_0_1``)."""
    return key.rpartition("/")[0].endswith("._extra_state") or key.endswith("._extra_state")


def _few(keys, limit: int = 6) -> str:
    """The first ``limit`` of ``keys`` (sorted) and how many more."""
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _same_path(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` name the same directory."""
    return os.path.realpath(a) == os.path.realpath(b)


def base_weights(path: str) -> str:
    """The folder whose files hold a LoRA base's weights: a HuggingFace folder itself, else
    the iteration of the checkpoint at ``path`` that loads (``lora_base``)."""
    if any(Path(path).glob("*.safetensors")):
        return path
    return str(resolve_checkpoint(path)[0])


def _agree_or_raise(compute):
    """``compute()`` on rank 0, its result on every rank; when it raised, the same error
    (its type and message) on every rank instead of rank 0 alone."""
    if not dist.is_initialized():
        return compute()
    outcome, error = None, None
    if is_rank_zero():
        try:
            outcome = ("value", compute())
        except Exception as err:  # noqa: BLE001 - every rank must hear of any failure
            outcome, error = ("error", type(err), str(err)), err
    outcome = broadcast_object(outcome, world_group())  # all ranks act on one checkpoint
    if outcome[0] == "value":
        return outcome[1]
    if error is not None:
        raise error
    try:
        copy = outcome[1](outcome[2])
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        copy = RuntimeError(f"{outcome[1].__name__}: {outcome[2]}")
    raise copy
