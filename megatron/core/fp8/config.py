"""megatron-core 0.16.1's FP8 / low-precision ``TransformerConfig`` fields: what this core
implements, and every other value refused by name when the config is built.

Implemented: ``fp8`` "e4m3" (every FP8 tensor e4m3) or "hybrid" (e4m3 forward, e5m2
gradients) with ``fp8_recipe`` "tensorwise" (current per-tensor scaling), ``fp8_margin``
(scale = fp8_max / amax / 2**margin; megatron-core passes no margin to its tensorwise recipe,
here it is honoured) and ``fp8_wgrad`` (False: the weight gradient in high precision). Every
other field must keep its default (``fp8_recipe`` may hold any recipe name while ``fp8`` is
None: it is read only with FP8, and megatron's scripts pass its default "delayed").
"""

from typing import Any, List, Tuple

from megatron.core.enums import Fp4Recipe, Fp8Recipe

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = tuple(recipe.value for recipe in Fp8Recipe)
FP4_RECIPES = tuple(recipe.value for recipe in Fp4Recipe)
FP8_AMAX_COMPUTE_ALGOS = ("most_recent", "max")

_DELAYED = (
    "is read by the delayed-scaling recipe only; fp8_recipe='tensorwise' (the one implemented) "
    "scales each tensor by its current global amax"
)
_RECIPE_WHY = {
    "delayed": "delayed scaling (amax history) is not implemented; use fp8_recipe='tensorwise'",
    "mxfp8": "MXFP8 block scaling needs Blackwell-class tensor cores and is not implemented; "
    "use fp8_recipe='tensorwise'",
    "blockwise": "blockwise scaling is not implemented; use fp8_recipe='tensorwise'",
    "custom": "custom quantizer factories (Transformer Engine) are not available; use "
    "fp8_recipe='tensorwise'",
}

# (field, default, why another value is refused)
_AT_DEFAULT: List[Tuple[str, Any, str]] = [
    (
        "fp8_param",
        False,
        "FP8 parameters are not implemented (each GEMM casts the bf16/fp32 "
        "weight with its global amax)",
    ),
    ("fp8_quantizer_factory", None, "custom quantizer factories are not available"),
    ("fp8_dot_product_attention", False, "the attention core runs in bf16 (no FP8 attention)"),
    ("fp8_multi_head_attention", False, "the attention core runs in bf16 (no FP8 attention)"),
    (
        "tp_only_amax_red",
        False,
        "the amax is always reduced over every group the tensor is "
        "sharded across (TP, CP), so the result does not depend on the layout",
    ),
    (
        "first_last_layers_bf16",
        False,
        "keeping the first / last layers in bf16 is not implemented",
    ),
    ("num_layers_at_start_in_bf16", 1, "first_last_layers_bf16 is not implemented"),
    ("num_layers_at_end_in_bf16", 1, "first_last_layers_bf16 is not implemented"),
    (
        "activation_func_fp8_input_store",
        False,
        "storing the activation input in FP8 is not implemented",
    ),
    ("fp4", None, "FP4 is not implemented"),
    ("fp4_param", False, "FP4 is not implemented"),
    ("fp4_recipe", "nvfp4", "FP4 is not implemented"),
    ("fp4_quantizer_factory", None, "FP4 is not implemented"),
    ("use_kitchen", False, "the kitchen quantization extension is not available"),
    ("use_kitchen_attention", False, "the kitchen quantization extension is not available"),
    ("kitchen_attention_backend", "sdpa", "the kitchen quantization extension is not available"),
    ("fp8_interval", 1, "deprecated in Transformer Engine and " + _DELAYED),
    ("fp8_amax_history_len", 1, _DELAYED),
    ("fp8_amax_compute_algo", "most_recent", _DELAYED),
]


def check_fp8_config(config: Any) -> None:
    """Raise (``ValueError`` for a value megatron-core does not know, ``NotImplementedError``
    for one this core does not implement) naming the field, the value and what is expected."""
    fmt, recipe = config.fp8, config.fp8_recipe
    if fmt is not None and fmt not in FP8_FORMATS:
        raise ValueError(f"fp8={fmt!r}; expected None or one of {FP8_FORMATS}")
    if recipe is not None and recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe={recipe!r}; expected one of {FP8_RECIPES}")
    if config.fp4_recipe is not None and config.fp4_recipe not in FP4_RECIPES:
        raise ValueError(f"fp4_recipe={config.fp4_recipe!r}; expected one of {FP4_RECIPES}")
    if config.fp8_amax_compute_algo not in FP8_AMAX_COMPUTE_ALGOS:
        raise ValueError(
            f"fp8_amax_compute_algo={config.fp8_amax_compute_algo!r}; expected one of "
            f"{FP8_AMAX_COMPUTE_ALGOS}"
        )
    margin = config.fp8_margin
    if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise ValueError(f"fp8_margin={margin!r}; expected an int >= 0")
    if not isinstance(config.fp8_wgrad, bool):
        raise ValueError(f"fp8_wgrad={config.fp8_wgrad!r}; expected True or False")
    if config.fp8_param and fmt is None:
        raise ValueError("fp8_param=True must be used together with fp8 mode (fp8 is None)")
    for name, default, why in _AT_DEFAULT:
        value = getattr(config, name)
        if value != default or type(value) is not type(default):
            raise NotImplementedError(f"{name}={value!r}: {why}; expected {default!r}")
    if fmt is not None and config.num_moe_experts:
        _check_expert_layout(config)
    if fmt is not None and recipe != "tensorwise":
        why = _RECIPE_WHY.get(recipe, "a recipe is needed")
        raise NotImplementedError(
            f"fp8_recipe={recipe!r} with fp8={fmt!r}: {why} (megatron-core's default recipe is "
            "'delayed'; set fp8_recipe='tensorwise' / --fp8-recipe tensorwise)"
        )


def _check_expert_layout(config: Any) -> None:
    """FP8 experts need their token exchange (expert TP x EP) inside the ranks of one
    micro-batch (TP x CP): an expert GEMM holding several micro-batches' tokens would scale
    them by their joint amax, which one process never computes."""
    tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
    ep = config.expert_model_parallel_size
    etp = config.expert_tensor_parallel_size or tp
    if (tp * cp) % (etp * ep):
        raise NotImplementedError(
            f"fp8={config.fp8!r} with num_moe_experts={config.num_moe_experts}: "
            f"expert_model_parallel_size={ep} x expert_tensor_parallel_size={etp} must divide "
            f"tensor_model_parallel_size={tp} x context_parallel_size={cp}: experts spread "
            "over data-parallel replicas would mix micro-batches in one FP8 scale, so the "
            "result would depend on the layout"
        )
