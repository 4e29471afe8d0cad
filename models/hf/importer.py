"""Import an HF checkpoint directory into a moefold model of any parallel layout.

    model = import_hf("path/to/hf_dir", dims, ModelOptions())     # config.json -> ModelConfig -> model
    load_hf_weights(model, "path/to/hf_dir")                       # into an existing model

Each rank reads only the slices its parameters hold (the box given by their ``Shard`` marks, read
with ``safe_open(...).get_slice``); nothing crosses ranks. Routed experts are read from either
naming: per expert (``experts.{e}.gate_proj``..., what ``save_pretrained`` writes; Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2``) or fused (``experts.gate_up_proj [E, 2F, H]``,
``experts.down_proj [E, H, F]``). A missing tensor or a wrong shape fails naming the tensor and
both shapes; with ``strict`` and a whole model, so does a checkpoint tensor that nothing reads.

(The module is ``importer``, not ``import``: ``import`` is a Python keyword.)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from moefold.models.config import ModelConfig
from moefold.models.decoder import MoEDecoder
from moefold.models.hf.config_map import from_hf_config
from moefold.models.hf.fp8_blocks import block_size, fp8_reader
from moefold.models.hf.mapping import (
    ExpertNames,
    expert_names,
    gpt_oss_b13_from_hf,
    gpt_oss_w13_from_hf,
    hf_layout,
    hf_names,
    ignored_hf_names,
    is_ignorable,
)
from moefold.models.hf.multimodal import TextModelReader, text_config, text_reader
from moefold.models.options import ModelOptions
from moefold.models.tensor_io import TensorReader
from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import Shard, full_shape, shards_of


def local_box(shape: tuple[int, ...], shards: tuple[Shard, ...]) -> tuple[slice, ...]:
    """The slice of the full tensor ``shape`` that a parameter with ``shards`` holds."""
    starts, sizes = [0] * len(shape), list(shape)
    for s in shards:
        sizes[s.dim] //= s.num
        starts[s.dim] += s.index * sizes[s.dim]
    return tuple(slice(a, a + b) for a, b in zip(starts, sizes))


def raw_hf_config(path: str | os.PathLike) -> dict:
    """The directory's config.json as stored."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: no config.json (not an HF checkpoint directory)")
    return json.loads(file.read_text())


def read_hf_config(path: str | os.PathLike) -> dict:
    """The config.json of the model moefold reads: a multimodal directory's text model (``models.hf.multimodal``)."""
    return text_config(raw_hf_config(path))


def open_hf_tensors(path: str | os.PathLike) -> TensorReader | TextModelReader:
    """The directory's tensors under the names of the model ``read_hf_config`` describes; close it after use."""
    return text_reader(TensorReader(path), raw_hf_config(path))


def load_config(path: str | os.PathLike, reader: TensorReader | None = None) -> ModelConfig:
    """``ModelConfig`` of an HF directory. DeepSeek-V3 configs announce MTP layers that transformers'
    ``save_pretrained`` does not write: without their tensors the config gets ``mtp_num_layers=0``."""
    config = from_hf_config(read_hf_config(path), name=Path(path).name)
    if config.mtp_num_layers:
        own = reader or open_hf_tensors(path)
        try:
            if f"model.layers.{config.num_layers}.eh_proj.weight" not in own:
                config = config.with_(mtp_num_layers=0)
        finally:
            if reader is None:
                own.close()
    return config


def check_quantization(config: ModelConfig) -> tuple[int, int] | None:
    """The FP8 weight block of a checkpoint stored in FP8 blocks (DeepSeek-V3 / V4, Kimi-K2, MiniMax-M2: read
    dequantised, ``models.hf.fp8_blocks``; V4's FP4 experts: ``models.hf.fp4_experts``), None for an unquantized
    one; one-line ValueError naming the config for a quantization moefold does not read (GPT-OSS's MXFP4, ...) or a
    ``quantization_config`` field it does not know. The config alone reads fine either way."""
    try:
        return block_size((config.extra or {}).get("hf_config"))
    except ValueError as exc:
        raise ValueError(f"{config.name}: {exc}") from None


