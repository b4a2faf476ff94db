"""Global model-parallel state: the process groups of a (TP, CP, EP, DP, PP) layout.

Ranks are laid out as megatron-core lays them out: the axes of ``order`` (default
``tp-cp-ep-dp-pp``) are nested with the first axis fastest, so
``rank = tp_i + TP*(cp_i + CP*(ep_i + EP*(dp_i + DP*pp_i)))``. One ``RankGenerator`` computes
every group; ``initialize_model_parallel`` uses two of them, as megatron-core does: one for
the dense part (tp, cp, dp, pp) and one for the experts (expert tp, ep, expert dp, pp, with
the same pipeline groups). With ``hierarchical_context_parallel_sizes`` each context-parallel
group is also split into one level of sub-groups per size (``hierarchical_cp_rank_lists``).
Functions elsewhere take their groups explicitly and read this module only as a documented
fallback.

Misuse that megatron-core reports with ``assert`` raises ``ParallelStateError``, an
``AssertionError`` (and a ``RuntimeError``) carrying a message that says what to do.

One concern in ~900 lines: megatron-core's ~80 getters and setters live at this module path
(``get_*_world_size``, ``set_*_rank``, ``get_*_group``, ...). Each is a one-line delegation to
``_size`` / ``_rank`` / ``_group`` with its own docstring, so their blocks look alike by
design; the layout logic itself is ``RankGenerator`` and ``initialize_model_parallel``.
"""

import itertools
import math
from datetime import timedelta
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

_AXES = ("tp", "pp", "dp", "ep", "cp")


class ParallelStateError(AssertionError, RuntimeError):
    """Misuse of ``parallel_state`` (megatron-core raises ``AssertionError`` for these)."""


class RankGenerator:
    """Rank groups of one layout: ``get_ranks("tp-dp")`` lists every group whose ranks
    differ only along the named axes.

    ``order`` names the axes from fastest to slowest (``rank = sum_k i_k * stride_k`` with
    ``stride_k = prod(size_j for j < k)``); axes missing from it must have size 1 and are
    appended at the end. EP and CP may not both exceed 1 in one generator (the dense layout
    has CP, the expert layout EP). ``rank_offset`` is added to every rank.
    """

    def __init__(
        self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0
    ) -> None:
        if ep != 1 and cp != 1:
            raise ParallelStateError(
                f"RankGenerator: ep={ep} and cp={cp} are both > 1; one generator lays out "
                "either the dense part (cp) or the experts (ep), set the other to 1"
            )
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * dp * pp * cp * ep
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        tokens = order.lower().split("-")
        unknown = [t for t in tokens if t not in self.name_to_size]
        if unknown or len(set(tokens)) != len(tokens):
            raise ValueError(
                f"RankGenerator: order must name each of {', '.join(_AXES)} at most once, "
                f"separated by '-', got {order!r}"
            )
        for name, size in self.name_to_size.items():
            if name not in tokens:
                if size != 1:
                    raise RuntimeError(
                        f"RankGenerator: the {name} size is {size} but order {order!r} does "
                        f"not name {name}; add it to the order"
                    )
                tokens.append(name)
        self.order = "-".join(tokens)
        self.ordered_size = [self.name_to_size[t] for t in tokens]

    def get_mask(self, order: str, token: str) -> List[bool]:
        """For each axis of ``order``, whether ``token`` (axes joined by '-') names it."""
        axes = order.split("-")
        mask = [False] * len(axes)
        for name in token.split("-"):
            if name not in axes:
                raise ValueError(f"RankGenerator: token {token!r} names {name!r}, not in {order!r}")
            mask[axes.index(name)] = True
        return mask

    def get_ranks(self, token: str) -> List[List[int]]:
        """All groups of the axes in ``token``; see ``generate_masked_orthogonal_rank_groups``."""
        mask = self.get_mask(self.order, token)
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, mask)
        return [[rank + self.rank_offset for rank in group] for group in groups]


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: List[int], mask: List[bool]
) -> List[List[int]]:
    """Groups of ranks that vary only along the masked axes (first axis fastest).

    ``rank = sum_k i_k * stride_k``, ``stride_k = prod(parallel_size[:k])``. One group per
    index of the unmasked axes (first unmasked axis fastest); inside a group the masked
    indices run with the first masked axis fastest, so each group is ascending.
    """
    total = 1
    for size in parallel_size:
        total *= size
    if total != world_size:
        raise ValueError(
            f"generate_masked_orthogonal_rank_groups: prod(parallel_size={parallel_size}) = "
            f"{total} != world_size={world_size}"
        )
    strides = [1]
    for size in parallel_size[:-1]:
        strides.append(strides[-1] * size)
    inside = [k for k, m in enumerate(mask) if m]
    outside = [k for k, m in enumerate(mask) if not m]

    def offsets(axes: List[int]) -> List[int]:
        extents = [range(parallel_size[k]) for k in reversed(axes)]
        return [
            sum(i * strides[k] for k, i in zip(reversed(axes), idx))
            for idx in itertools.product(*extents)
        ]

    members = offsets(inside)
    return [[base + m for m in members] for base in offsets(outside)]


