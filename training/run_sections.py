"""The run config's sections for what a run writes and when it stops: ``CheckpointConfig`` (saving, loading, the
starting weights, stopping early with a save, bad steps) and ``LoggingConfig`` (run directory and id, logging, W&B).
``TrainConfig`` composes them with the others (``training.sections``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moefold.models.flag_field import flag
from moefold.training.section_checks import positive_int_or_none, positive_ints

# the signals that stop a run after its current step, with a checkpoint (Megatron's --exit-signal-handler)
EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")   # the ones --exit-signal takes


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and loading, the starting weights, and when a run stops early (saving first)."""

    save: str | None = flag(None, "checkpoint directory (default RUN_DIR/checkpoints)")
    save_interval: int = flag(0, "steps between checkpoints (0: only at the end)")
    keep_last: int = flag(2, "checkpoints kept (older ones are deleted)")
    load: str | None = flag(None, "resume from the newest intact checkpoint in this directory (or this checkpoint); "
                            "must exist unless it is also --save")
    async_save: bool = flag(False, "write --save-interval checkpoints in the background "
                            "(torch.distributed.checkpoint.async_save): training waits only for the copy to host "
                            "memory; the final save waits", action="store_true")
    # starting weights (train --load-hf): the architecture and weights of an HF (or moefold) directory
    load_hf: str | None = flag(None, "start from an HF model directory (or a moefold checkpoint): its config.json is "
                               "the model, its weights the starting point (each rank reads its slices); instead of "
                               "--recipe", metavar="DIR")
    moe_use_upcycling: bool = flag(False, "--load-hf holds a dense model (Qwen3, Mistral, a moefold dense "
                                   "checkpoint): start from its MoE upcycling with --num-experts / --moe-router-topk "
                                   "[/ --moe-ffn-hidden-size: granular]", action="store_true")
    load_megatron: str | None = flag(None, "start from a Megatron-Core torch_dist checkpoint (a Megatron-LM --save "
                                     "directory or one iter_N): its args are the model (or --recipe and model flags "
                                     "when it stores none), every rank reads its slices; instead of --recipe",
                                     metavar="DIR")
    # stopping early, saving first (training.launch.signals)
    exit_signals: tuple[str, ...] = EXIT_SIGNALS   # () : no handler (a signal ends the process as usual)
    exit_duration_in_mins: float | None = flag(None, "stop (and save) after this many minutes of training; exit 0")
    exit_interval: int | None = flag(None, "stop (and save) after the first step divisible by this; exit 0")
    max_skipped_steps: int = flag(5, "stop after this many non-finite steps in a row")

    def __post_init__(self) -> None:
        object.__setattr__(self, "exit_signals", tuple(self.exit_signals))   # a list after a JSON round trip
        positive_ints(self, "keep_last", "max_skipped_steps")
        if self.save_interval < 0:
            raise ValueError(f"--save-interval={self.save_interval} must be >= 0")
        if self.load_hf and self.load_megatron:
            raise ValueError("give either --load-hf or --load-megatron (the starting weights), not both")
        if self.moe_use_upcycling and not self.load_hf:
            raise ValueError("--moe-use-upcycling needs --load-hf DIR (the dense checkpoint to upcycle)")
        bad = [s for s in self.exit_signals if s not in STOP_SIGNALS]
        if bad:
            raise ValueError(f"--exit-signal {' '.join(bad)}: valid: {', '.join(STOP_SIGNALS)}")
        if self.exit_duration_in_mins is not None and not (isinstance(self.exit_duration_in_mins, (int, float))
                                                           and 0 < self.exit_duration_in_mins < math.inf):
            raise ValueError(f"--exit-duration-in-mins={self.exit_duration_in_mins!r} must be a positive number")
        positive_int_or_none("--exit-interval", self.exit_interval)


@dataclass(frozen=True)
class LoggingConfig:
    """Where a run writes and what it reports."""

    run_dir: str = "runs/moefold"
    log_interval: int = flag(10, "steps per printed line and metrics record")
    run_id: str | None = None                  # this run's id (training.checkpoint.identity; the CLI sets it)
    balance_report: bool = True
    # Weights & Biases (optional dependency; WANDB_MODE=offline works without network)
    wandb_project: str | None = flag(None, "also log to Weights & Biases (pip install wandb; WANDB_MODE=offline works"
                                     " without network)")
    wandb_exp_name: str | None = flag(None, "W&B run name")
    wandb_save_dir: str | None = flag(None, "W&B directory (default: the run directory)")

    def __post_init__(self) -> None:
        positive_ints(self, "log_interval")


__all__ = ["EXIT_SIGNALS", "STOP_SIGNALS", "CheckpointConfig", "LoggingConfig"]
