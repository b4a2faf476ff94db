"""The rules of the ``--dpo`` flags (``validation.validate_config`` calls ``check_dpo``; no
torch here): each refusal names the flag, its value and what was expected."""

from typing import Any

from megatron.training.errors import UsageError

DPO_FIELDS = (
    "dpo_beta",
    "dpo_loss_type",
    "dpo_label_smoothing",
    "dpo_sft_weight",
    "dpo_reference_free",
    "dpo_reference_hf_model",
)
# (field, flag, why it cannot go with --dpo): a setting the preference objective would ignore
_NOT_WITH_DPO = (
    (
        "calculate_per_token_loss",
        "--calculate-per-token-loss",
        "the DPO objective has its own normalization (the pair mean over the global batch)",
    ),
    (
        "per_shard_loss_normalization",
        "--per-shard-loss-normalization",
        "it emulates an SFT normalization",
    ),
    (
        "label_smoothing",
        "--label-smoothing",
        "DPO needs the completions' plain log-probabilities (--dpo-label-smoothing is DPO's)",
    ),
    ("skip_train", "--skip-train", "an evaluation-only DPO run is not supported yet"),
)


def check_dpo(c: Any) -> None:
    """The ``--dpo-*`` flags need ``--dpo``; with it, the combinations it refuses."""
    defaults = {name: _default(c, name) for name in DPO_FIELDS}
    if not c.dpo:
        for name, default in defaults.items():
            value = getattr(c, name)
            _require(value == default, f"{_flag(name)} {value} needs --dpo (SFT without it)")
        return
    for name, flag, why in _NOT_WITH_DPO:
        value = getattr(c, name)
        shown = flag if value is True else f"{flag} {value}"
        _require(value in (None, False, 0, 0.0), f"{shown} with --dpo: {why}")
    _require(
        c.dpo_label_smoothing == 0 or c.dpo_loss_type == "sigmoid",
        f"--dpo-label-smoothing {c.dpo_label_smoothing} with --dpo-loss-type "
        f"{c.dpo_loss_type}: label smoothing is defined for the sigmoid loss only",
    )
    _require(
        not (c.dpo_reference_free and c.dpo_reference_hf_model),
        f"--dpo-reference-free and --dpo-reference-hf-model {c.dpo_reference_hf_model}: "
        "pass one (reference-free means no reference model)",
    )
    adapters_off = c.lora_dim is not None and not (c.dpo_reference_free or c.dpo_reference_hf_model)
    _require(
        not (adapters_off and c.moe_router_enable_expert_bias),
        "--moe-router-enable-expert-bias with --dpo and --lora-dim: the reference pass (the "
        "policy with its adapters off) would add its routing counts to the expert-bias update; "
        "pass --dpo-reference-hf-model DIR or --dpo-reference-free",
    )
    # --load without --finetune (a resume): the reference's recorded source is checked when
    # the checkpoint is read (dpo_reference.reference_source, preflight and the trainer)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default(c: Any, name: str) -> Any:
    return next(f.default for f in c.__dataclass_fields__.values() if f.name == name)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)