def import_hf(path: str | os.PathLike, dims: ParallelDims | None = None, options: ModelOptions | None = None,
              strict: bool = True) -> MoEDecoder:
    """Build the model an HF directory describes over ``dims`` and load its weights."""
    from moefold.models.hf.bounds import check_weights_match_config

    with open_hf_tensors(path) as reader:
        config = load_config(path, reader)
        check_quantization(config)
        weights = fp8_reader(reader, (config.extra or {}).get("hf_config"))   # logical shapes: FP4 counts whole
        check_weights_match_config(path, config, weights, read_hf_config(path))
        model = MoEDecoder(config, dims, options)
        load_weights(model, weights, strict=strict)
    return model


def load_hf_weights(model: MoEDecoder, path: str | os.PathLike, strict: bool = True) -> None:
    with open_hf_tensors(path) as reader:
        load_weights(model, reader, strict=strict)


def _shape_error(name: str, hf_name: str, got: tuple, want: tuple) -> ValueError:
    return ValueError(f"tensor {hf_name!r} (for {name!r}) has shape {list(got)}, expected {list(want)}")


def read_plain(reader: TensorReader, name: str, candidates: list[str], shape: tuple, box: tuple | None,
               ) -> tuple[Tensor, str]:
    """``box`` (None: all) of the first of the HF tensors ``candidates`` the reader holds, checked to have the
    full ``shape`` of the moefold tensor ``name``; (slice, the HF name read)."""
    for hf_name in candidates:
        if hf_name in reader:
            got = reader.shape(hf_name)
            if got != shape:
                raise _shape_error(name, hf_name, got, shape)
            return reader.read(hf_name, box), hf_name
    raise ValueError(f"missing tensor {candidates[0]!r} (for {name!r}, shape {list(shape)}) in {reader.root}")


def _read_gpt_oss_experts(reader: TensorReader, name: str, ex: ExpertNames, shape: tuple, box: tuple,
                           ) -> tuple[Tensor, list[str]]:
    """GPT-OSS: ``gate_up_proj [E, H, 2F]`` / ``_bias [E, 2F]`` with gate and up interleaved (the F slice
    ``[f0, f1)`` is the contiguous range ``[2 f0, 2 f1)``), ``down_proj [E, F, H]`` transposed, ``_bias [E, H]``."""
    which = name.rsplit(".", 1)[1]
    hf_name = ex.fused(which)
    if which == "w13":
        E, _, F, H = shape
        want, read_box = (E, H, 2 * F), (box[0], slice(None), slice(2 * box[2].start, 2 * box[2].stop))
    elif which == "w13_bias":
        E, _, F = shape
        want, read_box = (E, 2 * F), (box[0], slice(2 * box[2].start, 2 * box[2].stop))
    elif which == "w2":
        E, H, F = shape
        want, read_box = (E, F, H), (box[0], box[2], slice(None))
    else:
        want, read_box = shape, box
    if hf_name not in reader:
        raise ValueError(f"missing tensor {hf_name!r} (for {name!r}, shape {list(want)}) in {reader.root}")
    got = reader.shape(hf_name)
    if got != want:
        raise _shape_error(name, hf_name, got, want)
    value = reader.read(hf_name, read_box)
    convert = {"w13": gpt_oss_w13_from_hf, "w13_bias": gpt_oss_b13_from_hf, "w2": lambda t: t.transpose(1, 2),
               "w2_bias": lambda t: t}[which]
    return convert(value), [hf_name]


