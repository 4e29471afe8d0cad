"""The distributed optimizer: flat parameter/gradient buffers cut into buckets, their reduce-scatter during
backward and parameter all-gather after the step, torch's AdamW on each rank's shard, precision, lr schedule,
and the shard's pieces as torch.distributed.checkpoint sees them; optimizer offload (part of the shard updated on
the CPU) and FSDP2 (``fully_shard``, in the distributed optimizer's place); Muon (``--optimizer muon``: Newton-Schulz
on the matrices each rank owns whole, AdamW on the rest).

Holds: buffers, grad_sync, param_sync, optimizer, offload, fsdp, precision, lr_schedule, state_shards, muon,
newton_schulz.
May import: moefold.parallel, moefold.dense (the output head's tied weight); nothing else of training.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moefold.training.optim.buffers import Bucket, FlatGroup, build_flat_groups, reduction_kind
    from moefold.training.optim.grad_sync import GradSync
    from moefold.training.optim.lr_schedule import DECAY_STYLES, WSD_STYLES, LRSchedule
    from moefold.training.optim.muon import DistributedMuon, MuonOptions, is_muon_matrix
    from moefold.training.optim.newton_schulz import ScaleMode, TPMode, newton_schulz
    from moefold.training.optim.offload import HostOptimizer, offloaded_buckets
    from moefold.training.optim.optimizer import DistributedAdamW, decays
    from moefold.training.optim.param_sync import ParamSync
    from moefold.training.optim.precision import DTYPES, OptimizerPrecision
    from moefold.training.optim.state_shards import ShardLoadPlanner, ShardPieces, ShardSavePlanner

# name -> the module that defines it: loaded on first use, so that reading a config or parsing flags imports
# no more than it needs (torch only where a module computes)
_LAZY = {
    **dict.fromkeys(["Bucket", "FlatGroup", "build_flat_groups", "reduction_kind"], "moefold.training.optim.buffers"),
    "GradSync": "moefold.training.optim.grad_sync",
    **dict.fromkeys(["DECAY_STYLES", "WSD_STYLES", "LRSchedule"], "moefold.training.optim.lr_schedule"),
    **dict.fromkeys(["DistributedMuon", "MuonOptions", "is_muon_matrix"], "moefold.training.optim.muon"),
    **dict.fromkeys(["ScaleMode", "TPMode", "newton_schulz"], "moefold.training.optim.newton_schulz"),
    **dict.fromkeys(["HostOptimizer", "offloaded_buckets"], "moefold.training.optim.offload"),
    **dict.fromkeys(["DistributedAdamW", "decays"], "moefold.training.optim.optimizer"),
    "ParamSync": "moefold.training.optim.param_sync",
    **dict.fromkeys(["DTYPES", "OptimizerPrecision"], "moefold.training.optim.precision"),
    **dict.fromkeys(["ShardLoadPlanner", "ShardPieces", "ShardSavePlanner"], "moefold.training.optim.state_shards"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Bucket", "FlatGroup", "build_flat_groups", "reduction_kind", "GradSync", "ParamSync",
    "DistributedAdamW", "decays", "DistributedMuon", "MuonOptions", "is_muon_matrix", "ScaleMode", "TPMode",
    "newton_schulz", "HostOptimizer", "offloaded_buckets",
    "DTYPES", "OptimizerPrecision", "DECAY_STYLES", "WSD_STYLES", "LRSchedule",
    "ShardPieces", "ShardSavePlanner", "ShardLoadPlanner",
]
