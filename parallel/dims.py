"""The rank grid: dense layout tp-cp-dp-pp and expert layout etp-ep-edp-pp over the same ranks.

Ranks are numbered with TP innermost and PP outermost::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))        # dense / attention
    rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))    # experts ("folding")

Both layouts cut the world into the same ``pp`` blocks of consecutive ranks, so pipeline
groups agree; inside a block, attention and experts may be split completely differently
(e.g. attention TP4/CP2 while experts use ETP1/EP8).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moefold.parallel.groups import Group
from moefold.parallel.sizes import ParallelConfig as ParallelConfig
from moefold.parallel.sizes import ParallelSizes


def _expert_token_group(s: ParallelSizes, rank: int, tp_cp_group: Group) -> Group:
    """This rank's ``expert_token_group`` (see ``ParallelDims``); collective: every rank creates every group.

    A tp x cp block is ``tp*cp`` consecutive ranks and a rank's (etp, ep) coordinates are its rank
    modulo ``etp*ep``, so the group is the block's ranks congruent to this one modulo ``etp*ep``.
    """
    block, stride = s.tp * s.cp, s.etp * s.ep
    if block <= stride:
        return None
    if stride == 1:
        return tp_cp_group
    mine = None
    for start in range(0, s.world_size, block):
        for residue in range(start, start + stride):
            ranks = list(range(residue, start + block, stride))
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
    return mine


@dataclass(frozen=True)
class ParallelDims:
    """This rank's place in the grid and the process groups of every dimension.

    A group is ``None`` when the process runs alone without torch.distributed (world 1);
    every collective in ``parallel.comm`` treats ``None`` (and any group of size 1) as a no-op.

    Dense groups ``tp cp dp pp``; expert groups ``ep etp edp``; derived groups ``tp_cp``
    (router statistics), ``dp_cp`` (dense gradient reduction), ``tp_cp_dp`` (global balancing
    counts, expert-bias update), ``etp_ep`` (the token dispatcher's group) and ``expert_token``:
    the ranks that hold this rank's experts (same etp, ep) and split the tokens of its micro-batch
    (same tp x cp block), None when the dispatcher's etp x ep group spans that block (each expert
    instance then sees all of the micro-batch's rows it is sent). FP8 reduces the experts' scales
    over token rows over it (``moe.fp8_gemm``).
    """

    sizes: ParallelSizes
    rank: int = 0
    device_type: str = "cpu"
    dense_mesh: DeviceMesh | None = field(default=None, repr=False)
    expert_mesh: DeviceMesh | None = field(default=None, repr=False)
    tp_group: Group = field(default=None, repr=False)
    cp_group: Group = field(default=None, repr=False)
    dp_group: Group = field(default=None, repr=False)
    pp_group: Group = field(default=None, repr=False)
    ep_group: Group = field(default=None, repr=False)
    etp_group: Group = field(default=None, repr=False)
    edp_group: Group = field(default=None, repr=False)
    tp_cp_group: Group = field(default=None, repr=False)
    dp_cp_group: Group = field(default=None, repr=False)
    tp_cp_dp_group: Group = field(default=None, repr=False)
    etp_ep_group: Group = field(default=None, repr=False)
    expert_token_group: Group = field(default=None, repr=False)
    # the flattened sub-meshes of the derived groups (FSDP2 shards over them: training.optim.fsdp)
    dp_cp_mesh: DeviceMesh | None = field(default=None, repr=False)
    tp_cp_dp_mesh: DeviceMesh | None = field(default=None, repr=False)

    @classmethod
    def single(cls, device_type: str = "cpu") -> ParallelDims:
        """World 1 without torch.distributed: every group is None."""
        return cls(sizes=ParallelConfig().resolve(1), device_type=device_type)

    @classmethod
    def build(cls, config: ParallelConfig = ParallelConfig(), device_type: str = "cpu") -> ParallelDims:
        """Create the grid over the initialised default process group (world 1 without one).

        Collective: every rank calls it, in the same order relative to other group creation.
        """
        if not dist.is_initialized():
            return cls(sizes=config.resolve(1), device_type=device_type)
        s = config.resolve(dist.get_world_size())
        dense = init_device_mesh(device_type, (s.pp, s.dp, s.cp, s.tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
        expert = init_device_mesh(device_type, (s.pp, s.edp, s.ep, s.etp), mesh_dim_names=("pp", "edp", "ep", "etp"))
        tp_cp = dense["cp", "tp"]._flatten("tp_cp").get_group()
        dp_cp = dense["dp", "cp"]._flatten("dp_cp")
        tp_cp_dp = dense["dp", "cp", "tp"]._flatten("tp_cp_dp")
        return cls(
            sizes=s, rank=dist.get_rank(), device_type=device_type, dense_mesh=dense, expert_mesh=expert,
            tp_group=dense["tp"].get_group(),
            cp_group=dense["cp"].get_group(),
            dp_group=dense["dp"].get_group(),
            pp_group=dense["pp"].get_group(),
            ep_group=expert["ep"].get_group(),
            etp_group=expert["etp"].get_group(),
            edp_group=expert["edp"].get_group(),
            tp_cp_group=tp_cp,
            dp_cp_group=dp_cp.get_group(), tp_cp_dp_group=tp_cp_dp.get_group(), dp_cp_mesh=dp_cp,
            tp_cp_dp_mesh=tp_cp_dp,
            etp_ep_group=expert["ep", "etp"]._flatten("etp_ep").get_group(),
            expert_token_group=_expert_token_group(s, dist.get_rank(), tp_cp),
        )

    # -- sizes -----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.sizes.world_size

    @property
    def tp(self) -> int:
        return self.sizes.tp

    @property
    def cp(self) -> int:
        return self.sizes.cp

    @property
    def dp(self) -> int:
        return self.sizes.dp

    @property
    def pp(self) -> int:
        return self.sizes.pp

    @property
    def ep(self) -> int:
        return self.sizes.ep

    @property
    def etp(self) -> int:
        return self.sizes.etp

    @property
    def edp(self) -> int:
        return self.sizes.edp

    # -- this rank's coordinates ---------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        return self.sizes.dense_coords(self.rank)["tp"]

    @property
    def cp_rank(self) -> int:
        return self.sizes.dense_coords(self.rank)["cp"]

    @property
    def dp_rank(self) -> int:
        return self.sizes.dense_coords(self.rank)["dp"]

    @property
    def pp_rank(self) -> int:
        return self.sizes.dense_coords(self.rank)["pp"]

    @property
    def ep_rank(self) -> int:
        return self.sizes.expert_coords(self.rank)["ep"]

    @property
    def etp_rank(self) -> int:
        return self.sizes.expert_coords(self.rank)["etp"]

    @property
    def edp_rank(self) -> int:
        return self.sizes.expert_coords(self.rank)["edp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def describe(self) -> str:
        s = self.sizes
        return (f"world={s.world_size} dense tp{s.tp}/cp{s.cp}/dp{s.dp}/pp{s.pp} "
                f"experts etp{s.etp}/ep{s.ep}/edp{s.edp}/pp{s.pp}")
