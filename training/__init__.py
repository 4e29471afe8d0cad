"""Training: the run config, the trainer loop and ``train()`` at the top; one subpackage per component.

    config.py    RunConfig / TrainConfig (typed, validated where each field is defined)
    trainer.py   Trainer: micro-batches, gradient accumulation, the step, checkpoints, metrics
    build.py     the run's model options, this rank's model, its gradient sync and optimizer (trainer and plan)
    run.py       train(config): data, evaluation, reports around the trainer on every rank
    evaluate.py  validation passes; compile.py: torch.compile of the model's blocks; errors.py: one-line errors
    routing_replay.py, routing_file.py  routing replay: record / replay a forward's expert choices, the file
    optim/       the distributed optimizer: flat buffers, grad reduce-scatter, param all-gather, AdamW, lr
    checkpoint/  the checkpoint format, sharded save/load, resume checks, loading a checkpoint into a model
    launch/      pre-flight checks, local ranks and torchrun, heartbeats and the watchdog
    observe/     metrics, hardware counters and MFU, memory, FLOPs, host syncs, balance and FP8 reports
    data/        corpus preparation, indexed datasets, tokenizers, blending, the validation split, loading
    cli/         the ``moefold`` command and the subcommands that need the trainer or its checkpoints

The parts import downwards only (``[tool.importlinter]`` in pyproject.toml: cli > run > trainer > evaluate, build >
launch > checkpoint > config, compile > observe, data > optim, errors). The planner (``moefold.planner``) and the
GPU check and benchmarks (``moefold.tools``) live beside this package and import it; nothing here imports them.

The public names below load on first use: ``moefold <subcommand>`` imports ``moefold.training.cli`` (hence
this package) and should not pay for the model, pipeline and DCP imports of the trainer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moefold.parallel.sharding import named_full_params
    from moefold.training.checkpoint import (
        CheckpointError,
        CheckpointSaveError,
        complete_checkpoints,
        find_checkpoint,
        load_checkpoint,
        load_model,
        load_training_checkpoint,
        save_checkpoint,
    )
    from moefold.training.config import RunConfig, TrainConfig
    from moefold.training.errors import JobFailed
    from moefold.training.evaluate import EvalResult, Evaluator, evaluate
    from moefold.training.launch import preflight, run_ranks
    from moefold.training.observe import MetricsLogger, forward_flops_per_token, read_metrics, train_flops_per_token
    from moefold.training.optim import (
        DistributedAdamW,
        GradSync,
        LRSchedule,
        OptimizerPrecision,
        decays,
        reduction_kind,
    )
    from moefold.training.routing_file import RoutingFile, RoutingRecording, load_routing
    from moefold.training.routing_replay import record_routing, replay_routing
    from moefold.training.run import train
    from moefold.training.trainer import NonFiniteError, StepResult, Trainer

# name -> the module that defines it
_LAZY = {
    **dict.fromkeys(["RunConfig", "TrainConfig"], "moefold.training.config"),
    **dict.fromkeys(["Trainer", "StepResult", "NonFiniteError"], "moefold.training.trainer"),
    "named_full_params": "moefold.parallel.sharding",
    "train": "moefold.training.run",
    **dict.fromkeys(["evaluate", "Evaluator", "EvalResult"], "moefold.training.evaluate"),
    "JobFailed": "moefold.training.errors",
    **dict.fromkeys(["RoutingFile", "RoutingRecording", "load_routing"], "moefold.training.routing_file"),
    **dict.fromkeys(["record_routing", "replay_routing"], "moefold.training.routing_replay"),
    **dict.fromkeys(["GradSync", "reduction_kind", "DistributedAdamW", "OptimizerPrecision", "decays",
                     "LRSchedule"], "moefold.training.optim"),
    **dict.fromkeys(["save_checkpoint", "load_checkpoint", "find_checkpoint", "complete_checkpoints",
                     "load_model", "load_training_checkpoint", "CheckpointError", "CheckpointSaveError"],
                    "moefold.training.checkpoint"),
    **dict.fromkeys(["run_ranks", "preflight"], "moefold.training.launch"),
    **dict.fromkeys(["MetricsLogger", "read_metrics", "forward_flops_per_token", "train_flops_per_token"],
                    "moefold.training.observe"),
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
    "record_routing", "replay_routing", "RoutingRecording", "RoutingFile", "load_routing",
]
