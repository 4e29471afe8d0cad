"""The moefold model checkpoint: a directory with ``moefold_config.json`` and full (unsharded) tensors
in moefold naming (``model.safetensors`` or sharded files + ``model.safetensors.index.json``).

Layout-independent: any parallel layout saves it (tensors gathered with ``gather_full``, written by
one rank) and any layout loads it (each rank reads only its slices). ``moefold convert`` turns HF
checkpoints into it and back. (Optimizer state and training progress belong to the trainer's
checkpoint, which can embed this directory as its model part.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moefold.models.config import ModelConfig
from moefold.models.decoder import MoEDecoder
from moefold.models.hf.assets import copy_assets
from moefold.models.hf.importer import local_box
from moefold.models.options import ModelOptions
from moefold.models.tensor_io import ShardedWriter, TensorReader
from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import full_shape, gather_full, shards_of

CONFIG_FILE = "moefold_config.json"
FORMAT_VERSION = 1


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    return config.to_dict()


def config_from_dict(data: dict[str, Any]) -> ModelConfig:
    return ModelConfig.from_dict(data)


def is_moefold_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def load_config(path: str | os.PathLike) -> ModelConfig:
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"{path}: no {CONFIG_FILE} (not a moefold checkpoint)")
    data = json.loads(file.read_text())
    if data.get("format") != "moefold" or data.get("version") != FORMAT_VERSION:
        raise ValueError(f"{file}: format={data.get('format')!r} version={data.get('version')!r}, expected "
                         f"'moefold' version {FORMAT_VERSION}")
    return config_from_dict(data["model"])


def save_checkpoint(model: MoEDecoder, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 2**30,
                    writer_rank: int = 0, assets_from: str | os.PathLike | None = None) -> None:
    """Write ``model``'s full tensors. Collective over the parameters' shard groups (every rank calls).
    ``assets_from``: a directory whose generation config and tokenizer files are copied along."""
    if model.dims.pp > 1:
        raise ValueError(f"save_checkpoint gathers within one pipeline stage; the model has pp={model.dims.pp}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    writer = ShardedWriter(out_dir, max_shard_bytes) if rank == writer_rank else None
    for name, tensor in model.state_dict(keep_vars=True).items():
        full = gather_full(tensor, shards_of(tensor))
        if writer is not None:
            writer.add(name, full)
    if writer is not None:
        writer.finish()
        (Path(out_dir) / CONFIG_FILE).write_text(json.dumps(
            {"format": "moefold", "version": FORMAT_VERSION, "model": config_to_dict(model.config)}, indent=2))
        if assets_from is not None:
            copy_assets(assets_from, out_dir)
    if dist.is_initialized():
        dist.barrier()


@torch.no_grad()
def load_weights(model: MoEDecoder, path: str | os.PathLike) -> None:
    """Read this rank's slice of every tensor of ``model`` from a moefold checkpoint (no communication)."""
    with TensorReader(path) as reader:
        for name, tensor in model.state_dict(keep_vars=True).items():
            shape = full_shape(tensor)
            if name not in reader:
                raise ValueError(f"missing tensor {name!r} (shape {list(shape)}) in {path}")
            if reader.shape(name) != shape:
                raise ValueError(f"tensor {name!r} has shape {list(reader.shape(name))}, expected {list(shape)}")
            tensor.copy_(reader.read(name, local_box(shape, shards_of(tensor))).to(tensor.dtype))


def load_checkpoint(path: str | os.PathLike, dims: ParallelDims | None = None,
                    options: ModelOptions | None = None) -> MoEDecoder:
    """Build the checkpoint's model over ``dims`` and load it."""
    model = MoEDecoder(load_config(path), dims, options)
    load_weights(model, path)
    return model
