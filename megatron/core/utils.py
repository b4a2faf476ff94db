"""megatron-core's ``megatron.core.utils`` names: reaching through model wrappers (DDP,
Float16Module, ...), version checks, and re-exports of the names megatron-core keeps here
(group sizes and ranks: ``process_groups_config``; CP batch slicing: ``context_parallel``),
and a per-token tensor sharded like the hidden states (``shard_per_token_tensor``).
"""

import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.context_parallel import (  # noqa: F401  (megatron-core's names here)
    get_batch_on_this_cp_rank,
    get_thd_batch_on_this_cp_rank,
)
from megatron.core.process_groups_config import (  # noqa: F401  (megatron-core's names here)
    get_pg_rank,
    get_pg_size,
)


def get_attr_wrapped_model(
    model, attr: str, allow_none: bool = True, return_model_obj: bool = False
) -> Any:
    """Follow ``.module`` until an object has ``attr`` (non-None unless ``allow_none``).

    Returns the attribute, or the object holding it with ``return_model_obj``.
    """
    if isinstance(model, list):
        raise RuntimeError("get_attr_wrapped_model given a list of models")

    def missing(obj) -> bool:
        return not hasattr(obj, attr) if allow_none else getattr(obj, attr, None) is None

    while missing(model):
        if not hasattr(model, "module"):
            raise RuntimeError(f"get_attr_wrapped_model couldn't find attribute {attr!r}")
        model = model.module
    return model if return_model_obj else getattr(model, attr)


def is_torch_min_version(version, check_equality=True):
    """Whether the installed torch is ``version`` or newer (strictly newer without
    ``check_equality``); local tags such as ``+cpu`` are ignored."""
    import torch

    found = torch.torch_version.TorchVersion(torch.__version__.split("+")[0])
    return found >= version if check_equality else found > version


def is_te_min_version(version, check_equality=True):
    """Whether Transformer Engine is installed at ``version`` or newer (strictly newer
    without ``check_equality``); False when it is not installed, as this core never uses it
    (an optional package: looked up at run time, never a dependency)."""
    import importlib
    import importlib.util
    from importlib.metadata import version as installed_version

    from torch.torch_version import TorchVersion

    if importlib.util.find_spec("transformer_engine") is None:
        return False
    te = importlib.import_module("transformer_engine")
    found = TorchVersion(
        str(getattr(te, "__version__", None) or installed_version("transformer-engine"))
    )
    return found >= version if check_equality else found > version


def get_model_config(model) -> Any:
    """The ``config`` of a (possibly wrapped) model chunk."""
    return get_attr_wrapped_model(model, "config", allow_none=False)


def get_pg_src_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    """Global rank of rank 0 of ``group``; 0 when it is None or without torch.distributed."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_process_group_ranks(group)[0]


def get_tensor_model_parallel_group_if_none(
    tp_group: Optional[dist.ProcessGroup], is_expert: bool = False, check_initialized: bool = True
) -> Optional[dist.ProcessGroup]:
    """megatron-core's deprecated helper: None without torch.distributed; ``tp_group`` as
    given while ``parallel_state`` is not initialized; else ``tp_group`` or, when None,
    ``parallel_state``'s TP group (the expert TP group with ``is_expert``), with a
    ``DeprecationWarning`` (``resolve_group`` is the rule; pass the group explicitly)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if tp_group is not None or not parallel_state.model_parallel_is_initialized():
        return tp_group
    if dist.get_rank() == 0:
        warnings.warn(
            "tp_group is None: using parallel_state's tensor-parallel group (pass tp_group)",
            DeprecationWarning,
            stacklevel=2,
        )
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def shard_per_token_tensor(
    tensor: Tensor, tp_group: Optional[dist.ProcessGroup], sequence_parallel: bool
) -> Tensor:
    """A per-token tensor [b, s_local] (e.g. the padding mask) sharded like the hidden
    states: under sequence parallelism, this rank's block of s over the model's TP group
    (``tp_group``), else unchanged. (The CP split already happened with the inputs.)"""
    if not sequence_parallel or get_pg_size(tp_group) == 1:
        return tensor
    size, rank = get_pg_size(tp_group), get_pg_rank(tp_group)
    if tensor.shape[1] % size != 0:
        raise ValueError(
            f"padding_mask has {tensor.shape[1]} positions per row (shape "
            f"{tuple(tensor.shape)}), not divisible by the tensor-parallel size {size} "
            "(sequence parallelism splits the sequence over TP)"
        )
    return tensor.chunk(size, dim=1)[rank].contiguous()


def init_method_normal(sigma: float) -> "NormalInit":
    """megatron-core's default ``init_method``: fill a tensor in place with Normal(0, sigma)."""
    return NormalInit(std=float(sigma))


def scaled_init_method_normal(
    sigma: float, num_layers: int, multiplier: float = 2.0
) -> "NormalInit":
    """megatron-core's default ``output_layer_init_method``: Normal(0, sigma / sqrt(m L))
    with m = ``multiplier`` and L = ``num_layers``."""
    return NormalInit(std=float(sigma) / math.sqrt(multiplier * num_layers))


@dataclass(frozen=True)
class NormalInit:
    """``init(tensor)`` fills ``tensor`` in place with Normal(mean, std) drawn from the default
    generator of its device (a value: two with the same numbers compare equal)."""

    std: float
    mean: float = 0.0

    def __call__(self, tensor):
        import torch

        return torch.nn.init.normal_(tensor, mean=self.mean, std=self.std)