def _read_experts(reader: TensorReader, name: str, ex: ExpertNames, shape: tuple, box: tuple,
                  ) -> tuple[Tensor, list[str]]:
    if ex.gpt_oss:
        return _read_gpt_oss_experts(reader, name, ex, shape, box)
    w13 = name.endswith("w13")
    which = "w13" if w13 else "w2"
    E = shape[0]
    fused = ex.fused(which)
    if fused in reader:  # [E, 2F, H] (gate rows then up rows) / [E, H, F]
        want = (E, shape[1] * shape[2], shape[3]) if w13 else shape
        got = reader.shape(fused)
        if got != want:
            raise _shape_error(name, fused, got, want)
        if not w13:
            return reader.read(fused, box), [fused]
        F, fs = shape[2], box[2]
        halves = [reader.read(fused, (box[0], slice(g * F + fs.start, g * F + fs.stop), box[3])) for g in range(2)]
        return torch.stack(halves, dim=1), [fused]
    prefix = next((p for p in ex.per_expert_prefixes if ex.per_expert(p, 0, "gate" if w13 else "down") in reader), None)
    if prefix is None:
        raise ValueError(f"missing expert tensors for {name!r}: neither {fused!r} nor "
                         f"{ex.per_expert(ex.per_expert_prefixes[0], 0, 'gate' if w13 else 'down')!r} in {reader.root}")
    parts, used = [], []
    projections = ("gate", "up") if w13 else ("down",)
    want = (shape[2], shape[3]) if w13 else (shape[1], shape[2])
    for e in range(box[0].start, box[0].stop):
        per = []
        for proj in projections:
            hf_name = ex.per_expert(prefix, e, proj)
            if hf_name not in reader:
                raise ValueError(f"missing tensor {hf_name!r} (for {name!r}, shape {list(want)}) in {reader.root}")
            got = reader.shape(hf_name)
            if got != want:
                raise _shape_error(name, hf_name, got, want)
            per.append(reader.read(hf_name, box[2:] if w13 else box[1:]))
            used.append(hf_name)
        parts.append(torch.stack(per) if w13 else per[0])
    # every expert's names are used by some rank: record them all for the strict check
    used = [ex.per_expert(prefix, e, p) for e in range(E) for p in projections]
    return torch.stack(parts), used


@torch.no_grad()
def load_weights(model: MoEDecoder, reader: TensorReader, strict: bool = True) -> None:
    """Copy this rank's slice of every parameter and persistent buffer of ``model`` from ``reader``
    (HF naming; see ``models.hf.mapping``). No communication."""
    config, used = model.config, set()
    check_quantization(config)
    reader = fp8_reader(reader, (config.extra or {}).get("hf_config"))   # FP8 blocks read dequantised
    for name, tensor in model.state_dict(keep_vars=True).items():
        shape = full_shape(tensor)
        box = local_box(shape, shards_of(tensor))
        ex, layout = expert_names(name, config), hf_layout(name, config)
        if ex is not None:
            value, names = _read_experts(reader, name, ex, shape, box)
            used.update(names)
        elif layout is not None:   # another layout on disk: read it whole (small), convert, keep this rank's box
            parts = [read_plain(reader, name, [hf_name], hf_shape, None)[0]
                     for hf_name, hf_shape in layout.hf_parts(shape)]
            value = layout.from_hf(parts, shape)[box]
            used.update(hf_name for hf_name, _ in layout.hf_parts(shape))
        else:
            value, hf_name = read_plain(reader, name, hf_names(name, config), shape, box)
            used.add(hf_name)
        _assign(tensor, value, name)
    if strict and _holds_whole_model(model):
        # a zero-size tensor holds nothing to read: transformers' DeepSeek-V3 / GLM-4.5 build (and save) a shared
        # expert of n_shared_experts * moe_intermediate_size = 0 rows, which adds zero, as moefold's none does
        unused = [n for n in reader.names() if n not in used and not is_ignorable(n, config)
                  and n not in set(ignored_hf_names(config)) and math.prod(reader.shape(n))]
        if unused:
            raise ValueError(f"{len(unused)} checkpoint tensors match no moefold parameter, e.g. {unused[:5]} "
                             "(wrong architecture in config.json? pass strict=False to ignore)")


def _assign(tensor: Tensor, value: Tensor, name: str) -> None:
    if tuple(value.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: read a slice of shape {list(value.shape)}, the local tensor is {list(tensor.shape)}")
    tensor.copy_(value.to(tensor.dtype))


def _holds_whole_model(model: nn.Module) -> bool:
    return (isinstance(model, MoEDecoder) and model.embed_tokens is not None and model.output_head is not None
            and len(model.layers) == model.config.num_layers)
