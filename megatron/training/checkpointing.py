"""Saving and resuming training: ``--save DIR``, ``--load DIR``, ``--save-interval N``.

Megatron's directory layout: ``DIR/iter_0000010/`` holds one ``dist_checkpointing``
checkpoint (model chunks, optimizer state, and the common state: iteration, consumed
samples, the optimizer-parameter scheduler, the run's layout and settings) and
``DIR/latest_checkpointed_iteration.txt`` names the newest complete one. The tracker is
replaced atomically by rank 0 only after every rank has finished writing (``save`` ends
with ``metadata.json`` and a barrier), so an interrupted save leaves the tracker on the
previous checkpoint; ``load_checkpoint`` also skips any ``iter_*`` directory without
``metadata.json``.

Nothing that changes what is loaded happens silently (``load_checkpoint``): ``--load`` with no
checkpoint is an error naming it, except megatron's auto-resume idiom (``--load`` = ``--save``);
the saved settings that change the model (and the data path) must equal the run's; every
tensor the model asks for must be in the checkpoint and every tensor in it must be asked
for, except the parts deliberately not loaded (``--finetune``, ``--no-load-optim``,
``--no-load-rng``, RNG states at another layout), each said in a line.

The model and optimizer are stored by global keys and boxes, so a run may resume at another
(TP, CP, PP, VPP, DP) layout. Each rank's RNG states are saved too and restored when the
layout is the same (at another layout the ranks do not correspond; the trainer draws no
random numbers after building the model, whose weights are seeded per parameter).

Why one module of ~730 lines: it is one concern, what a resume may and may not change. The
save, the load and the rules that decide what a checkpoint's settings mean for this run
(``compare_run_settings``, ``OPTIMIZER_RESUME_RULES``) read the same records, and tests
patch the rules where the load looks them up (``checkpointing.compare_run_settings``).
"""

import os
import random
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron.core import dist_checkpointing
from megatron.core.communication import all_gather_object, barrier, broadcast_object, world_group
from megatron.core.dist_checkpointing import ShardedObject
from megatron.core.dist_checkpointing.core import CONFIG_FNAME
from megatron.training.arguments import TrainingConfig, flag_of
from megatron.training.errors import SettingsConflict
from megatron.training.lora_base import LORA_BASE_KEY, check_lora_base
from megatron.training.model_settings import resolved_model
from megatron.training.options import DATA, MODEL, PRECISION, fields_of_kind

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


def checkpoint_dir(save_dir: str, iteration: int) -> Path:
    """``save_dir/iter_<7-digit iteration>``."""
    return Path(save_dir) / f"iter_{iteration:07d}"


def save_checkpoint(
    save_dir: str,
    iteration: int,
    model: List[torch.nn.Module],
    optimizer,
    opt_param_scheduler=None,
    layout: Optional[Dict[str, Any]] = None,
    consumed_samples: int = 0,
    run_settings: Optional[Dict[str, Any]] = None,
    trainable_only: bool = False,
    lora_base: Optional[Dict[str, str]] = None,
) -> Path:
    """Collective: write ``save_dir/iter_<iteration>`` and then point the tracker at it.

    ``trainable_only`` (``--save-trainable-params-only``): only the LoRA adapters of the
    model (and the optimizer state, which is theirs alone); the frozen base is not written.
    ``lora_base``: a LoRA run's base (``lora_base.lora_base_record``), recorded for the
    resume check and the PEFT export. A save refused before anything was written removes the
    directory it created.

    ``model``: this rank's chunks (DDP-wrapped or not). ``optimizer``: anything with
    ``sharded_state_dict(model_sharded_state_dict)``. ``layout`` and ``run_settings`` are
    plain dicts kept in the common state (for the RNG decision and for the comparison on
    resume). Rank 0 prints one line: iteration, directory, size and time.
    """
    started = time.perf_counter()
    directory = checkpoint_dir(save_dir, iteration)
    created = _rank() == 0 and not directory.exists()
    if _rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    barrier(world_group())
    try:
        _write_checkpoint(
            directory, model, optimizer, opt_param_scheduler, trainable_only,
            dict(iteration=iteration, consumed_samples=consumed_samples,
                 layout=dict(layout or {}), run_settings=dict(run_settings or {})),
            lora_base,
        )  # fmt: skip
    except BaseException:
        # a save refused before anything was written leaves no empty iter_*; what a save
        # that died while writing left stays, as after a kill (load refuses it by name)
        if created and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
        raise
    if _rank() == 0:
        tracker = Path(save_dir) / TRACKER_FILENAME
        tmp = tracker.with_name(tracker.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, tracker)
    barrier(world_group())
    if _rank() == 0:
        tqdm.write(
            f"saved checkpoint at iteration {iteration} to {directory} "
            f"({_directory_bytes(directory) / 1e6:.1f} MB, {time.perf_counter() - started:.2f} s)"
        )
    return directory


