"""A model from any checkpoint moefold reads: a training run's, a moefold checkpoint, an HF directory.

    model, assets = load_model("runs/x/checkpoints/iter_0000300")   # saved at any layout (tp, ep, pp, ...)
    model, assets = load_model("runs/x/checkpoints")                 # the latest complete one under it
    model, assets = load_model("Qwen3-30B-A3B")                      # HF (or moefold) directory

``assets`` is the directory holding the tokenizer and ``generation_config.json`` that belong to the
model (None if there is none): the directory itself for HF/moefold checkpoints; for a training
checkpoint ``SAVE/hf_assets`` (written by ``train --load-hf``) or, failing that, the ``--load-hf``
directory recorded in the run's config. ``convert`` exports them along; ``generate`` tokenises with them.

Training checkpoints are ``torch.distributed.checkpoint`` directories (``training.checkpoint.sharded``), read
at whatever layout ``dims`` describes (world 1 by default): the model part only, never the optimizer.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moefold.execution import build_decoder
from moefold.models.decoder import MoEDecoder
from moefold.models.hf.assets import RUN_ASSETS_DIR, present_assets
from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelDims
from moefold.training.checkpoint.identity import describe_checkpoint
from moefold.training.checkpoint.sharded import META, find_checkpoint, read_meta
from moefold.training.config import RunConfig


def find_training_checkpoint(path: str | os.PathLike) -> Path | None:
    """``path`` when it is a complete training checkpoint, the latest complete one under it, else None."""
    path = Path(path)
    if not path.is_dir() or (path / "moefold_config.json").is_file() or (path / "config.json").is_file():
        return None
    return find_checkpoint(path, log=lambda _m: None, resume=False)


def describe_source(path: str | os.PathLike) -> str | None:
    """For a training checkpoint (or a --save directory): which ``iter_N`` of which run ``load_model`` takes
    (``training.checkpoint.identity.describe_checkpoint``); None for HF and moefold directories."""
    ckpt = find_training_checkpoint(path)
    return None if ckpt is None else describe_checkpoint(ckpt)


def training_run_config(ckpt: str | os.PathLike) -> RunConfig:
    """The run configuration stored in a training checkpoint's ``meta.json``."""
    meta = read_meta(ckpt)
    if "config" not in meta:
        raise ValueError(f"{Path(ckpt) / META}: no run configuration (written by an older moefold?)")
    return RunConfig.from_dict(meta["config"])


def training_assets(ckpt: str | os.PathLike, config: RunConfig) -> Path | None:
    """Where the tokenizer and generation config of a training checkpoint's model are (None: nowhere)."""
    candidates = [Path(ckpt).parent / RUN_ASSETS_DIR]
    if config.train.load_hf:
        candidates.append(Path(config.train.load_hf))
    return next((c for c in candidates if c.is_dir() and present_assets(c)), None)


def load_training_checkpoint(ckpt: str | os.PathLike, dims: ParallelDims | None = None,
                             options: ModelOptions | None = None) -> MoEDecoder:
    """The model of a training checkpoint at layout ``dims`` (pp must be 1). Collective over ``dims``' groups."""
    from moefold.training.checkpoint.sharded import load_checkpoint

    dims = dims or ParallelDims.single()
    if dims.pp > 1:
        raise ValueError(f"load_training_checkpoint builds the whole model; got pp={dims.pp}")
    run = training_run_config(ckpt)
    saved = ModelOptions(dtype="bf16" if run.train.bf16 else "fp16" if run.train.fp16 else run.options.dtype)
    model = build_decoder(run.model, dims, saved)
    load_checkpoint(ckpt, model, dims, None, log=lambda _m: None)
    options = options or saved
    if options != saved:
        model = _rebuild(model, dims, options)
    return model


@torch.no_grad()
def _rebuild(model: MoEDecoder, dims: ParallelDims, options: ModelOptions) -> MoEDecoder:
    """``model``'s weights in a model built with ``options`` (e.g. another dtype; routers stay fp32)."""
    out = build_decoder(model.config, dims, options)
    out.load_state_dict(model.state_dict())
    return out


def load_model(path: str | os.PathLike, dims: ParallelDims | None = None, options: ModelOptions | None = None,
               device: torch.device | str = "cpu") -> tuple[MoEDecoder, Path | None]:
    """(model on ``device``, assets directory) of any checkpoint directory (see the module docstring)."""
    from moefold.models.pretrained import load_pretrained_weights, pretrained_config, pretrained_kind

    ckpt = find_training_checkpoint(path)
    with torch.device(device):   # parameters are created there; slices are read straight into them
        if ckpt is not None:
            return load_training_checkpoint(ckpt, dims, options), training_assets(ckpt, training_run_config(ckpt))
        try:
            pretrained_kind(path)
        except ValueError:
            raise ValueError(f"{path}: not a checkpoint moefold reads (an HF directory with config.json, a moefold "
                             "checkpoint with moefold_config.json, or a training checkpoint iter_N / its --save "
                             "directory)") from None
        model = build_decoder(pretrained_config(path), dims, options)
    load_pretrained_weights(model, path)
    return model, Path(path) if present_assets(path) else None