def hierarchical_cp_rank_lists(cp_ranks: List[int], sizes: List[int]) -> List[List[List[int]]]:
    """The sub-groups of one context-parallel group, per level, as megatron-core lays them out.

    With ``sizes = [s0, s1, ...]`` (product ``len(cp_ranks)``), level ``k`` views ``cp_ranks``
    as an array of shape ``(outer, s_k, inner)``, ``inner = prod(sizes[:k])`` fastest and
    ``outer = prod(sizes[k+1:])`` slowest, and makes one group along the ``s_k`` axis for each
    (outer, inner) pair, inner fastest: level 0 is runs of ``s0`` consecutive entries, level 1
    takes every ``s0``-th entry, and so on. ``cp_ranks = range(8)``, ``sizes = [2, 4]``:
    level 0 ``[0, 1], [2, 3], [4, 5], [6, 7]``; level 1 ``[0, 2, 4, 6], [1, 3, 5, 7]``.
    """
    total = math.prod(sizes)
    if total != len(cp_ranks):
        raise ValueError(
            f"hierarchical_cp_rank_lists: prod(sizes={list(sizes)}) = {total} != "
            f"{len(cp_ranks)} ranks in {list(cp_ranks)}"
        )
    levels = []
    inner = 1
    for size in sizes:
        outer = total // (inner * size)
        levels.append(
            [
                [cp_ranks[(o * size + j) * inner + i] for j in range(size)]
                for o in range(outer)
                for i in range(inner)
            ]
        )
        inner *= size
    return levels


