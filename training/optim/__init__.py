"""The distributed optimizer: flat parameter/gradient buffers cut into buckets, their reduce-scatter during
backward and parameter all-gather after the step, torch's AdamW on each rank's shard, precision, lr schedule,
and the shard's pieces as torch.distributed.checkpoint sees them; optimizer offload (part of the shard updated on
the CPU) and FSDP2 (``fully_shard``, in the distributed optimizer's place); Muon (``--optimizer muon``: Newton-Schulz
on the matrices each rank owns whole, AdamW on the rest).

Holds: buffers, grad_sync, param_sync, optimizer, offload, fsdp, precision, lr_schedule, state_shards, muon,
newton_schulz.
May import: moefold.parallel, moefold.dense (the output head's tied weight); nothing else of training.
"""

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

__all__ = [
    "Bucket", "FlatGroup", "build_flat_groups", "reduction_kind", "GradSync", "ParamSync",
    "DistributedAdamW", "decays", "DistributedMuon", "MuonOptions", "is_muon_matrix", "ScaleMode", "TPMode",
    "newton_schulz", "HostOptimizer", "offloaded_buckets",
    "DTYPES", "OptimizerPrecision", "DECAY_STYLES", "WSD_STYLES", "LRSchedule",
    "ShardPieces", "ShardSavePlanner", "ShardLoadPlanner", "saved_keys", "load_pieces",
]
