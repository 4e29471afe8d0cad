"""Training: CLI, trainer loop, optimizer, checkpointing, data and metrics.

The public names below load on first use: ``moefold <subcommand>`` imports ``training.cli`` (hence
this package) and should not pay for the model, pipeline and DCP imports of the trainer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.checkpoint import complete_checkpoints, find_checkpoint, load_checkpoint, save_checkpoint
    from training.config import RunConfig, TrainConfig
    from training.flops import forward_flops_per_token, train_flops_per_token
    from training.grad_sync import GradSync, reduction_kind
    from training.launch import run_ranks
    from training.lr_schedule import LRSchedule
    from training.metrics import MetricsLogger, read_metrics
    from training.optimizer import DistributedAdamW, decays
    from training.run import train
    from training.trainer import NonFiniteError, StepResult, Trainer, named_full_params

_LAZY = {
    "RunConfig": "training.config", "TrainConfig": "training.config",
    "Trainer": "training.trainer", "StepResult": "training.trainer", "NonFiniteError": "training.trainer",
    "named_full_params": "training.trainer",
    "GradSync": "training.grad_sync", "reduction_kind": "training.grad_sync",
    "DistributedAdamW": "training.optimizer", "decays": "training.optimizer",
    "LRSchedule": "training.lr_schedule",
    "save_checkpoint": "training.checkpoint", "load_checkpoint": "training.checkpoint",
    "find_checkpoint": "training.checkpoint", "complete_checkpoints": "training.checkpoint",
    "MetricsLogger": "training.metrics", "read_metrics": "training.metrics",
    "forward_flops_per_token": "training.flops", "train_flops_per_token": "training.flops",
    "run_ranks": "training.launch", "train": "training.run",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'training' has no attribute {name!r}")


__all__ = [
    "RunConfig", "TrainConfig", "Trainer", "StepResult", "NonFiniteError", "named_full_params",
    "GradSync", "reduction_kind", "DistributedAdamW", "decays", "LRSchedule",
    "save_checkpoint", "load_checkpoint", "find_checkpoint", "complete_checkpoints",
    "MetricsLogger", "read_metrics", "forward_flops_per_token", "train_flops_per_token", "run_ranks", "train",
]
