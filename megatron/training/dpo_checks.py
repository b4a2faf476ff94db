"""The rules of the ``--dpo`` flags (``validation.validate_config`` calls ``check_dpo``; no
torch here): each refusal names the flag, its value and what was expected."""

from typing import Any

from megatron.training import flag_checks
from megatron.training.flag_checks import require

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
    defaults = {name: flag_checks.default(c, name) for name in DPO_FIELDS}
    if not c.dpo:
        for name, default in defaults.items():
            value = getattr(c, name)
            require(
                value == default,
                f"{flag_checks.flag(c, name)} {value} needs --dpo (SFT without it)",
            )
        return
    for name, flag, why in _NOT_WITH_DPO:
        value = getattr(c, name)
        shown = flag if value is True else f"{flag} {value}"
        require(value in (None, False, 0, 0.0), f"{shown} with --dpo: {why}")
    require(
        c.dpo_label_smoothing == 0 or c.dpo_loss_type == "sigmoid",
        f"--dpo-label-smoothing {c.dpo_label_smoothing} with --dpo-loss-type "
        f"{c.dpo_loss_type}: label smoothing is defined for the sigmoid loss only",
    )
    require(
        not (c.dpo_reference_free and c.dpo_reference_hf_model),
        f"--dpo-reference-free and --dpo-reference-hf-model {c.dpo_reference_hf_model}: "
        "pass one (reference-free means no reference model)",
    )
    adapters_off = c.lora_dim is not None and not (c.dpo_reference_free or c.dpo_reference_hf_model)
    require(
        not (adapters_off and c.moe_router_enable_expert_bias),
        "--moe-router-enable-expert-bias with --dpo and --lora-dim: the reference pass (the "
        "policy with its adapters off) would add its routing counts to the expert-bias update; "
        "pass --dpo-reference-hf-model DIR or --dpo-reference-free",
    )
    if c.pack_sequences:
        check_packed_pairs(c)
    # --load without --finetune (a resume): the reference's recorded source is checked when
    # the checkpoint is read (dpo_reference.reference_source: once a process, by the
    # command line's preflight or by pretrain)


def check_packed_pairs(c: Any) -> None:
    """--dpo --pack-sequences: each micro-batch's pairs in one row of its own length, so the
    data-parallel ranks (and the micro-batches between pipeline stages) hold rows of
    different lengths; an expert layer's dispatcher must take unequal token counts."""
    if c.num_experts is None:
        return
    pp, ep = c.pipeline_model_parallel_size, c.expert_model_parallel_size
    tp, etp = c.tensor_model_parallel_size, c.expert_tensor_parallel_size or 1
    if c.moe_token_dispatcher_type == "allgather":
        require(
            pp == 1 and ep == 1,
            f"--moe-token-dispatcher-type allgather with --dpo --pack-sequences and --pp {pp} "
            f"--expert-model-parallel-size {ep}: rows of packed pairs differ in length between "
            "data-parallel ranks and pipeline micro-batches, and the allgather dispatcher needs "
            "equal token counts; pass --moe-token-dispatcher-type alltoall",
        )
    require(
        c.expert_tensor_parallel_size is None or etp <= tp,
        f"--expert-tensor-parallel-size {etp} > --tp {tp} with --dpo --pack-sequences: the "
        "expert tensor-parallel group would gather rows of different lengths from "
        f"data-parallel ranks; pass --expert-tensor-parallel-size {tp} or less",
    )


def variable_seq_lengths(c: Any) -> bool:
    """Whether pipeline messages carry their shape: rows of packed pairs over PP > 1."""
    return bool(c.dpo and c.pack_sequences and c.pipeline_model_parallel_size > 1)