def _write_checkpoint(
    directory, model, optimizer, opt_param_scheduler, trainable_only, records, lora_base
) -> None:
    """``dist_checkpointing.save`` of the model (or its adapters), the optimizer, the
    scheduler and the common ``records`` into ``directory`` (collective)."""
    model_state = _model_sharded_state_dict(model)
    if trainable_only:
        model_state = _select(model_state, adapters=True)
    state = {
        **model_state,
        "trainable_params_only": trainable_only,
        "optimizer": optimizer.sharded_state_dict(model_state),
        **records,
        "rng_state": _rng_object(),
        "checkpoint_version": 3.0,
    }
    if lora_base is not None:
        state[LORA_BASE_KEY] = dict(lora_base)
    if opt_param_scheduler is not None:
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    dist_checkpointing.save(state, str(directory))


def find_latest_checkpoint(load_dir: str) -> Tuple[Optional[int], List[str]]:
    """(the iteration of the newest complete checkpoint in ``load_dir`` or None, notes on
    what was skipped). The tracker's choice wins when complete; otherwise the newest
    ``iter_*`` directory with ``metadata.json``."""
    notes: List[str] = []
    root = Path(load_dir)
    tracker = root / TRACKER_FILENAME
    if tracker.exists():
        text = tracker.read_text().strip()
        if text.isdigit():
            iteration = int(text)
            if dist_checkpointing.check_is_distributed_checkpoint(
                str(checkpoint_dir(load_dir, iteration))
            ):
                return iteration, notes
            notes.append(f"{TRACKER_FILENAME} names iteration {iteration}, which is incomplete")
        else:
            notes.append(f"{TRACKER_FILENAME} holds {text!r}, not an iteration")
    candidates = []
    for path in root.glob("iter_*"):
        suffix = path.name[len("iter_") :]
        if not suffix.isdigit():
            continue
        if dist_checkpointing.check_is_distributed_checkpoint(str(path)):
            candidates.append(int(suffix))
        else:
            notes.append(f"{path.name} is incomplete (no metadata.json): skipped")
    return (max(candidates) if candidates else None), notes


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
    if run_settings is not None:
        compare_run_settings(
            common.get("run_settings"), run_settings, directory, finetune, load_optim
        )
    load_optim = load_optim and not finetune
    optimizer_notes = []
    if run_settings is not None and load_optim:
        optimizer_notes = compare_optimizer_settings(
            common.get("run_settings"),
            run_settings,
            directory,
            override_scheduler,
            use_checkpoint_scheduler,
        )
    if not finetune and train_iters is not None and saved_iteration > train_iters:
        raise ValueError(
            f"--load {load_dir}: checkpoint {directory} is at iteration {saved_iteration}, "
            f"beyond --train-iters {train_iters}; raise --train-iters, or pass --finetune to "
            "train its weights from iteration 0"
        )
    if common.get("model_only") and load_optim:
        raise ValueError(
            f"--load {load_dir}: checkpoint {directory} holds model weights only (written by "
            "python -m megatron.training.hf import); pass --finetune (or --no-load-optim)"
        )
    same_layout = common.get("layout") == dict(layout or {})
    restore_rng = load_rng and not finetune and same_layout
    model_state = _model_sharded_state_dict(model)
    has_adapters = any(_is_adapter(k) for k in _model_keys(model_state))
    part = None  # which part of the model the checkpoint gives: None = all of it
    if common.get("trainable_params_only"):
        if not has_adapters:
            raise ValueError(
                f"--load {load_dir}: checkpoint {directory} holds LoRA adapters only "
                "(--save-trainable-params-only); pass --lora-dim and the base model "
                "(--hf-model or --pretrained-checkpoint) it was trained on"
            )
        if base_source is None:
            raise ValueError(
                f"--load {load_dir}: checkpoint {directory} holds LoRA adapters only; the "
                "frozen base must come from --hf-model or --pretrained-checkpoint"
            )
        where = f"--load {load_dir}: checkpoint {directory}"
        check_lora_base(
            common.get(LORA_BASE_KEY), base_flag, base_source, where, base_weights(base_source)
        )
        part = "adapters"
    elif has_adapters and not (common.get("run_settings") or {}).get("lora_dim"):
        if not finetune:
            raise ValueError(
                f"--load {load_dir}: checkpoint {directory} is a model without LoRA adapters; "
                "to train adapters on it pass --finetune (or --pretrained-checkpoint)"
            )
        part = "base"
        notes.append("the checkpoint is a base model: the LoRA adapters start fresh")
    if part is not None:
        model_state = _select(model_state, adapters=part == "adapters")
    request: Dict[str, Any] = dict(model_state)
    if load_optim:
        request["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=True)
    if restore_rng:
        request["rng_state"] = _rng_object(data=None)
    loaded, missing, unexpected = dist_checkpointing.load(
        request, str(directory), strict="return_all"
    )
    skipped = () if load_optim else (OPTIMIZER_KEY_PREFIX,)
    skipped += () if restore_rng else (RNG_KEY_PREFIX,)
    _check_keys(directory, missing, unexpected, skipped)

    chunks = [getattr(chunk, "module", chunk) for chunk in model]
    for i, chunk in enumerate(chunks):
        state = loaded["model" if len(chunks) == 1 else f"model{i}"]
        result = chunk.load_state_dict(state, strict=part is None)
        if part is not None:  # only the keys of the other part may be left out
            wrong = [k for k in result.missing_keys if _is_adapter(k) == (part == "adapters")]
            if wrong or result.unexpected_keys:
                raise dist_checkpointing.CheckpointingException(
                    f"--load: checkpoint {directory}: {_few(wrong + result.unexpected_keys)} "
                    "not loaded"
                )
    if load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
        apply_optimizer_settings(optimizer, run_settings or {}, override_scheduler)
        if opt_param_scheduler is not None and "opt_param_scheduler" in loaded:
            opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if restore_rng:
        _set_rng_state(loaded["rng_state"])
    iteration = 0 if finetune else saved_iteration
    consumed = 0 if finetune else int(loaded.get("consumed_samples", 0))
    megabytes = _directory_bytes(directory) / 1e6
    notes.append(
        f"loaded checkpoint of iteration {saved_iteration} from {directory} "
        f"({megabytes:.1f} MB, {time.perf_counter() - started:.2f} s)"
    )
    notes += optimizer_notes
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
            else f"layout changed ({common.get('layout')} -> {dict(layout or {})}): RNG states "
            "not restored (weights, optimizer state and data position are)"
        )
    if not finetune and train_iters is not None and iteration == train_iters:
        notes.append(f"the checkpoint is at --train-iters {train_iters}: nothing left to train")
    return iteration, consumed, notes


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
        step = _iteration_of(root)
        if ckpt_step is not None and step is not None and step != ckpt_step:
            raise ValueError(
                f"--ckpt-step {ckpt_step} contradicts --load {load_dir}, the checkpoint of "
                f"iteration {step}; give the --save directory with --ckpt-step, or one of them"
            )
        return root, []
    if _iteration_of(root) is not None:
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


