"""The rank grid (ParallelDims) and the autograd collectives every other package uses."""

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
from moefold.parallel.dims import ParallelConfig, ParallelDims, ParallelSizes
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

__all__ = [
    "Group", "ParallelConfig", "ParallelDims", "ParallelSizes", "PendingAllToAll",
    "all_gather_sequence", "all_reduce_sum", "all_to_all", "all_to_all_async", "copy_to_region", "default_device",
    "gather_along_dim", "group_rank", "group_ranks", "group_size", "init_distributed",
    "reduce_from_region", "reduce_scatter_sequence", "scatter_along_dim",
    "Shard", "full_shape", "gather_full", "init_parameters", "is_sequence_parallel", "local_slice",
    "mark_sequence_parallel", "mark_sharded", "normal_init", "set_init", "shards_of",
]
