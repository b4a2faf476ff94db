"""The FP8 flags (megatron's names; docs/fp8.md), checked up front with the flags named.

``--fp8-format {e4m3,hybrid}`` turns FP8 GEMMs on (``TransformerConfig.fp8``);
``--fp8-recipe`` (megatron's default "delayed"; only "tensorwise" is implemented),
``--fp8-margin``, ``--fp8-amax-history-len`` / ``--fp8-amax-compute-algo`` (delayed scaling
only: their defaults with tensorwise) and ``--no-fp8-wgrad`` need ``--fp8-format``. No torch
here (the self-launching process validates before importing it).
"""

from typing import Any, Callable

from megatron.core.fp8.config import FP8_RECIPES
from megatron.training.errors import UsageError

FP8_OPTIONS = (
    "fp8_recipe",
    "fp8_margin",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "fp8_wgrad",
)
_FLAGS = {
    "fp8_recipe": "--fp8-recipe",
    "fp8_margin": "--fp8-margin",
    "fp8_amax_history_len": "--fp8-amax-history-len",
    "fp8_amax_compute_algo": "--fp8-amax-compute-algo",
    "fp8_wgrad": "--no-fp8-wgrad",
}


def check_fp8_flags(c: Any, given: Callable[[str], bool]) -> None:
    """Raise ``UsageError`` naming the flag for an FP8 flag that would be ignored or asks for
    what is not implemented; ``given(name)``: the flag was on the command line."""
    if c.fp8_format is None:
        for name in FP8_OPTIONS:
            if name != "fp8_recipe" and given(name):  # megatron scripts pass the recipe
                raise UsageError(f"{_FLAGS[name]} needs --fp8-format (e4m3 or hybrid)")
        return
    fmt = f"--fp8-format {c.fp8_format}"
    if c.fp8_recipe != "tensorwise":
        raise UsageError(
            f"{fmt} with --fp8-recipe {c.fp8_recipe}: only the tensorwise recipe (current "
            f"scaling from each tensor's global amax) is implemented, of {FP8_RECIPES} "
            "(megatron's default is delayed); add --fp8-recipe tensorwise"
        )
    for name, default in (("fp8_amax_history_len", 1), ("fp8_amax_compute_algo", "most_recent")):
        if getattr(c, name) != default:
            raise UsageError(
                f"{_FLAGS[name]} {getattr(c, name)} is read by the delayed recipe only; with "
                f"--fp8-recipe tensorwise expected {default}"
            )
    if c.num_experts is not None:
        tp, cp = c.tensor_model_parallel_size, c.context_parallel_size
        ep = c.expert_model_parallel_size or 1
        etp = c.expert_tensor_parallel_size or tp
        if (tp * cp) % (ep * etp):
            raise UsageError(
                f"{fmt} with --num-experts: --expert-model-parallel-size {ep} x "
                f"--expert-tensor-parallel-size {etp} must divide --tp {tp} x --cp {cp} (FP8 "
                "experts spread over data-parallel replicas would scale several micro-batches "
                "together, so the result would depend on the layout)"
            )