# The run settings a resume compares, by the kind declared with each ``TrainingConfig`` field
# (``option(..., kind=...)``; errors name their flags, ``arguments.flag_of``):
# what the weights mean (a model setting: saved weights would not fit, or would mean
# something else; with learned absolute positions --seq-length too),
MODEL_SETTINGS = fields_of_kind(TrainingConfig, MODEL)
# the data the run trains on (a resumed run continues its position in it),
DATA_SETTINGS = fields_of_kind(TrainingConfig, DATA)
# and the form of the optimizer state (fp32 main parameters, loss scale): compared only when
# the optimizer state is loaded.
OPTIMIZER_SETTINGS = fields_of_kind(TrainingConfig, PRECISION)
# what a LoRA run adds to its base model's settings
LORA_SETTINGS = tuple(n for n in MODEL_SETTINGS if n.startswith("lora_")) + (
    "pretrained_checkpoint",
)


def compare_run_settings(
    saved: Optional[Dict[str, Any]],
    current: Dict[str, Any],
    directory: Path,
    finetune: bool = False,
    load_optim: bool = True,
) -> None:
    """Refuse to resume with settings that change the model (``MODEL_SETTINGS``), unless
    ``finetune`` the data (``DATA_SETTINGS``), and with ``load_optim`` the form of the
    optimizer state (``OPTIMIZER_SETTINGS``): a ValueError naming every differing flag with
    its saved and current value. Settings the checkpoint did not record are not
    compared. Defaults are resolved first (query groups = heads, FFN = 4 x hidden, the
    byte-level tokenizer with a data path); ``--seq-length`` counts only with learned
    absolute positions (their table has one row per position), ``--tokenizer`` only when
    both runs read a data path."""
    if not saved:
        return
    before, now = _effective_settings(saved), _effective_settings(current)
    checked = MODEL_SETTINGS + (() if finetune else DATA_SETTINGS)
    if not before.get("lora_dim"):  # a base model for new LoRA adapters (load_checkpoint
        # asks for --finetune when it is loaded as a resume)
        checked = tuple(n for n in checked if n not in LORA_SETTINGS)
    differences = [
        f"{flag_of(name)} {_shown(before[name])} when saved, {_shown(now[name])} now"
        for name in checked
        if name in before and name in now and before[name] != now[name]
    ]
    if differences:
        escape = "" if finetune else "; --finetune allows other data, not another model"
        raise SettingsConflict(
            f"--load: checkpoint {directory} was saved with other settings (resume with the "
            f"saved values: leave these flags out and --load adopts them{escape}):\n"
            + "\n".join(f"  {line}" for line in differences)
        )
    precision = [
        f"{flag_of(name)} {_shown(before[name])} when saved, {_shown(now[name])} now"
        for name in (OPTIMIZER_SETTINGS if load_optim and not finetune else ())
        if name in before and name in now and before[name] != now[name]
    ]
    if precision:
        raise ValueError(
            f"--load: checkpoint {directory} was saved with {'; '.join(precision)}: its "
            "optimizer state has another form (fp32 main parameters, loss scale). Resume with "
            "the saved value, or pass --no-load-optim to load the weights and start the "
            "optimizer afresh"
        )