def default_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """First and last stage of a pipeline (one rank when PP = 1): the tied word embeddings."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """First stage of a pipeline: the position embeddings."""
    return [pp_ranks[0]]


# Group name -> (generator, token): "dense" is the tp/cp/dp/pp layout, "expert" the
# expert-tp/ep/expert-dp/pp layout.
_GROUP_TOKENS: Dict[str, tuple] = {
    "dp_cp": ("dense", "dp-cp"),
    "dp": ("dense", "dp"),
    "cp": ("dense", "cp"),
    "mp": ("dense", "tp-pp"),
    "tp": ("dense", "tp"),
    "pp": ("dense", "pp"),
    "tp_dp_cp": ("dense", "tp-dp-cp"),
    "tp_dp": ("dense", "tp-dp"),
    "tp_cp": ("dense", "tp-cp"),
    "ep": ("expert", "ep"),
    "expt_tp": ("expert", "tp"),
    "tp_ep": ("expert", "tp-ep"),
    "tp_ep_pp": ("expert", "tp-ep-pp"),
    "expt_dp": ("expert", "dp"),
}

# Process groups are created once per rank list and reused across initialize/destroy
# cycles, as creating them is a collective over the whole world.
_GROUP_CACHE: Dict[tuple, dist.ProcessGroup] = {}
_GROUP_CACHE_WORLD: Optional[dist.ProcessGroup] = None  # the default group they belong to

_STATE: Optional["_ParallelState"] = None
_GENERATION = 0  # bumped by every initialize_model_parallel and destroy_model_parallel
_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK: Optional[int] = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE: Optional[int] = None
# Values set by the set_* functions; they win over the groups' sizes and ranks.
_OVERRIDES: Dict[str, Optional[int]] = {}


class _ParallelState:
    """This rank's groups and the global ranks of each, keyed by group name."""

    def __init__(self) -> None:
        self.groups: Dict[str, dist.ProcessGroup] = {}
        self.ranks: Dict[str, List[int]] = {}
        # Hierarchical context parallelism: one group (and its ranks) per level; None when
        # hierarchical_context_parallel_sizes was not given.
        self.hcp_groups: Optional[List[dist.ProcessGroup]] = None
        self.hcp_ranks: Optional[List[List[int]]] = None


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
    """Create the dense groups (tp, cp, pp, dp, dp_cp, mp, tp_cp, tp_dp, tp_dp_cp, embedding,
    position embedding) and the expert groups (ep, expert tp, tp_ep, tp_ep_pp, expert dp).

    DP = world / (TP*CP*PP); expert DP = world / (ETP*EP*PP) with ETP defaulting to TP. Any
    ``order`` megatron-core accepts works (axes left out must have size 1).

    ``hierarchical_context_parallel_sizes`` (a list of ints >= 1 whose product is
    ``context_parallel_size``; None or empty: none) splits every context-parallel group into
    one level of sub-groups per size, laid out as ``hierarchical_cp_rank_lists`` says; this
    rank's groups, one per level, are ``get_hierarchical_context_parallel_groups()``. Each
    level gets its own communicators, apart from every other group's.

    Options for features this core does not implement (hybrid CP, several
    distributed-optimizer instances) raise ``NotImplementedError``; communication tuning
    options (sharp, nccl config, gloo groups, streams, pp backend) are ignored.
    """
    if not dist.is_initialized():
        raise ParallelStateError(
            "initialize_model_parallel: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first"
        )
    _reject_unsupported(
        hybrid_context_parallel=(hybrid_context_parallel, False),
        num_distributed_optimizer_instances=(num_distributed_optimizer_instances, 1),
    )
    if expert_tensor_parallel_size is None:
        expert_tensor_parallel_size = tensor_model_parallel_size
    sizes = {
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "context_parallel_size": context_parallel_size,
        "expert_model_parallel_size": expert_model_parallel_size,
        "expert_tensor_parallel_size": expert_tensor_parallel_size,
    }
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"initialize_model_parallel: {name} must be an int >= 1, got {value!r}"
            )
    world = dist.get_world_size()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
    if world % (tp * cp * pp) != 0:
        raise RuntimeError(
            f"initialize_model_parallel: world_size ({world}) is not divisible by "
            f"tensor_model_parallel_size ({tp}) x context_parallel_size ({cp}) x "
            f"pipeline_model_parallel_size ({pp})"
        )
    if world % (etp * ep * pp) != 0:
        raise RuntimeError(
            f"initialize_model_parallel: world_size ({world}) is not divisible by "
            f"expert_tensor_parallel_size ({etp}) x expert_model_parallel_size ({ep}) x "
            f"pipeline_model_parallel_size ({pp})"
        )
    hcp_sizes = _check_hierarchical_cp_sizes(hierarchical_context_parallel_sizes, cp)
    if virtual_pipeline_model_parallel_size is not None and pp < 2:
        raise RuntimeError(
            "initialize_model_parallel: pipeline_model_parallel_size should be greater than 1 "
            f"with virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size}"
        )
    dp, expert_dp = world // (tp * cp * pp), world // (etp * ep * pp)
    generators = {
        "dense": RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order),
        "expert": RankGenerator(tp=etp, ep=ep, dp=expert_dp, pp=pp, cp=1, order=order),
    }
    if not (order.endswith("pp") or pp == 1 or expert_dp == dp):
        raise ParallelStateError(
            f"initialize_model_parallel: with order={order!r} (pp not last) and "
            f"pipeline_model_parallel_size={pp}, the expert data-parallel size ({expert_dp}) "
            f"must equal the data-parallel size ({dp})"
        )
    if generators["dense"].get_ranks("pp") != generators["expert"].get_ranks("pp"):
        raise ParallelStateError(
            f"initialize_model_parallel: order={order!r} gives the experts other pipeline "
            "groups than the dense layers; put pp last or keep the expert sizes equal"
        )
    timeout = timedelta(minutes=distributed_timeout_minutes)

    global _STATE, _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    state = _ParallelState()
    me = dist.get_rank()

    def build(name: str, all_ranks: List[List[int]], tag: str = "") -> None:
        for ranks in all_ranks:
            group = _get_or_create_group(ranks, timeout, tag)
            if me in ranks:
                state.groups[name], state.ranks[name] = group, list(ranks)

    for name, (generator, token) in _GROUP_TOKENS.items():
        build(name, generators[generator].get_ranks(token))
    if hcp_sizes:
        state.hcp_groups, state.hcp_ranks = [], []
        per_cp_group = [
            hierarchical_cp_rank_lists(ranks, hcp_sizes)
            for ranks in generators["dense"].get_ranks("cp")
        ]
        for level in range(len(hcp_sizes)):
            for levels in per_cp_group:
                for ranks in levels[level]:
                    group = _get_or_create_group(ranks, timeout, tag=f"hcp{level}")
                    if me in ranks:
                        state.hcp_groups.append(group)
                        state.hcp_ranks.append(list(ranks))
    if create_all_gather_group:
        build("dp_cp_ag", generators["dense"].get_ranks("dp-cp"), tag="all_gather")
    pp_groups = generators["dense"].get_ranks("pp")
    embd_fn = get_embedding_ranks or default_embedding_ranks
    pos_fn = get_position_embedding_ranks or default_position_embedding_ranks
    build("embd", [list(embd_fn(r)) for r in pp_groups])
    build("pos_embd", [list(pos_fn(r)) for r in pp_groups])
    _STATE = state
    _bump_generation()
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = virtual_pipeline_model_parallel_size
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0 if virtual_pipeline_model_parallel_size else None


