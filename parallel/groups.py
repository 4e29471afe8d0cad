"""Group helpers shared by every collective: ``None`` stands for "alone" (size 1, rank 0)."""

from __future__ import annotations

import torch.distributed as dist

# A process group, or None when the process runs without torch.distributed.
Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    """Number of ranks in ``group``; 1 for None."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This rank's index inside ``group``; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def group_ranks(group: Group) -> list[int]:
    """Global ranks of ``group`` in group order; [0] for None."""
    return [0] if group is None else dist.get_process_group_ranks(group)