# How a resume treats an optimizer setting (``kind=OPTIMIZER``) whose value differs from the
# checkpoint's record (every such field has a rule; a test holds it so):
SCHEDULE = "schedule"  # megatron's scheduler rule: refused, unless --override-opt_param-
# scheduler (the new value takes effect) or --use-checkpoint-opt_param-scheduler (the saved
# one is kept)
APPLIED = "applied"  # the new value takes effect from the first resumed step (said once)
FRESH_ONLY = "fresh only"  # meaningful only for a fresh optimizer state: refused
OPTIMIZER_RESUME_RULES = {
    "train_iters": SCHEDULE,  # the decay horizon (not with --lr-decay-style constant)
    "lr": SCHEDULE,
    "min_lr": SCHEDULE,
    "lr_warmup_iters": SCHEDULE,
    "lr_decay_style": SCHEDULE,
    "weight_decay": SCHEDULE,
    "adam_beta1": APPLIED,
    "adam_beta2": APPLIED,
    "adam_eps": APPLIED,
    "clip_grad": APPLIED,
    "loss_scale": APPLIED,  # a fixed scale to another fixed scale; to or from dynamic: refused
    "min_loss_scale": APPLIED,
    "loss_scale_window": APPLIED,
    "hysteresis": APPLIED,
    "initial_loss_scale": FRESH_ONLY,  # the dynamic scale continues from the checkpoint's
    # the router losses and the aux-loss-free bias update: read from the run's config at
    # every step, so a new value is the objective from the resumed iteration on
    "moe_aux_loss_coeff": APPLIED,
    "moe_z_loss_coeff": APPLIED,
    "moe_router_load_balancing_type": APPLIED,
    "moe_router_bias_update_rate": APPLIED,
}