def destroy_model_parallel() -> None:
    """Forget the model-parallel state and every set_* value. The cached process groups stay
    alive for reuse while their default group lives; once it is destroyed they are dropped
    (a gloo group's threads stop when its last reference goes)."""
    global _STATE, _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _drop_stale_group_cache()
    _STATE = None
    _bump_generation()
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
    _OVERRIDES.clear()


def groups_generation() -> int:
    """A number that changes whenever ``initialize_model_parallel`` or
    ``destroy_model_parallel`` runs: a module that resolved ``parallel_state``'s groups (MPU
    fallback) at generation g may reuse them while this still returns g."""
    return _GENERATION


def _bump_generation() -> None:
    global _GENERATION
    _GENERATION += 1


def model_parallel_is_initialized() -> bool:
    """True between ``initialize_model_parallel`` and ``destroy_model_parallel``."""
    return _STATE is not None


def is_initialized() -> bool:
    """True once the data-parallel group exists (same as ``model_parallel_is_initialized``)."""
    return _STATE is not None


def has_separate_all_gather_group() -> bool:
    """Whether ``initialize_model_parallel(create_all_gather_group=True)`` built a second
    dp x cp group for parameter all-gathers (``get_data_parallel_group(...,
    independent_all_gather=True)``)."""
    return _STATE is not None and "dp_cp_ag" in _STATE.groups


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


def get_hierarchical_context_parallel_groups(check_initialized=True):
    """This rank's hierarchical context-parallel groups, one per level of
    ``hierarchical_context_parallel_sizes`` (a new list each call).

    None with ``check_initialized=False`` when none were built (no state, or no
    ``hierarchical_context_parallel_sizes``); ``ParallelStateError`` otherwise.
    """
    if _STATE is None or _STATE.hcp_groups is None:
        if check_initialized:
            _raise_no_hcp_groups()
        return None
    return list(_STATE.hcp_groups)


