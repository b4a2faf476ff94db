"""HyperCommGrid: process groups over any combination of the axes of an n-d rank grid.

The grid names its axes fastest first, like ``order`` of ``initialize_model_parallel``:
``HyperCommGrid([2, 4], ["tp", "dp"])`` puts tp at stride 1, so its dp groups are those of
``initialize_model_parallel(tensor_model_parallel_size=2, order="tp-dp")``. The rank lists
come from ``parallel_state.generate_masked_orthogonal_rank_groups`` (one layout rule for the
whole package); the groups are made by ``torch.distributed.new_subgroups_by_enumeration``.
"""

import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch.distributed as dist

from megatron.core.parallel_state import generate_masked_orthogonal_rank_groups


class HyperCommGrid:
    """An n-dimensional grid of ``prod(shape)`` ranks starting at ``rank_offset``.

    ``create_pg(dims)`` builds (once per set of dims) the groups whose ranks differ only
    along ``dims`` and returns this rank's; ``get_pg(dims)`` returns it again;
    ``get_rank_enum(dims)`` lists every group's ranks. ``dims`` is one name or a list, in
    any order; the key of a group lists its dims slowest first (e.g. ``"dp-tp"``).
    """

    def __init__(
        self,
        shape: list[int],
        dim_names: list[str],
        rank_offset: int = 0,
        backend: Optional[str] = None,
    ) -> None:
        if len(shape) != len(dim_names):
            raise ValueError(f"len(shape) {shape} != len(dim_names) {dim_names}")
        if "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
        elif dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            raise RuntimeError(
                "HyperCommGrid: cannot determine the world size; set WORLD_SIZE or call "
                "torch.distributed.init_process_group first"
            )
        if rank_offset < 0:
            raise ValueError(f"rank_offset must be non-negative, got {rank_offset}")
        size = 1
        for extent in shape:
            size *= extent
        if size > world_size - rank_offset:
            raise RuntimeError(
                f"HyperCommGrid: shape {shape} needs {size} ranks but world size {world_size} "
                f"with rank_offset {rank_offset} leaves {world_size - rank_offset}"
            )
        self.rank_offset = rank_offset
        self.size = size
        self.shape = list(shape)
        self.dim_names = list(dim_names)
        self.backend = backend
        self._pgs: Dict[str, dist.ProcessGroup] = {}

    def create_pg(self, dims: Union[str, list[str]], **kwargs: Any) -> dist.ProcessGroup | None:
        """Create the groups along ``dims`` and return this rank's (None if outside the grid).

        Keyword arguments go to ``torch.distributed.new_subgroups_by_enumeration`` (timeout,
        pg_options, group_desc). Creating the same dims twice raises ``KeyError``.
        """
        ordered, key = self._order_dims(dims)
        if key in self._pgs:
            raise KeyError(
                f"HyperCommGrid: the process group for {dims} was already created; use "
                "get_pg (options cannot be compared, so it is not created again)"
            )
        group, _ = dist.new_subgroups_by_enumeration(
            self._rank_enum(ordered), backend=self.backend, **kwargs
        )
        self._pgs[key] = group
        return group

    def get_pg(self, dims: Union[str, list[str]]) -> dist.ProcessGroup:
        """This rank's group along ``dims``, made earlier by ``create_pg``."""
        _, key = self._order_dims(dims)
        if key not in self._pgs:
            raise KeyError(f"Process group for {key} hasn't been created. Call create_pg first.")
        return self._pgs[key]

    def get_rank_enum(self, dims: Union[str, list[str]]) -> list[list[int]]:
        """Every group's global ranks along ``dims`` (what ``create_pg`` would build)."""
        ordered, _ = self._order_dims(dims)
        return self._rank_enum(ordered)

    def _rank_enum(self, dims: List[str]) -> List[List[int]]:
        mask = [name in dims for name in self.dim_names]
        groups = generate_masked_orthogonal_rank_groups(self.size, self.shape, mask)
        return [[rank + self.rank_offset for rank in group] for group in groups]

    def _order_dims(self, dims: Union[str, list[str]]) -> Tuple[List[str], str]:
        """``dims`` sorted slowest first, and the key joining them with '-'."""
        names = [dims] if not isinstance(dims, list) else list(dims)
        unknown = [d for d in names if d not in self.dim_names]
        if unknown:
            raise ValueError(
                f"HyperCommGrid: unknown dims {unknown}; the grid has {self.dim_names}"
            )
        ordered = sorted(names, key=self.dim_names.index, reverse=True)
        return ordered, "-".join(ordered)