# compare_run_settings's parameters (saved settings, current, directory, two resume flags):
# the two rule sets are applied separately (the optimizer's only when its state is loaded).
def compare_optimizer_settings(
    saved: Optional[Dict[str, Any]],
    current: Dict[str, Any],
    directory: Path,
    override_scheduler: bool = False,
    use_checkpoint_scheduler: bool = False,
) -> List[str]:
    """The resume's decision on each optimizer setting that differs from the checkpoint's
    (``OPTIMIZER_RESUME_RULES``; only when the optimizer state is loaded): the notes saying
    which new values take effect and which saved ones are kept, or a ``SettingsConflict``
    naming every refused setting with both values (megatron's
    ``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler``)."""
    if not saved:
        return []
    changed = [
        name
        for name in OPTIMIZER_RESUME_RULES
        if name in saved and name in current and saved[name] != current[name]
    ]
    styles = {saved.get("lr_decay_style", "constant"), current.get("lr_decay_style", "constant")}
    if styles == {"constant"} and "train_iters" in changed:
        changed.remove("train_iters")  # a constant rate has no decay horizon

    def line(name: str) -> str:
        return f"{flag_of(name)} {_shown(saved[name])} when saved, {_shown(current[name])} now"

    refused = [
        name
        for name in changed
        if OPTIMIZER_RESUME_RULES[name] == FRESH_ONLY
        or (name == "loss_scale" and None in (saved[name], current[name]))
    ]
    if refused:
        raise SettingsConflict(
            f"--load: checkpoint {directory} holds an optimizer state whose loss scaling "
            "these settings would not continue (the scale goes on from the saved one); "
            "resume with the saved values, or pass --no-load-optim to start the optimizer "
            "afresh:\n" + "\n".join(f"  {line(name)}" for name in refused)
        )
    schedule = [n for n in changed if OPTIMIZER_RESUME_RULES[n] == SCHEDULE]
    if schedule and not (override_scheduler or use_checkpoint_scheduler):
        raise SettingsConflict(
            f"--load: checkpoint {directory} holds another learning-rate schedule; pass "
            "--override-opt_param-scheduler to train with the new values, or "
            "--use-checkpoint-opt_param-scheduler to keep the saved ones:\n"
            + "\n".join(f"  {line(name)}" for name in schedule)
        )
    notes = []
    for name in changed:
        if OPTIMIZER_RESUME_RULES[name] == APPLIED:
            notes.append(f"{line(name)}: the new value takes effect")
        elif override_scheduler:
            notes.append(
                f"{line(name)}: the new value takes effect (--override-opt_param-scheduler)"
            )
        else:
            notes.append(
                f"{line(name)}: the saved schedule is kept (--use-checkpoint-opt_param-scheduler)"
            )
    return notes


def apply_optimizer_settings(
    optimizer, settings: Dict[str, Any], override_scheduler: bool = False
) -> None:
    """Set Adam's betas and epsilon of every param group from ``settings`` (a loaded
    optimizer state carries the saved ones), and with ``override_scheduler`` the groups'
    peak and final learning rates (``max_lr`` / ``min_lr``, which the schedule reads) too.
    The clipping and loss-scaling settings are read from the run's config at each step."""
    for group in optimizer.param_groups:
        if "betas" in group and "adam_beta1" in settings and "adam_beta2" in settings:
            group["betas"] = (settings["adam_beta1"], settings["adam_beta2"])
        if "eps" in group and "adam_eps" in settings:
            group["eps"] = settings["adam_eps"]
        for key, name in (("max_lr", "lr"), ("min_lr", "min_lr")):
            if override_scheduler and key in group and name in settings:
                group[key] = settings[name]