def get_hierarchical_context_parallel_global_ranks(check_initialized=True):
    """Global ranks of each of this rank's hierarchical context-parallel groups, level by
    level (None or ``ParallelStateError`` as ``get_hierarchical_context_parallel_groups``)."""
    if _STATE is None or _STATE.hcp_ranks is None:
        if check_initialized:
            _raise_no_hcp_groups()
        return None
    return [list(ranks) for ranks in _STATE.hcp_ranks]


def get_data_parallel_group(
    with_context_parallel=False, partial_data_parallel=False, independent_all_gather=False
):
    """Data-parallel group; with ``with_context_parallel`` the dp x cp group gradients are
    reduced over (its all-gather twin with ``independent_all_gather``, when built).

    ``partial_data_parallel`` is the whole dp x cp group here (one optimizer instance).
    """
    if not with_context_parallel:
        if partial_data_parallel:
            raise ParallelStateError(
                "get_data_parallel_group: partial_data_parallel=True needs "
                "with_context_parallel=True"
            )
        return _group("dp", True)
    if independent_all_gather and not partial_data_parallel:
        if not has_separate_all_gather_group():
            raise ParallelStateError(
                "get_data_parallel_group: no all-gather group; pass "
                "create_all_gather_group=True to initialize_model_parallel"
            )
        return _group("dp_cp_ag", True)
    return _group("dp_cp", True)


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


def get_expert_model_parallel_group(check_initialized=True):
    """Expert-parallel group: the ranks that split the experts of one layer."""
    return _group("ep", check_initialized)


def get_expert_tensor_parallel_group(check_initialized=True):
    """Expert tensor-parallel group (size ``expert_tensor_parallel_size``)."""
    return _group("expt_tp", check_initialized)


def get_expert_tensor_and_model_parallel_group(check_initialized=True):
    """Expert tp x ep group."""
    return _group("tp_ep", check_initialized)


def get_expert_tensor_model_pipeline_parallel_group(check_initialized=True):
    """Expert tp x ep x pp group."""
    return _group("tp_ep_pp", check_initialized)


def get_expert_data_parallel_group(check_initialized=True, partial_expert_data_parallel=False):
    """Expert data-parallel group (``partial_expert_data_parallel`` gives the same group: one
    optimizer instance)."""
    return _group("expt_dp", check_initialized)


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel=False):
    """Deprecated name of ``get_expert_data_parallel_group``."""
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel)


# ----------------------------------------------------------------------------- sizes, ranks


def get_tensor_model_parallel_world_size():
    """Number of tensor-parallel ranks (the value set by the setter, if any)."""
    return _size("tp", "tp_size")


def get_tensor_model_parallel_rank():
    """This rank's index in its tensor-parallel group (the value set by the setter, if any)."""
    return _rank("tp", "tp_rank")


def set_tensor_model_parallel_world_size(world_size):
    """Make ``get_tensor_model_parallel_world_size`` return ``world_size`` (None: the group's)."""
    _OVERRIDES["tp_size"] = world_size


def set_tensor_model_parallel_rank(rank):
    """Make ``get_tensor_model_parallel_rank`` return ``rank`` (None: the group's)."""
    _OVERRIDES["tp_rank"] = rank


def get_tensor_model_parallel_src_rank():
    """Global rank of the first member of this rank's tensor-parallel group."""
    return _ranks("tp", True)[0]


def get_model_parallel_src_rank():
    """Global rank of the first member of this rank's model-parallel (tp x pp) group."""
    return _ranks("mp", True)[0]


def get_pipeline_model_parallel_world_size():
    """Number of pipeline stages (the value set by the setter, if any)."""
    return _size("pp", "pp_size")


def get_pipeline_model_parallel_rank():
    """This rank's pipeline stage (the value set by the setter, if any)."""
    return _rank("pp", "pp_rank")


def set_pipeline_model_parallel_world_size(world_size):
    """Make ``get_pipeline_model_parallel_world_size`` return ``world_size``."""
    _OVERRIDES["pp_size"] = world_size


