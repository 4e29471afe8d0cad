"""The rank grid of a planned layout without running it: who is in which group, and one rank's ``ParallelDims``.

``group_members(sizes, rank, dims)`` lists the global ranks of ``rank``'s group over some dimensions of the
dense layout (tp-cp-dp-pp, TP innermost) or of the expert layout (etp-ep-edp-pp), with the rank order of
``parallel.dims`` (``ParallelSizes.dense_coords`` / ``expert_coords``). From the members the planner knows
whether a group stays inside one node (consecutive ranks ``gpus_per_node`` at a time share a node, as torchrun
numbers them) and so which link its collectives use.

``planning_world(world_size, rank)`` starts torch.distributed's *fake* process group (no processes, no
communication: ``torch.testing._internal.distributed.fake_pg``) as ``rank`` of ``world_size``, and
``rank_dims(sizes, rank)`` then builds that rank's ``ParallelDims`` with only the groups it belongs to
(``dist.new_group`` on the fake backend is a few microseconds), instead of ``ParallelDims.build``'s device meshes
whose every group of every rank would cost thousands of ``new_group`` calls at 2048 ranks. The real model,
gradient buffers and optimizer are then built on the meta device in that rank's layout (``planner.static``).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch.distributed as dist

from moefold.parallel.dims import ParallelDims, ParallelSizes
from moefold.parallel.groups import Group

DENSE_ORDER = ("tp", "cp", "dp", "pp")      # innermost first
EXPERT_ORDER = ("etp", "ep", "edp", "pp")


def group_members(sizes: ParallelSizes, rank: int, dims: Iterable[str]) -> list[int]:
    """Global ranks (ascending, the group's own rank order) of ``rank``'s group over ``dims``: names of the
    dense layout (``tp cp dp pp``) or of the expert layout (``etp ep edp pp``), not mixed."""
    names = set(dims)
    if names <= set(DENSE_ORDER):
        order, coords = DENSE_ORDER, sizes.dense_coords(rank)
    elif names <= set(EXPERT_ORDER):
        order, coords = EXPERT_ORDER, sizes.expert_coords(rank)
    else:
        raise ValueError(f"group over {sorted(names)}: give dimensions of {DENSE_ORDER} or of {EXPERT_ORDER}")
    extents = [getattr(sizes, name) for name in order]
    ranges = [range(n) if name in names else (coords[name],) for name, n in zip(order, extents)]
    members = []
    for combo in itertools.product(*ranges):
        r, stride = 0, 1
        for c, n in zip(combo, extents):
            r += c * stride
            stride *= n
        members.append(r)
    return sorted(members)


def expert_token_members(sizes: ParallelSizes, rank: int) -> list[int] | None:
    """``ParallelDims.expert_token_group``'s ranks (see ``parallel.dims._expert_token_group``): the ranks of this
    rank's tp x cp block congruent to it modulo etp*ep; None when that block is no larger than etp*ep."""
    block, stride = sizes.tp * sizes.cp, sizes.etp * sizes.ep
    if block <= stride:
        return None
    start = rank // block * block
    return list(range(start + (rank - start) % stride, start + block, stride))


def spans_nodes(members: list[int], gpus_per_node: int) -> bool:
    """Whether a group's ranks sit on more than one node (ranks numbered node by node)."""
    return members[0] // gpus_per_node != members[-1] // gpus_per_node


def ranks_per_node(members: list[int], gpus_per_node: int) -> int:
    """How many of a group's ranks share the node of its first rank (all of them for an intra-node group)."""
    node = members[0] // gpus_per_node
    return sum(1 for r in members if r // gpus_per_node == node)


@contextmanager
def planning_world(world_size: int, rank: int) -> Iterator[None]:
    """torch.distributed initialised with the fake backend as ``rank`` of ``world_size`` (and destroyed after).

    Refuses to run inside a process that already has a process group (a training rank): plan in a process of
    its own."""
    if dist.is_initialized():
        raise RuntimeError("moefold plan builds its layouts on a fake process group and needs a process without "
                           "torch.distributed initialised; run it outside the training ranks")
    # importing the module registers the "fake" backend with torch.distributed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook    # init_process_group wraps it (a "[rankN]:" prefix) and nothing unwraps it
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def rank_dims(sizes: ParallelSizes, rank: int) -> ParallelDims:
    """``rank``'s ``ParallelDims`` with process groups of the right members; inside ``planning_world`` (as
    ``rank``), on the fake backend. The groups exist only for what reads their size and rank (the model's
    shard shapes, the gradient buffers' shard counts): nothing is communicated."""
    made: dict[tuple[int, ...], Group] = {}

    def group(members: list[int] | None) -> Group:
        if members is None:
            return None
        key = tuple(members)
        if key not in made:
            made[key] = dist.new_group(members)
        return made[key]

    def dense(*names: str) -> Group:
        return group(group_members(sizes, rank, names))

    def expert(*names: str) -> Group:
        return group(group_members(sizes, rank, names))

    return ParallelDims(
        sizes=sizes, rank=rank, device_type="cpu",
        tp_group=dense("tp"), cp_group=dense("cp"), dp_group=dense("dp"), pp_group=dense("pp"),
        ep_group=expert("ep"), etp_group=expert("etp"), edp_group=expert("edp"),
        tp_cp_group=dense("tp", "cp"), dp_cp_group=dense("dp", "cp"), tp_cp_dp_group=dense("tp", "cp", "dp"),
        etp_ep_group=expert("etp", "ep"),
        expert_token_group=group(expert_token_members(sizes, rank)),
    )
