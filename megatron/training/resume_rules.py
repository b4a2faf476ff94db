"""What a resume may change: the rules that decide what a checkpoint's recorded settings mean
for this run (``--load``).

The settings that change the model (and, unless ``--finetune``, the data; with the optimizer
state, its form) must equal the saved ones (``compare_run_settings``); each optimizer setting
that differs is applied or refused by its rule (``OPTIMIZER_RESUME_RULES``,
``compare_optimizer_settings``, ``apply_optimizer_settings``). ``checkpointing.load_checkpoint``
and the command line's preflight (``preflight.py``) call them; tests patch them where the load
looks them up (``checkpointing.compare_run_settings``).
"""

import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from megatron.training.arguments import TrainingConfig, flag_of
from megatron.training.errors import SettingsConflict
from megatron.training.model_settings import resolved_model
from megatron.training.options import DATA, MODEL, PRECISION, fields_of_kind

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
    checked = MODEL_SETTINGS + (() if finetune else DATA_SETTINGS + resumed_run_settings(saved))
    if not before.get("lora_dim"):  # a base model for new LoRA adapters (load_checkpoint
        # asks for --finetune when it is loaded as a resume)
        checked = tuple(n for n in checked if n not in LORA_SETTINGS)
    differences = [_change(name, before, now) for name in _differing(checked, before, now)]
    if differences:
        escape = "" if finetune else "; --finetune allows other data, not another model"
        raise SettingsConflict(
            f"--load: checkpoint {directory} was saved with other settings (resume with the "
            f"saved values: leave these flags out and --load adopts them{escape}):\n"
            + "\n".join(f"  {line}" for line in differences)
        )
    form = OPTIMIZER_SETTINGS if load_optim and not finetune else ()
    precision = [_change(name, before, now) for name in _differing(form, before, now)]
    if precision:
        raise ValueError(
            f"--load: checkpoint {directory} was saved with {'; '.join(precision)}: its "
            "optimizer state has another form (fp32 main parameters, loss scale). Resume with "
            "the saved value, or pass --no-load-optim to load the weights and start the "
            "optimizer afresh"
        )


def resumed_run_settings(saved: Dict[str, Any]) -> tuple:
    """The run settings (``kind=RUN``) a resume keeps as data settings: ``--seed`` (the
    generated samples or pairs and the per-epoch shuffle of a data file's records come from
    it: SFT, pretraining and DPO alike); ``--load`` adopts it, and another value is refused
    by name."""
    return ("seed",) if "seed" in saved else ()


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
    "sgd_momentum": APPLIED,  # the momentum buffer continues with the new factor
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
    "mtp_loss_scaling_factor": APPLIED,  # the MTP loss's weight, read at every step
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
    changed = _differing(OPTIMIZER_RESUME_RULES, saved, current)
    styles = {saved.get("lr_decay_style", "constant"), current.get("lr_decay_style", "constant")}
    if styles == {"constant"} and "train_iters" in changed:
        changed.remove("train_iters")  # a constant rate has no decay horizon

    def line(name: str) -> str:
        return _change(name, saved, current)

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


def _differing(names, before: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    """The settings of ``names`` both records hold, with different values."""
    return [n for n in names if n in before and n in now and before[n] != now[n]]


def _change(name: str, before: Dict[str, Any], now: Dict[str, Any]) -> str:
    """One differing setting in a message: its flag, the saved and the current value."""
    return f"{flag_of(name)} {_shown(before[name])} when saved, {_shown(now[name])} now"


def _shown(value: Any) -> str:
    """A setting's value in a message: a string quoted, None as "not given"."""
    if value is None:
        return "not given"
    return repr(value) if isinstance(value, str) else str(value)
