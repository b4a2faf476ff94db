"""The GPT-OSS flags (megatron's names; docs/huggingface.md): the gated unit's shape
(--quick-geglu, --glu-linear-offset, --activation-func-clamp-value), attention sinks
(--softmax-type), the window pattern (--window-attn-skip-freq, with Gemma's) and YaRN
positions (--position-embedding-type yarn), checked up front with the flags named. No torch
here (the self-launching process validates before importing it)."""

from typing import Any, Callable

from megatron.core import config_rules
from megatron.training.flag_checks import flag as _flag
from megatron.training.flag_checks import require as _require

_YARN = (
    "rotary_scaling_factor",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
)
# the library's field names in ``config_rules``' messages, as the trainer's flags
_FLAG_NAMES = (
    ("window_attn_skip_freq=", "--window-attn-skip-freq "),
    ("window_size=", "--window-size "),
    ("window_size", "--window-size"),
    ("num_layers", "--num-layers"),
)


def check_gpt_oss_flags(c: Any, given: Callable[[str], bool]) -> None:
    """Raise ``UsageError`` naming the flag for a GPT-OSS flag that would be ignored or is
    out of range; ``given(name)``: the flag was on the command line."""
    gated = c.swiglu or c.geglu or c.quick_geglu
    for name in ("glu_linear_offset", "activation_func_clamp_value"):
        _require(
            gated or not given(name),
            f"{_flag(c, name)} {getattr(c, name)} shapes the gated MLP; it needs --swiglu, "
            "--geglu or --quick-geglu",
        )
    problems = config_rules.gpt_oss_problems(
        c.softmax_type, c.glu_linear_offset, c.activation_func_clamp_value, gated
    ) + config_rules.window_attn_skip_freq_problems(
        c.window_attn_skip_freq, c.window_size, c.num_layers
    )
    for problem in problems:
        for field, flag in _FLAG_NAMES:
            problem = problem.replace(field, flag)
        _require(False, problem)
    _check_yarn_flags(c, given)


def _check_yarn_flags(c: Any, given: Callable[[str], bool]) -> None:
    """--position-embedding-type yarn needs the four YaRN flags; the YaRN flags need it
    (--rotary-scaling-factor: or multi-latent attention's --rope-type yarn)."""
    yarn = c.position_embedding_type == "yarn"
    for name in _YARN:
        _require(
            not yarn or getattr(c, name) is not None,
            f"--position-embedding-type yarn needs {_flag(c, name)}",
        )
    for name in _YARN + ("no_yarn_correction_range_round_to_int",):
        mla = name == "rotary_scaling_factor" and c.multi_latent_attention
        also = " (or --multi-latent-attention)" if name == "rotary_scaling_factor" else ""
        _require(
            yarn or mla or not given(name),
            f"{_flag(c, name)} is a YaRN setting; it needs "
            f"--position-embedding-type yarn{also} (got {c.position_embedding_type})",
        )
