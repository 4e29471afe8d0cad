"""Training: CLI, trainer loop, optimizer, checkpointing, data and metrics.

The public names below load on first use: ``moefold <subcommand>`` imports ``moefold.training.cli`` (hence
this package) and should not pay for the model, pipeline and DCP imports of the trainer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moefold.training.buffers import reduction_kind
    from moefold.training.checkpoint import complete_checkpoints, find_checkpoint, load_checkpoint, save_checkpoint
    from moefold.training.checkpoint_files import CheckpointError, CheckpointSaveError
    from moefold.training.config import RunConfig, TrainConfig
    from moefold.training.errors import JobFailed
    from moefold.training.evaluate import EvalResult, Evaluator, evaluate
    from moefold.training.flops import forward_flops_per_token, train_flops_per_token
    from moefold.training.grad_sync import GradSync
    from moefold.training.launch import run_ranks
    from moefold.training.load_model import load_model, load_training_checkpoint
    from moefold.training.lr_schedule import LRSchedule
    from moefold.training.metrics import MetricsLogger, read_metrics
    from moefold.training.optimizer import DistributedAdamW, decays
    from moefold.training.precision import OptimizerPrecision
    from moefold.training.preflight import preflight
    from moefold.training.run import train
    from moefold.training.trainer import NonFiniteError, StepResult, Trainer, named_full_params

_LAZY = {
    "RunConfig": "moefold.training.config", "TrainConfig": "moefold.training.config",
    "Trainer": "moefold.training.trainer", "StepResult": "moefold.training.trainer",
    "NonFiniteError": "moefold.training.trainer",
    "named_full_params": "moefold.training.trainer",
    "GradSync": "moefold.training.grad_sync", "reduction_kind": "moefold.training.buffers",
    "OptimizerPrecision": "moefold.training.precision",
    "DistributedAdamW": "moefold.training.optimizer", "decays": "moefold.training.optimizer",
    "LRSchedule": "moefold.training.lr_schedule",
    "save_checkpoint": "moefold.training.checkpoint", "load_checkpoint": "moefold.training.checkpoint",
    "find_checkpoint": "moefold.training.checkpoint", "complete_checkpoints": "moefold.training.checkpoint",
    "MetricsLogger": "moefold.training.metrics", "read_metrics": "moefold.training.metrics",
    "forward_flops_per_token": "moefold.training.flops", "train_flops_per_token": "moefold.training.flops",
    "run_ranks": "moefold.training.launch", "train": "moefold.training.run",
    "evaluate": "moefold.training.evaluate", "Evaluator": "moefold.training.evaluate",
    "EvalResult": "moefold.training.evaluate",
    "load_model": "moefold.training.load_model", "load_training_checkpoint": "moefold.training.load_model",
    "CheckpointError": "moefold.training.checkpoint_files", "CheckpointSaveError": "moefold.training.checkpoint_files",
    "JobFailed": "moefold.training.errors", "preflight": "moefold.training.preflight",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moefold.training' has no attribute {name!r}")


__all__ = [
    "RunConfig", "TrainConfig", "Trainer", "StepResult", "NonFiniteError", "named_full_params",
    "GradSync", "reduction_kind", "DistributedAdamW", "OptimizerPrecision", "decays", "LRSchedule",
    "save_checkpoint", "load_checkpoint", "find_checkpoint", "complete_checkpoints",
    "MetricsLogger", "read_metrics", "forward_flops_per_token", "train_flops_per_token", "run_ranks", "train",
    "evaluate", "Evaluator", "EvalResult", "load_model", "load_training_checkpoint",
    "CheckpointError", "CheckpointSaveError", "JobFailed", "preflight",
]
