"""The trainer's checkpoints: ``save`` (synchronous, or staged for ``--async-save``), ``finish_saves`` and ``load``
(resume at any layout), as a base class of ``training.trainer.Trainer``, whose attributes they read: the model,
optimizer, dims, config, the async saver, the loss scaler, and the counters ``iteration``, ``consumed_samples``,
``skipped_in_a_row``. What crosses ranks: the sharded save and load (``training.checkpoint``)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from moefold.training.checkpoint.files import CheckpointSaveError
from moefold.training.checkpoint.resume import check_resume
from moefold.training.checkpoint.save import save_checkpoint
from moefold.training.checkpoint.sharded import find_checkpoint, load_checkpoint, load_pieces, read_meta, saved_keys


class TrainerCheckpoints:
    """``Trainer``'s save and load (module docstring)."""

    def _meta(self) -> dict:
        meta = {"consumed_samples": self.consumed_samples, "optimizer_steps": self.optimizer.step_count,
                "skipped_in_a_row": self.skipped_in_a_row, "config": self.config.to_dict(),
                "run_id": self.config.train.run_id}
        if self.loss_scaler is not None:   # plain numbers in meta.json
            meta["loss_scaler"] = self.loss_scaler.state_dict()
        return meta

    def save(self, root: str | Path, background: bool = False) -> Path | None:
        """Checkpoint this iteration under ``root`` and return it; ``background`` (with ``--async-save``): start
        writing it and return None once the state is staged (``training.checkpoint.save``). A save waits for
        the background one before it."""
        self.optimizer.finish_param_sync()
        t = self.config.train
        if self.async_saver is not None:
            if background:
                self.async_saver.save(root, self.iteration, self.model, self.optimizer.checkpoint_state(),
                                      self._meta(), keep_last=t.keep_last)
                return None
            self.async_saver.wait()
        return save_checkpoint(root, self.iteration, self.model, self.dims, self.optimizer.checkpoint_state(),
                               self._meta(), keep_last=t.keep_last, log=self.log)

    def finish_saves(self) -> None:
        """Wait for a background save (reporting its failure, as a failed interval save is: training is past it)
        and release the staging buffers."""
        if self.async_saver is None:
            return
        saver, self.async_saver = self.async_saver, None   # released once; a later save() writes synchronously
        try:
            saver.close()
        except CheckpointSaveError as exc:
            self.log(f"{exc}")

    def load(self, path: str | Path) -> bool:
        """Resume from ``path`` (a checkpoint, or the newest intact one under it, see ``find_checkpoint``).
        False if none exists. Each rank reads only its own optimizer shard (``training.optim.state_shards``),
        at any layout."""
        ckpt = find_checkpoint(path, self.dims, self.log)
        if ckpt is None:
            self.log(f"no checkpoint under {path}; starting from scratch")
            return False
        restart_data = check_resume(read_meta(ckpt), self.config, str(ckpt), self.log)
        self.optimizer.finish_param_sync()
        keys = saved_keys(ckpt)
        meta = load_checkpoint(ckpt, self.model, self.dims, self.optimizer.checkpoint_state(keys), log=self.log)
        fallback = self.optimizer.master_fallback(keys)
        if fallback or self.dims.world_size > 1:   # collective: every rank joins, even with nothing to read
            load_pieces(ckpt, fallback, no_dist=self.dims.world_size == 1 and not dist.is_initialized())
        self.optimizer.loaded(meta["optimizer_steps"])
        self.iteration = int(meta["iteration"])
        self.consumed_samples = 0 if restart_data else int(meta["consumed_samples"])
        self.skipped_in_a_row = int(meta.get("skipped_in_a_row", 0))
        if self.loss_scaler is not None and "loss_scaler" in meta:
            self.loss_scaler.load_state_dict(meta["loss_scaler"])
        run = f", run {meta['run_id']}" if meta.get("run_id") else ""
        self.log(f"resumed from {ckpt} at iteration {self.iteration} (consumed_samples {self.consumed_samples}{run})")
        return True
