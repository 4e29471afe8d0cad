"""The rank grid (ParallelDims) and the autograd collectives every other package uses."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moefold.parallel.comm import (
        PendingAllToAll,
        all_gather_sequence,
        all_reduce_sum,
        all_to_all,
        all_to_all_async,
        copy_to_region,
        gather_along_dim,
        reduce_from_region,
        reduce_scatter_sequence,
        scatter_along_dim,
    )
    from moefold.parallel.dims import ParallelDims
    from moefold.parallel.groups import Group, group_rank, group_ranks, group_size
    from moefold.parallel.init import default_device, init_distributed
    from moefold.parallel.sharding import (
        Shard,
        full_shape,
        gather_full,
        init_parameters,
        is_sequence_parallel,
        local_slice,
        mark_sequence_parallel,
        mark_sharded,
        normal_init,
        set_init,
        shards_of,
    )
    from moefold.parallel.sizes import ParallelConfig, ParallelSizes

# name -> the module that defines it: loaded on first use, so that reading a config or parsing flags imports
# no more than it needs (torch only where a module computes)
_LAZY = {
    **dict.fromkeys(["PendingAllToAll", "all_gather_sequence", "all_reduce_sum", "all_to_all", "all_to_all_async",
                     "copy_to_region", "gather_along_dim", "reduce_from_region", "reduce_scatter_sequence",
                     "scatter_along_dim"], "moefold.parallel.comm"),
    "ParallelDims": "moefold.parallel.dims",
    **dict.fromkeys(["ParallelConfig", "ParallelSizes"], "moefold.parallel.sizes"),
    **dict.fromkeys(["Group", "group_rank", "group_ranks", "group_size"], "moefold.parallel.groups"),
    **dict.fromkeys(["default_device", "init_distributed"], "moefold.parallel.init"),
    **dict.fromkeys(["Shard", "full_shape", "gather_full", "init_parameters", "is_sequence_parallel", "local_slice",
                     "mark_sequence_parallel", "mark_sharded", "normal_init", "set_init", "shards_of"],
                    "moefold.parallel.sharding"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Group", "ParallelConfig", "ParallelDims", "ParallelSizes", "PendingAllToAll",
    "all_gather_sequence", "all_reduce_sum", "all_to_all", "all_to_all_async", "copy_to_region", "default_device",
    "gather_along_dim", "group_rank", "group_ranks", "group_size", "init_distributed",
    "reduce_from_region", "reduce_scatter_sequence", "scatter_along_dim",
    "Shard", "full_shape", "gather_full", "init_parameters", "is_sequence_parallel", "local_slice",
    "mark_sequence_parallel", "mark_sharded", "normal_init", "set_init", "shards_of",
]