def set_pipeline_model_parallel_rank(rank):
    """Make ``get_pipeline_model_parallel_rank`` return ``rank``."""
    _OVERRIDES["pp_rank"] = rank


def get_context_parallel_world_size():
    """Number of context-parallel ranks (0 when torch.distributed is not initialized)."""
    return _size("cp")


def get_context_parallel_rank():
    """This rank's index in its context-parallel group."""
    return _rank("cp")


def get_context_parallel_global_ranks(check_initialized=True):
    """Global ranks of this rank's context-parallel group."""
    return _ranks("cp", check_initialized)


def get_tensor_and_context_parallel_world_size():
    """Size of the tp x cp group."""
    return _size("tp_cp")


def get_tensor_and_context_parallel_rank():
    """This rank's index in its tp x cp group."""
    return _rank("tp_cp")


def get_data_parallel_world_size(with_context_parallel=False, partial_data_parallel=False):
    """Number of data-parallel replicas (times CP with ``with_context_parallel``)."""
    if not _dist_ready():
        return 0
    return get_data_parallel_group(with_context_parallel, partial_data_parallel).size()


def get_data_parallel_rank(with_context_parallel=False, partial_data_parallel=False):
    """This rank's index in its data-parallel (or dp x cp) group (the set value, if any)."""
    if _OVERRIDES.get("dp_rank") is not None:
        return _OVERRIDES["dp_rank"]
    if not _dist_ready():
        return 0
    return get_data_parallel_group(with_context_parallel, partial_data_parallel).rank()


def set_data_parallel_rank(rank):
    """Make ``get_data_parallel_rank`` return ``rank``."""
    _OVERRIDES["dp_rank"] = rank


def get_data_parallel_src_rank(with_context_parallel=False):
    """Global rank of the first member of this rank's data-parallel group."""
    return _ranks("dp_cp" if with_context_parallel else "dp", True)[0]


def get_expert_model_parallel_world_size():
    """Number of expert-parallel ranks (the set value, if any; 0 without torch.distributed)."""
    return _size("ep", "ep_size")


def get_expert_model_parallel_rank():
    """This rank's index in its expert-parallel group (the set value, if any)."""
    return _rank("ep", "ep_rank")


def set_expert_model_parallel_world_size(world_size):
    """Make ``get_expert_model_parallel_world_size`` return ``world_size``."""
    _OVERRIDES["ep_size"] = world_size


def set_expert_model_parallel_rank(rank):
    """Make ``get_expert_model_parallel_rank`` return ``rank``."""
    _OVERRIDES["ep_rank"] = rank


def get_expert_model_parallel_src_rank():
    """Global rank of the first member of this rank's expert-parallel group."""
    return _ranks("ep", True)[0]


def get_expert_tensor_parallel_world_size():
    """Expert tensor-parallel size: the set value, else the group's, else the tensor-parallel
    size set with ``set_tensor_model_parallel_world_size`` (no groups yet)."""
    if _OVERRIDES.get("etp_size") is not None:
        return _OVERRIDES["etp_size"]
    group = _group("expt_tp", False)
    return _OVERRIDES.get("tp_size") if group is None else group.size()


def get_expert_tensor_parallel_rank():
    """This rank's index in its expert tensor-parallel group (fallbacks as for the size)."""
    if _OVERRIDES.get("etp_rank") is not None:
        return _OVERRIDES["etp_rank"]
    group = _group("expt_tp", False)
    return _OVERRIDES.get("tp_rank") if group is None else group.rank()


def set_expert_tensor_parallel_world_size(world_size):
    """Make ``get_expert_tensor_parallel_world_size`` return ``world_size``."""
    _OVERRIDES["etp_size"] = world_size


def set_expert_tensor_parallel_rank(rank):
    """Make ``get_expert_tensor_parallel_rank`` return ``rank``."""
    _OVERRIDES["etp_rank"] = rank


def get_expert_tensor_and_model_parallel_world_size():
    """Size of the expert tp x ep group."""
    return _size("tp_ep")


