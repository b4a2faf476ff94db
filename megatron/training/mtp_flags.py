"""The multi-token prediction flags (megatron's names; docs/deepseek.md), checked up front
with the flags named: ``--mtp-num-layers K`` adds K MTP depths on the last pipeline stage
(a DeepSeek-V3 ``--hf-model`` brings its own; ``--export-hf`` of a model the flags built
needs a family that carries them, ``preflight.check_export_family``),
``--mtp-loss-scaling-factor`` weighs their mean loss (megatron's default 0.1). No torch here
(the self-launching process validates before importing it)."""

from typing import Any, Callable

from megatron.training.errors import UsageError


def check_mtp_flags(c: Any, given: Callable[[str], bool]) -> None:
    """Raise ``UsageError`` naming the flag for an MTP flag that would be ignored or asks for
    what is not implemented; ``given(name)``: the flag was on the command line.
    ``--mtp-num-layers 0`` drops a ``--hf-model`` checkpoint's MTP layers (no depths)."""
    if c.mtp_num_layers == 0 and c.hf_model is None:
        raise UsageError(
            "--mtp-num-layers must be an integer >= 1, got 0 (0 only drops the multi-token "
            "prediction layers of a --hf-model checkpoint; leave the flag out for none)"
        )
    if not c.mtp_num_layers:
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
            c.position_embedding_type == "learned_absolute" and c.pipeline_model_parallel_size > 1,
            f"--position-embedding-type learned_absolute and --pp "
            f"{c.pipeline_model_parallel_size}: the MTP stage's copy of the position "
            "embeddings would not be tied; expected rope or --pp 1",
        ),
    )
    for bad, why in refused:
        if bad:
            raise UsageError(f"{mtp} with {why}")
