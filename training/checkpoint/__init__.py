"""Training checkpoints: the directory format (manifest, atomic rename, keep-last, fallback past damaged
ones), run identity (run ids, the tracker, the lock of a save directory), the sharded save (synchronous or
asynchronous) and load through torch.distributed.checkpoint with a restricted metadata reader, what a resumed
run must share with its checkpoint, and loading a training checkpoint (any layout) into a model.

Holds: atomic, identity, lock, files, safe_load, sharded, save, resume, load_model.
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
from moefold.training.checkpoint.identity import RunRecord, new_run_id, read_run, read_tracker
from moefold.training.checkpoint.load_model import load_model, load_training_checkpoint
from moefold.training.checkpoint.lock import SaveLock, SaveLockError
from moefold.training.checkpoint.resume import check_resume
from moefold.training.checkpoint.safe_load import SafeFileSystemReader, UnsafeCheckpointError, read_dcp_metadata
from moefold.training.checkpoint.save import AsyncCheckpointer, save_checkpoint
from moefold.training.checkpoint.sharded import load_checkpoint, read_meta

__all__ = [
    "CheckpointError", "CheckpointSaveError", "checkpoint_dirs", "complete_checkpoints", "find_checkpoint",
    "is_checkpoint_dir", "verify_checkpoint", "save_checkpoint", "AsyncCheckpointer", "load_checkpoint", "read_meta",
    "check_resume", "load_model", "load_training_checkpoint", "RunRecord", "new_run_id", "read_run", "read_tracker",
    "SaveLock", "SaveLockError", "SafeFileSystemReader", "UnsafeCheckpointError", "read_dcp_metadata",
]