def get_expert_tensor_and_model_parallel_rank():
    """This rank's index in its expert tp x ep group."""
    return _rank("tp_ep")


def get_expert_data_parallel_world_size(partial_expert_data_parallel=False):
    """Number of expert data-parallel replicas."""
    return _size("expt_dp")


def get_expert_data_parallel_rank(partial_expert_data_parallel=False):
    """This rank's index in its expert data-parallel group."""
    return _rank("expt_dp")


# ----------------------------------------------------------------------------- pipeline


def get_pipeline_model_parallel_first_rank():
    """Global rank of the first stage of this rank's pipeline."""
    return _ranks("pp", True)[0]


def get_pipeline_model_parallel_last_rank():
    """Global rank of the last stage of this rank's pipeline."""
    return _ranks("pp", True)[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next stage (the pipeline wraps around)."""
    ranks = _ranks("pp", True)
    stage, stages = get_pipeline_model_parallel_rank(), get_pipeline_model_parallel_world_size()
    return ranks[(stage + 1) % stages]


def get_pipeline_model_parallel_prev_rank():
    """Global rank of the previous stage (the pipeline wraps around)."""
    ranks = _ranks("pp", True)
    stage, stages = get_pipeline_model_parallel_rank(), get_pipeline_model_parallel_world_size()
    return ranks[(stage - 1) % stages]


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


def is_rank_in_position_embedding_group():
    """Whether this rank holds the position embeddings (first stage by default)."""
    return _STATE is not None and dist.get_rank() in _STATE.ranks.get("pos_embd", [])


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


# ----------------------------------------------------------------------------- module globals

# megatron-core keeps each group in a module global; tests written for it read some of them
# (e.g. ``parallel_state._MODEL_PARALLEL_GROUP is None`` after destroy). They are served,
# read-only, from this module's state.
_LEGACY_GROUPS = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_MODEL_PARALLEL_GROUP": "mp",
    "_EMBEDDING_GROUP": "embd",
    "_POSITION_EMBEDDING_GROUP": "pos_embd",
    "_DATA_PARALLEL_GROUP": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "_DATA_PARALLEL_GROUP_WITH_CP_AG": "dp_cp_ag",
    "_CONTEXT_PARALLEL_GROUP": "cp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "_EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "expt_tp",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "_EXPERT_DATA_PARALLEL_GROUP": "expt_dp",
}
_LEGACY_RANKS = {
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
    "_PIPELINE_GLOBAL_RANKS": "pp",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "mp",
    "_EMBEDDING_GLOBAL_RANKS": "embd",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "pos_embd",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp_cp",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
}
_LEGACY_OVERRIDES = {
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": "tp_size",
    "_MPU_TENSOR_MODEL_PARALLEL_RANK": "tp_rank",
    "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": "pp_size",
    "_MPU_PIPELINE_MODEL_PARALLEL_RANK": "pp_rank",
    "_MPU_DATA_PARALLEL_RANK": "dp_rank",
    "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE": "ep_size",
    "_MPU_EXPERT_MODEL_PARALLEL_RANK": "ep_rank",
    "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE": "etp_size",
    "_MPU_EXPERT_TENSOR_PARALLEL_RANK": "etp_rank",
}


def __getattr__(name: str):
    """megatron-core's private module globals (read-only): a group, its global ranks, or a
    value set with a set_* function; None when not initialized."""
    if name == "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS":
        return get_hierarchical_context_parallel_groups(check_initialized=False)
    if name in _LEGACY_GROUPS:
        return None if _STATE is None else _STATE.groups.get(_LEGACY_GROUPS[name])
    if name in _LEGACY_RANKS:
        ranks = None if _STATE is None else _STATE.ranks.get(_LEGACY_RANKS[name])
        return None if ranks is None else list(ranks)
    if name in _LEGACY_OVERRIDES:
        return _OVERRIDES.get(_LEGACY_OVERRIDES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------- helpers


def _group(name: str, check_initialized: bool = True) -> Optional[dist.ProcessGroup]:
    """The named group of this rank; raise if the state is not initialized and checked."""
    if _STATE is None:
        if check_initialized:
            raise ParallelStateError(
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


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _size(name: str, override: Optional[str] = None) -> int:
    """Size of the named group (a set value wins); 0 when torch.distributed is not
    initialized."""
    if override is not None and _OVERRIDES.get(override) is not None:
        return _OVERRIDES[override]
    if not _dist_ready():
        return 0
    return _group(name).size()


def _rank(name: str, override: Optional[str] = None) -> int:
    """Rank in the named group (a set value wins); 0 when torch.distributed is not
    initialized."""
    if override is not None and _OVERRIDES.get(override) is not None:
        return _OVERRIDES[override]
    if not _dist_ready():
        return 0
    return _group(name).rank()


def _get_or_create_group(ranks: List[int], timeout: timedelta, tag: str = "") -> dist.ProcessGroup:
    """The process group over ``ranks``; created collectively on first use, then cached
    (for as long as the default group it was made in lives).

    ``tag`` keeps a second communicator over the same ranks apart (the all-gather group).
    """
    global _GROUP_CACHE_WORLD
    _drop_stale_group_cache()
    _GROUP_CACHE_WORLD = dist.group.WORLD
    key = (tuple(ranks), tag)
    if key not in _GROUP_CACHE:
        _GROUP_CACHE[key] = dist.new_group(ranks, timeout=timeout)
    return _GROUP_CACHE[key]


def _drop_stale_group_cache() -> None:
    """Drop the cached groups when the default group they were made in is gone (destroyed,
    or torch.distributed restarted): a gloo group's threads stop when its last reference
    goes."""
    global _GROUP_CACHE_WORLD
    if not _dist_ready() or _GROUP_CACHE_WORLD is not dist.group.WORLD:
        _GROUP_CACHE.clear()
        _GROUP_CACHE_WORLD = None


def _raise_no_hcp_groups() -> None:
    """The not-initialized error of the hierarchical context-parallel getters."""
    if _STATE is None:
        raise ParallelStateError(
            "parallel_state: the hierarchical context-parallel groups are not initialized; "
            "call initialize_model_parallel first (or pass the groups explicitly)"
        )
    raise ParallelStateError(
        "parallel_state: no hierarchical context-parallel groups; pass "
        "hierarchical_context_parallel_sizes to initialize_model_parallel"
    )


def _check_hierarchical_cp_sizes(sizes, context_parallel_size: int) -> Optional[List[int]]:
    """``hierarchical_context_parallel_sizes`` as a list (None when not given or empty, as
    megatron-core ignores it then); ``ValueError`` for something other than a list or tuple
    of ints >= 1, ``ParallelStateError`` when their product is not ``context_parallel_size``
    (megatron-core asserts)."""
    if sizes is None:
        return None
    where = "initialize_model_parallel: hierarchical_context_parallel_sizes"
    if not isinstance(sizes, (list, tuple)):
        raise ValueError(f"{where} must be a list of ints >= 1, got {sizes!r}")
    bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1]
    if bad:
        raise ValueError(f"{where} must be a list of ints >= 1, got {list(sizes)} ({bad[0]!r})")
    if not sizes:
        return None
    total = math.prod(sizes)
    if total != context_parallel_size:
        raise ParallelStateError(
            f"{where}={list(sizes)} multiply to {total}, but context_parallel_size is "
            f"{context_parallel_size}; their product must equal it"
        )
    return list(sizes)


def _require_vp_stage(vp_stage) -> None:
    """Virtual-pipeline queries must name the chunk they ask about."""
    if vp_stage is None:
        raise ParallelStateError("vp_stage must be passed if virtual pipeline is enabled")


def _reject_unsupported(**options) -> None:
    """Raise for options set to a value this core does not implement.

    Each keyword maps to ``(value, the only supported value)``.
    """
    for name, (value, supported) in options.items():
        if value != supported:
            raise NotImplementedError(
                f"{name}={value!r} is not supported by this core (only {supported!r})"
            )
