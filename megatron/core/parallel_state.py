"""Global model-parallel state: the process groups of a (TP, CP, EP, DP, PP) layout.

Ranks are laid out as megatron-core lays them out: the axes of ``order`` (default
``tp-cp-ep-dp-pp``) are nested with the first axis fastest, so
``rank = tp_i + TP*(cp_i + CP*(ep_i + EP*(dp_i + DP*pp_i)))``. Functions elsewhere take
their groups explicitly and read this module only as a documented fallback.
"""

import itertools
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence

import torch.distributed as dist

_AXES = ("tp", "cp", "ep", "dp", "pp")

# Group name -> axes whose ranks vary inside one group of that kind.
_GROUP_AXES: Dict[str, Sequence[str]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "pp": ("pp",),
    "dp": ("dp",),
    "dp_cp": ("cp", "dp"),
    "mp": ("tp", "pp"),
    "tp_cp": ("tp", "cp"),
    "tp_dp": ("tp", "dp"),
    "tp_dp_cp": ("tp", "cp", "dp"),
}

# Process groups are created once per rank list and reused across initialize/destroy
# cycles, as creating them is a collective over the whole world.
_GROUP_CACHE: Dict[tuple, dist.ProcessGroup] = {}

_STATE: Optional["_ParallelState"] = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK: Optional[int] = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE: Optional[int] = None


class _ParallelState:
    """This rank's groups and the global ranks of each, keyed by group name."""

    def __init__(self) -> None:
        self.groups: Dict[str, dist.ProcessGroup] = {}
        self.ranks: Dict[str, List[int]] = {}


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[List[int]] = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Optional[Callable[[List[int], Optional[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int], Optional[int]], List[int]]] = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: Optional[List[str]] = None,
    sharp_enabled_group: Optional[str] = None,
    create_all_gather_group: Optional[bool] = False,
) -> None:
    """Create the tp, cp, pp, dp, dp_cp, mp, tp_cp, tp_dp, tp_dp_cp, embedding and
    position-embedding groups for this layout; DP = world / (TP*CP*PP).

    Options for features this core does not implement (expert parallelism > 1, hierarchical
    or hybrid CP, several distributed-optimizer instances) raise ``NotImplementedError``;
    communication tuning options (sharp, nccl config, gloo groups, streams) are ignored.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first"
        )
    _reject_unsupported(
        expert_model_parallel_size=(expert_model_parallel_size, 1),
        expert_tensor_parallel_size=(expert_tensor_parallel_size, None),
        hierarchical_context_parallel_sizes=(hierarchical_context_parallel_sizes, None),
        hybrid_context_parallel=(hybrid_context_parallel, False),
        num_distributed_optimizer_instances=(num_distributed_optimizer_instances, 1),
    )
    world = dist.get_world_size()
    sizes = {
        "tp": tensor_model_parallel_size,
        "cp": context_parallel_size,
        "ep": 1,
        "pp": pipeline_model_parallel_size,
    }
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(
                f"initialize_model_parallel: {name} size must be an int >= 1, got {value!r}"
            )
    model_size = sizes["tp"] * sizes["cp"] * sizes["pp"]
    if world % model_size != 0:
        raise RuntimeError(
            f"initialize_model_parallel: world_size ({world}) is not divisible by "
            f"tensor_model_parallel_size ({sizes['tp']}) x context_parallel_size "
            f"({sizes['cp']}) x pipeline_model_parallel_size ({sizes['pp']})"
        )
    sizes["dp"] = world // model_size
    if virtual_pipeline_model_parallel_size is not None and pipeline_model_parallel_size < 2:
        raise RuntimeError(
            "initialize_model_parallel: pipeline_model_parallel_size should be greater than 1 "
            f"with virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size}"
        )
    axes = _parse_order(order)
    timeout = timedelta(minutes=distributed_timeout_minutes)

    global _STATE, _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    state = _ParallelState()
    me = dist.get_rank()
    for name, varying in _GROUP_AXES.items():
        for ranks in rank_groups(sizes, axes, varying):
            group = _get_or_create_group(ranks, timeout)
            if me in ranks:
                state.groups[name], state.ranks[name] = group, ranks
    embd_fn = get_embedding_ranks or _default_embedding_ranks
    pos_fn = get_position_embedding_ranks or _default_position_embedding_ranks
    for pp_ranks in rank_groups(sizes, axes, ("pp",)):
        for name, fn in (("embd", embd_fn), ("pos_embd", pos_fn)):
            ranks = list(fn(list(pp_ranks), None))
            group = _get_or_create_group(ranks, timeout)
            if me in ranks:
                state.groups[name], state.ranks[name] = group, ranks
    _STATE = state
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = virtual_pipeline_model_parallel_size
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0 if virtual_pipeline_model_parallel_size else None


def rank_groups(
    sizes: Dict[str, int], order: Sequence[str], varying: Sequence[str]
) -> List[List[int]]:
    """All groups of global ranks that differ only along the ``varying`` axes.

    With strides ``stride[order[0]] = 1``, ``stride[order[k]] = prod(sizes[order[:k]])``,
    a group fixes every other axis' index and lists its ranks in ascending order.
    """
    strides, stride = {}, 1
    for axis in order:
        strides[axis] = stride
        stride *= sizes.get(axis, 1)
    fixed = [a for a in order if a not in varying]
    moving = [a for a in order if a in varying]
    groups = []
    for fixed_idx in _nested_indices([sizes.get(a, 1) for a in fixed]):
        base = sum(i * strides[a] for a, i in zip(fixed, fixed_idx))
        ranks = [
            base + sum(i * strides[a] for a, i in zip(moving, idx))
            for idx in _nested_indices([sizes.get(a, 1) for a in moving])
        ]
        groups.append(sorted(ranks))
    return groups


def destroy_model_parallel() -> None:
    """Forget the model-parallel state; the cached process groups stay alive for reuse."""
    global _STATE, _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _STATE = None
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None


def model_parallel_is_initialized() -> bool:
    """True between ``initialize_model_parallel`` and ``destroy_model_parallel``."""
    return _STATE is not None


# ----------------------------------------------------------------------------- groups


def get_tensor_model_parallel_group(check_initialized=True):
    """Tensor-parallel group of this rank."""
    return _group("tp", check_initialized)


def get_pipeline_model_parallel_group(check_initialized=True):
    """Pipeline-parallel group of this rank (one rank per stage)."""
    return _group("pp", check_initialized)


def get_context_parallel_group(check_initialized=True):
    """Context-parallel group: the ranks holding shards of the same sequences."""
    return _group("cp", check_initialized)


def get_data_parallel_group(
    with_context_parallel=False, partial_data_parallel=False, independent_all_gather=False
):
    """Data-parallel group; with ``with_context_parallel`` the dp x cp group gradients
    are reduced over."""
    _reject_unsupported(partial_data_parallel=(partial_data_parallel, False))
    return _group("dp_cp" if with_context_parallel else "dp", True)


def get_model_parallel_group(check_initialized=True):
    """Model-parallel group (tp x pp)."""
    return _group("mp", check_initialized)


def get_tensor_and_context_parallel_group(check_initialized=True):
    """tp x cp group."""
    return _group("tp_cp", check_initialized)


def get_tensor_and_data_parallel_group(check_initialized=True, with_context_parallel=False):
    """tp x dp group, or tp x dp x cp with ``with_context_parallel``."""
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp", check_initialized)


def get_embedding_group(check_initialized=True):
    """First and last pipeline stage of this rank's pipeline (tied word embeddings)."""
    return _group("embd", check_initialized)


