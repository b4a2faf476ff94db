"""Helpers for reaching through model wrappers (DDP, Float16Module, ...)."""

from typing import Any, Dict, Optional, Tuple


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


def get_pg_size(group=None):
    """Size of ``group``; 1 when it is None or torch.distributed is not initialized."""
    import torch.distributed as dist

    return 1 if group is None or not dist.is_initialized() else group.size()


def get_pg_rank(group=None):
    """Rank in ``group``; 0 when it is None or torch.distributed is not initialized."""
    import torch.distributed as dist

    return 0 if group is None or not dist.is_initialized() else group.rank()


def get_model_config(model) -> Any:
    """The ``config`` of a (possibly wrapped) model chunk."""
    return get_attr_wrapped_model(model, "config", allow_none=False)


def get_batch_on_this_cp_rank(batch: Dict[str, Any], cp_group: Optional[Any] = None) -> Dict:
    """This CP rank's load-balanced shard of a [b, s] batch (megatron-core's name here;
    see ``megatron.core.context_parallel.get_batch_on_this_cp_rank``)."""
    from megatron.core.context_parallel import get_batch_on_this_cp_rank as shard

    return shard(batch, cp_group)


def get_thd_batch_on_this_cp_rank(
    batch: Dict[str, Any],
    cu_seqlens: Any,
    cu_seqlens_padded: Any,
    max_seqlen: Any,
    cp_size: Optional[int] = None,
    cp_rank: Optional[int] = None,
) -> Tuple[Dict[str, Any], Any]:
    """This CP rank's share of a packed (THD) batch, and its ``PackedSeqParams``.

    megatron-core 0.16.1's signature. Every [1, t] entry of ``batch`` except
    ``attention_mask``, ``cu_seqlens``, ``cu_seqlens_padded`` and ``max_seqlen`` keeps the
    positions ``thd_partitioned_indices(cu_seqlens_padded, t, C, r)`` (each padded document
    split into 2C chunks, chunks r and 2C-1-r kept). ``cp_size``/``cp_rank`` None: the MPU
    fallback (``parallel_state``), or C = 1 without parallel state. Returns a new dict
    (the input is not modified) and the parameters (``qkv_format="thd"``).
    """
    import torch

    from megatron.core import parallel_state
    from megatron.core.context_parallel import thd_partitioned_indices
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int(max_seqlen.reshape(-1)[0]) if torch.is_tensor(max_seqlen) else int(max_seqlen)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    initialized = parallel_state.model_parallel_is_initialized()
    if cp_size is None:
        cp_size = parallel_state.get_context_parallel_world_size() if initialized else 1
    if cp_rank is None:
        cp_rank = parallel_state.get_context_parallel_rank() if initialized else 0
    skip = {"attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen"}
    out = dict(batch)
    if cp_size > 1:
        index = None
        for key, value in batch.items():
            if key in skip or not torch.is_tensor(value) or value.dim() < 2:
                continue
            if index is None:
                index = thd_partitioned_indices(cu_seqlens_padded, value.shape[1], cp_size, cp_rank)
                index = index.to(value.device)
            out[key] = value.index_select(1, index)
    return out, params
