"""Export a moefold model of any layout to an HF checkpoint directory (sharded safetensors + index + config.json).

    export_hf(model, "out_dir")                          # collective: every rank of the model calls it

Every tensor is gathered to full shape (``parallel.sharding.gather_full``: all-gathers over each
shard group) and written by ``writer_rank`` only, shard file by shard file, so the writer holds at
most one output shard (plus the embedding/head when DeepSeek MTP copies are written). Routed
experts are written per expert (the naming ``save_pretrained`` writes, which transformers loads
into its fused layout) or fused (``expert_format="fused"``). Pipeline stages are not gathered
here: export from a layout with pp = 1, or have each stage export and merge the indexes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.models.config import ModelConfig
from moefold.models.decoder import MoEDecoder
from moefold.models.hf.assets import copy_assets
from moefold.models.hf.config_map import to_hf_config
from moefold.models.hf.fp8_blocks import HUB_CONFIG, V4_CONFIG, quantized_tensors
from moefold.models.hf.mapping import (
    EXPERT_FORMATS,
    expert_names,
    gpt_oss_b13_to_hf,
    gpt_oss_w13_to_hf,
    hf_layout,
    hf_names,
)
from moefold.models.tensor_io import ShardedWriter, dtype_name
from moefold.parallel.sharding import gather_full, shards_of


def hf_tensors(name: str, full: Tensor, config: ModelConfig, expert_format: str = "per_expert",
               ) -> Iterator[tuple[str, Tensor]]:
    """The HF tensors of one full moefold tensor (GPT-OSS experts: its one layout, whatever ``expert_format``)."""
    ex = expert_names(name, config)
    if ex is None:
        layout = hf_layout(name, config)
        if layout is None:
            yield hf_names(name, config, expert_format)[0], full
        else:
            yield from zip([n for n, _ in layout.hf_parts(tuple(full.shape))], layout.to_hf(full))
        return
    if ex.gpt_oss:
        which = name.rsplit(".", 1)[1]
        convert = {"w13": gpt_oss_w13_to_hf, "w13_bias": gpt_oss_b13_to_hf, "w2": lambda t: t.transpose(1, 2),
                   "w2_bias": lambda t: t}[which]
        yield ex.fused(which), convert(full).contiguous()
        return
    w13 = name.endswith("w13")
    if expert_format == "fused":
        E = full.shape[0]
        yield ex.fused("w13" if w13 else "w2"), full.reshape(E, -1, full.shape[-1]) if w13 else full
        return
    prefix = ex.per_expert_prefixes[0]
    for e in range(full.shape[0]):
        if w13:
            yield ex.per_expert(prefix, e, "gate"), full[e, 0]
            yield ex.per_expert(prefix, e, "up"), full[e, 1]
        else:
            yield ex.per_expert(prefix, e, "down"), full[e]


def export_hf(model: MoEDecoder, out_dir: str | os.PathLike, expert_format: str = "per_expert",
              max_shard_bytes: int = 5 * 2**30, writer_rank: int = 0,
              assets_from: str | os.PathLike | None = None, fp8: bool = False) -> None:
    """Write ``model`` as an HF checkpoint directory. Collective over every group the parameters are
    sharded on (call it on every rank of the model).

    ``config.json`` keeps every field of the config the model was imported from (``models.hf.config_map``);
    ``assets_from``: a directory whose ``generation_config.json`` and tokenizer files are copied along.
    ``fp8``: the linear weights as e4m3 with a ``weight_scale_inv`` per 128x128 block and the hub's
    ``quantization_config`` (``models.hf.fp8_blocks``; a DeepSeek-V4 model in V4-Flash's form: ue8m0 ``.scale``
    partners, routed experts packed FP4, ``expert_dtype: "fp4"``); else every tensor unquantized (and no
    ``quantization_config``, even when the model was read from an FP8 checkpoint)."""
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert_format={expert_format!r}; valid: {', '.join(EXPERT_FORMATS)}")
    if fp8 and expert_format != "per_expert":
        raise ValueError("--hf-fp8 writes the hub's layout: per-expert weights (--expert-format per_expert), each "
                         "with its weight_scale_inv")
    if model.dims.pp > 1:
        raise ValueError(f"export_hf gathers within one pipeline stage; the model has pp={model.dims.pp}")
    config = model.config
    source_quant = ((config.extra or {}).get("hf_config") or {}).get("quantization_config") or {}
    keep = list(source_quant.get("modules_to_not_convert") or []) if isinstance(source_quant, dict) else []
    v4 = fp8 and config.family == "deepseek_v4"   # DeepSeek-V4's published form: ue8m0 scales, FP4 routed experts
    rank = dist.get_rank() if dist.is_initialized() else 0
    writer = ShardedWriter(out_dir, max_shard_bytes) if rank == writer_rank else None
    shared: dict[str, Tensor] = {}
    dtype = None
    for name, tensor in model.state_dict(keep_vars=True).items():
        full = gather_full(tensor, shards_of(tensor))
        if writer is None:
            continue
        if name in ("embed_tokens.weight", "output_head.proj.weight") and config.mtp_num_layers:
            shared[name] = full
        if dtype is None and torch.is_floating_point(full) and full.dim() > 1:
            dtype = full.dtype
        routed = expert_names(name, config) is not None
        for hf_name, value in hf_tensors(name, full, config, expert_format):
            for out_name, out in (quantized_tensors(hf_name, value, routed, v4, keep) if fp8 else [(hf_name, value)]):
                writer.add(out_name, out)
    if writer is not None:
        # DeepSeek checkpoints carry each MTP layer's copy of the shared embedding and head
        head = shared.get("output_head.proj.weight", shared.get("embed_tokens.weight"))
        for k in range(config.mtp_num_layers):
            j = config.num_layers + k
            writer.add(f"model.layers.{j}.embed_tokens.weight", shared["embed_tokens.weight"])
            writer.add(f"model.layers.{j}.shared_head.head.weight", head)
        writer.finish()
        hf_config = to_hf_config(config, dtype=dtype_name(dtype or torch.float32))
        hf_config.pop("quantization_config", None)   # the tensors written are what decides it
        hf_config.pop("expert_dtype", None)          # DeepSeek-V4's, kept from an imported config.json
        if fp8:
            hf_config["quantization_config"] = {**(V4_CONFIG if v4 else HUB_CONFIG),
                                                **({"modules_to_not_convert": keep} if keep else {})}
            if v4:   # where DeepSeek-V4-Flash's config.json has it (transformers folds it into quantization_config)
                hf_config["expert_dtype"] = "fp4"
        (Path(out_dir) / "config.json").write_text(json.dumps(hf_config, indent=2))
        if assets_from is not None:
            copy_assets(assets_from, out_dir)
    if dist.is_initialized():
        dist.barrier()