def get_position_embedding_group(check_initialized=True):
    """First pipeline stage of this rank's pipeline (position embeddings)."""
    return _group("pos_embd", check_initialized)


# ----------------------------------------------------------------------------- sizes, ranks


def get_tensor_model_parallel_world_size():
    """Number of tensor-parallel ranks."""
    return _size("tp")


def get_tensor_model_parallel_rank():
    """This rank's index in its tensor-parallel group."""
    return _rank("tp")


def get_pipeline_model_parallel_world_size():
    """Number of pipeline stages."""
    return _size("pp")


def get_pipeline_model_parallel_rank():
    """This rank's pipeline stage."""
    return _rank("pp")


def get_context_parallel_world_size():
    """Number of context-parallel ranks (0 when torch.distributed is not initialized)."""
    return _size("cp")


def get_context_parallel_rank():
    """This rank's index in its context-parallel group."""
    return _rank("cp")


def get_context_parallel_global_ranks(check_initialized=True):
    """Global ranks of this rank's context-parallel group."""
    return _ranks("cp", check_initialized)


def get_data_parallel_world_size(with_context_parallel=False, partial_data_parallel=False):
    """Number of data-parallel replicas (times CP with ``with_context_parallel``)."""
    _reject_unsupported(partial_data_parallel=(partial_data_parallel, False))
    return _size("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel=False, partial_data_parallel=False):
    """This rank's index in its data-parallel (or dp x cp) group."""
    _reject_unsupported(partial_data_parallel=(partial_data_parallel, False))
    return _rank("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_src_rank(with_context_parallel=False):
    """Global rank of the first member of this rank's data-parallel group."""
    return _ranks("dp_cp" if with_context_parallel else "dp", True)[0]


def get_pipeline_model_parallel_first_rank():
    """Global rank of the first stage of this rank's pipeline."""
    return _ranks("pp", True)[0]


def get_pipeline_model_parallel_last_rank():
    """Global rank of the last stage of this rank's pipeline."""
    return _ranks("pp", True)[-1]


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next stage (the pipeline wraps around)."""
    ranks = _ranks("pp", True)
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank():
    """Global rank of the previous stage (the pipeline wraps around)."""
    ranks = _ranks("pp", True)
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None):
    """True on pipeline stage 0; unless ``ignore_virtual``, also requires ``vp_stage == 0``."""
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None:
        _require_vp_stage(vp_stage)
        if vp_stage != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
    """True on the last stage; unless ``ignore_virtual``, also requires the last vp_stage."""
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vp_size is not None:
        _require_vp_stage(vp_stage)
        if vp_stage != vp_size - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual=True, vp_stage=None):
    """Whether this rank (and, unless ``ignore_virtual``, this vp_stage) holds a tied
    embedding copy."""
    if _STATE is None or dist.get_rank() not in _STATE.ranks.get("embd", []):
        return False
    if ignore_virtual:
        return True
    ranks = _STATE.ranks["embd"]
    if dist.get_rank() == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if dist.get_rank() == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def get_virtual_pipeline_model_parallel_rank():
    """The virtual pipeline stage the caller set last (None without VPP)."""
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


def set_virtual_pipeline_model_parallel_rank(rank):
    """Set the current virtual pipeline stage."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = rank


def get_virtual_pipeline_model_parallel_world_size():
    """Number of model chunks per pipeline rank (None without VPP)."""
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE


def set_virtual_pipeline_model_parallel_world_size(world_size):
    """Set the number of model chunks per pipeline rank."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


# ----------------------------------------------------------------------------- helpers


def _group(name: str, check_initialized: bool = True) -> Optional[dist.ProcessGroup]:
    """The named group of this rank; raise if the state is not initialized and checked."""
    if _STATE is None:
        if check_initialized:
            raise RuntimeError(
                f"parallel_state: the {name} group is not initialized; call "
                "initialize_model_parallel first (or pass the group explicitly)"
            )
        return None
    return _STATE.groups.get(name)


def _ranks(name: str, check_initialized: bool) -> Optional[List[int]]:
    """Global ranks of the named group of this rank."""
    if _STATE is None:
        _group(name, check_initialized)
        return None
    return list(_STATE.ranks.get(name, []))


def _size(name: str) -> int:
    """Size of the named group; 0 when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_world_size(group=_group(name))


def _rank(name: str) -> int:
    """Rank in the named group; 0 when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group=_group(name))


def _get_or_create_group(ranks: List[int], timeout: timedelta) -> dist.ProcessGroup:
    """The process group over ``ranks``; created collectively on first use, then cached."""
    key = tuple(ranks)
    if key not in _GROUP_CACHE:
        _GROUP_CACHE[key] = dist.new_group(ranks, timeout=timeout)
    return _GROUP_CACHE[key]


def _default_embedding_ranks(pp_ranks: List[int], split_rank: Optional[int] = None) -> List[int]:
    """First and last stage of a pipeline (the same rank when PP = 1)."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def _default_position_embedding_ranks(
    pp_ranks: List[int], split_rank: Optional[int] = None
) -> List[int]:
    """First stage of a pipeline."""
    return [pp_ranks[0]]


def _parse_order(order: str) -> List[str]:
    """Split ``order`` into the five axes, checking each appears exactly once."""
    axes = order.split("-")
    if sorted(axes) != sorted(_AXES):
        raise ValueError(
            f"initialize_model_parallel: order must be a permutation of {'-'.join(_AXES)}, "
            f"got {order!r}"
        )
    return axes


def _nested_indices(extents: List[int]) -> List[tuple]:
    """Index tuples over ``extents`` with the first index varying fastest."""
    return [tuple(reversed(t)) for t in itertools.product(*[range(e) for e in reversed(extents)])]


def _require_vp_stage(vp_stage) -> None:
    """Virtual-pipeline queries must name the chunk they ask about."""
    if vp_stage is None:
        raise ValueError("vp_stage must be passed if virtual pipeline is enabled")


def _reject_unsupported(**options) -> None:
    """Raise for options set to a value this core does not implement.

    Each keyword maps to ``(value, the only supported value)``.
    """
    for name, (value, supported) in options.items():
        if value != supported:
            raise NotImplementedError(
                f"{name}={value!r} is not supported by this core (only {supported!r})"
            )
