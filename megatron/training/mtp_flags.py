"""The multi-token prediction flags (megatron's names; docs/deepseek.md), checked up front
with the flags named: ``--mtp-num-layers K`` adds K MTP depths on the last pipeline stage,
``--mtp-loss-scaling-factor`` weighs their mean loss (megatron's default 0.1). No torch here
(the self-launching process validates before importing it)."""

from typing import Any, Callable

from megatron.training.errors import UsageError


def check_mtp_flags(c: Any, given: Callable[[str], bool]) -> None:
    """Raise ``UsageError`` naming the flag for an MTP flag that would be ignored or asks for
    what is not implemented; ``given(name)``: the flag was on the command line."""
    if c.mtp_num_layers is None:
        if given("mtp_loss_scaling_factor"):
            raise UsageError(
                f"--mtp-loss-scaling-factor {c.mtp_loss_scaling_factor} needs --mtp-num-layers "
                "(it weighs the multi-token prediction loss)"
            )
        return
    mtp = f"--mtp-num-layers {c.mtp_num_layers}"
    refused = (
        (c.dpo, "--dpo: the preference loss has no MTP term; expected no --mtp-num-layers"),
        (
            c.export_hf is not None,
            "--export-hf: the HuggingFace export does not write MTP weights yet; expected no "
            "--export-hf",
        ),
        (
            c.hf_model is not None,
            "--hf-model: the HuggingFace loader does not read MTP "
            "weights yet; expected no --mtp-num-layers",
        ),
        (
            c.position_embedding_type == "learned_absolute" and c.pipeline_model_parallel_size > 1,
            f"--position-embedding-type learned_absolute and --pp "
            f"{c.pipeline_model_parallel_size}: the MTP stage's copy of the position "
            "embeddings would not be tied; expected rope or --pp 1",
        ),
    )
    for bad, why in refused:
        if bad:
            raise UsageError(f"{mtp} with {why}")
