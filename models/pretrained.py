"""Starting weights from a directory of full tensors: an HF model directory or a moefold checkpoint.

    config = pretrained_config("Qwen3-30B-A3B")            # its ModelConfig (HF config.json or moefold_config.json)
    model = MoEDecoder(config, dims, options); model.init_weights(seed)
    load_pretrained_weights(model, "Qwen3-30B-A3B")         # each rank reads only its slices
    load_pretrained_weights(moe, "Qwen3-8B", upcycle=True)  # a dense directory into its upcycled MoE

What ``moefold train --load-hf DIR`` (and ``--moe-use-upcycling``) does on every rank. Nothing crosses
ranks; a stage model (pipeline parallelism) reads its own layers only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moefold.models import checkpoint as moefold_checkpoint
from moefold.models.config import ModelConfig
from moefold.models.decoder import MoEDecoder
from moefold.models.hf import importer
from moefold.models.hf.bounds import check_weights_match_config
from moefold.models.hf.fp8_blocks import fp8_reader
from moefold.models.tensor_io import TensorReader


def pretrained_kind(path: str | os.PathLike) -> str:
    """"moefold" (``moefold_config.json``) or "hf" (``config.json``); ValueError naming the path otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory")
    if moefold_checkpoint.is_moefold_checkpoint(path):
        return "moefold"
    if (path / "config.json").is_file():
        return "hf"
    raise ValueError(f"{path}: neither an HF model directory (config.json) nor a moefold checkpoint "
                     f"({moefold_checkpoint.CONFIG_FILE})")


@contextmanager
def open_pretrained(path: str | os.PathLike) -> Iterator[tuple[ModelConfig, TensorReader, bool]]:
    """(config, tensor reader, whether the tensors use HF names) of ``path``; the reader closes on exit. The
    config must describe the tensors there (``models.hf.bounds``: checked before anything is allocated)."""
    kind = pretrained_kind(path)
    with importer.open_hf_tensors(path) if kind == "hf" else TensorReader(path) as reader:
        if kind == "hf":
            config = importer.load_config(path, reader)
            importer.check_quantization(config)
            reader = fp8_reader(reader, (config.extra or {}).get("hf_config"))   # FP8 blocks read dequantised
            check_weights_match_config(path, config, reader, importer.read_hf_config(path))
            yield config, reader, True
        else:
            config = moefold_checkpoint.load_config(path)
            check_weights_match_config(path, config, reader, config_file=moefold_checkpoint.CONFIG_FILE)
            yield config, reader, False


def pretrained_config(path: str | os.PathLike) -> ModelConfig:
    """The architecture of ``path`` (DeepSeek-V3 MTP layers only when their tensors are there)."""
    with open_pretrained(path) as (config, _, hf):
        if hf:
            importer.check_quantization(config)
        return config


def load_pretrained_weights(model: MoEDecoder, path: str | os.PathLike, upcycle: bool = False) -> None:
    """Read this rank's slice of every tensor of ``model`` from ``path``; ``upcycle``: ``path`` holds the
    dense model ``model`` is an upcycling of (``models.upcycle``). No communication."""
    if upcycle:
        from moefold.models.upcycle import load_upcycled_weights

        load_upcycled_weights(model, path)
        return
    with open_pretrained(path) as (_, reader, hf):   # tensor names and shapes are checked as they are read
        if hf:
            importer.load_weights(model, reader)
        else:
            moefold_checkpoint.load_weights(model, path)