def _effective_settings(settings: Dict[str, Any]) -> Dict[str, Any]:
    """``settings`` with defaults resolved as the model resolves them (``resolved_model``);
    the tokenizer counts only with a data path, the sequence length only when it sizes the
    learned position table."""
    table_given = settings.get("max_position_embeddings") is not None
    out = resolved_model(settings)
    if out.get("data_path"):
        out["data_path"] = os.path.normpath(out["data_path"])
        out["tokenizer"] = out.get("tokenizer") or "byte-level"
    else:
        out.pop("tokenizer", None)  # generated data: its ids are the vocabulary
    if out.get("position_embedding_type", "learned_absolute") != "learned_absolute":
        out.pop("seq_length", None)
        out.pop("max_position_embeddings", None)
    elif table_given:
        out.pop("seq_length", None)  # the table has max_position_embeddings rows
    return out


def _shown(value: Any) -> str:
    if value is None:
        return "not given"
    return repr(value) if isinstance(value, str) else str(value)


OPTIMIZER_KEY_PREFIX = "optimizer."
RNG_KEY_PREFIX = "rng_state/"


def _check_keys(directory: Path, missing, unexpected, skipped: Tuple[str, ...]) -> None:
    """Every rank: refuse keys the model asked for that the checkpoint lacks (any rank's)
    and checkpoint keys nothing asked for, except the parts deliberately not loaded."""
    unexpected = set().union(*all_gather_object(sorted(unexpected), world_group()))
    dropped = sorted(k for k in missing if not k.startswith(skipped))
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


def _few(keys, limit: int = 6) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _iteration_of(path: Path) -> Optional[int]:
    """N for a directory named ``iter_N`` (digits), else None."""
    suffix = path.name[len("iter_") :]
    return int(suffix) if path.name.startswith("iter_") and suffix.isdigit() else None


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file())


def _model_sharded_state_dict(model: List[torch.nn.Module]) -> Dict[str, Any]:
    """``{"model": ...}`` for one chunk, ``{"model0": ..., "model1": ...}`` with VPP
    (megatron's names; the storage keys inside do not depend on them)."""
    chunks = [getattr(chunk, "module", chunk) for chunk in model]
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _is_adapter(key: str) -> bool:
    """A LoRA adapter's state-dict key (``...linear_qkv.adapter.linear_in.weight``)."""
    return ".adapter." in key


def _model_keys(model_state: Dict[str, Any]) -> List[str]:
    return [k for chunk in model_state.values() for k in chunk]


def _select(model_state: Dict[str, Any], adapters: bool) -> Dict[str, Any]:
    """The adapters' entries of each chunk's sharded state dict, or everything else."""
    return {
        name: {k: v for k, v in chunk.items() if _is_adapter(k) == adapters}
        for name, chunk in model_state.items()
    }


def _rng_object(data: Any = "current") -> ShardedObject:
    """This rank's RNG states as a ShardedObject at its global rank (written by every rank)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if data == "current":
        data = _rng_state()
    return ShardedObject("rng_state", data, (world,), (_rank(),), replica_id=0)


def _rng_state() -> Dict[str, Any]:
    """Python, NumPy, torch CPU (and CUDA) generator states, and the model-parallel RNG
    tracker's, as tensors and plain values (loadable with ``weights_only=True``)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    out = {
        "random": [version, list(state), gauss],
        "np": [np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(saved: Dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, state, gauss = saved["random"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = saved["np"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(saved["torch"])
    if saved.get("tracker"):
        get_cuda_rng_tracker().set_states(saved["tracker"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda"])


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
    if _rank() == 0:
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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
