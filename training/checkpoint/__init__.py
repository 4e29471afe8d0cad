"""Training checkpoints: the directory format (manifest, atomic rename, keep-last, fallback past damaged
ones), the sharded save/load through torch.distributed.checkpoint, what a resumed run must share with its
checkpoint, and loading a training checkpoint (any layout) into a model.

Holds: files, sharded, resume, load_model.
May import: moefold.models, moefold.parallel; training.config, training.optim, training.errors.
"""

from moefold.training.checkpoint.files import (
    CheckpointError,
    CheckpointSaveError,
    checkpoint_dirs,
    complete_checkpoints,
    find_checkpoint,
    is_checkpoint_dir,
    verify_checkpoint,
)
from moefold.training.checkpoint.load_model import load_model, load_training_checkpoint
from moefold.training.checkpoint.resume import check_resume
from moefold.training.checkpoint.sharded import load_checkpoint, read_meta, save_checkpoint

__all__ = [
    "CheckpointError", "CheckpointSaveError", "checkpoint_dirs", "complete_checkpoints", "find_checkpoint",
    "is_checkpoint_dir", "verify_checkpoint", "save_checkpoint", "load_checkpoint", "read_meta",
    "check_resume", "load_model", "load_training_checkpoint",
]
