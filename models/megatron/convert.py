"""Megatron-Core ``torch_dist`` checkpoints of a GPTModel (MoE) <-> moefold models, at any layout.

    model = import_megatron("ckpt", dims, ModelOptions())   # the architecture from the checkpoint's args
    load_megatron_weights(model, "ckpt")                      # into an existing model: each rank its slices
    export_megatron(model, "out")                             # out/latest_checkpointed_iteration.txt + out/release/

A checkpoint directory is a Megatron-LM ``--save`` directory (``latest_checkpointed_iteration.txt``), one of
its ``iter_NNNNNNN`` / ``release`` directories, or any directory ``dist_checkpointing.save`` wrote. Its tensors
are global, so whatever tp/pp/ep/etp saved it, each moefold rank reads only the slices its parameters hold.
The architecture comes from the ``args`` Megatron-LM stores in ``common.pt``, read with
``torch.load(weights_only=True)`` where every class other than ``argparse.Namespace`` is replaced by an inert
stand-in (nothing from the file runs); without ``args`` the caller gives the ``ModelConfig``.

Megatron-Core stores the layers per layer, stacked with a leading layer axis (``--moe-layer-freq 1``) or as
singleton local shards; ``models.megatron.layouts`` reads all three. The export writes them per layer and says so
in ``common.pt``'s ``content_metadata``, which Megatron-LM's ``load_checkpoint`` builds its state dict with.

Not carried (see ``models.megatron.mapping.is_transient``): optimizer state, RNG states, the rerun state
machine, Transformer Engine ``_extra_state`` (FP8 scaling history), iteration and scheduler counters.
Every argument that shapes the model is read or refused naming it (``models.megatron.args``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.models.config import ModelConfig
from moefold.models.decoder import MoEDecoder
from moefold.models.hf.importer import local_box
from moefold.models.megatron.args import config_from_megatron, megatron_args_from_config
from moefold.models.megatron.dcp_io import Box, DcpReader, write_dcp
from moefold.models.megatron.layouts import MegatronTensors
from moefold.models.megatron.mapping import Source, is_transient, qkv_rows, source
from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import full_shape, gather_full, shards_of

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
FORMAT = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
          "common_backend_version": 1}
# what Megatron-LM's load_checkpoint builds its sharded state dict with (dist_checkpointing.load_content_metadata):
# the export writes every layer under its own index (non_homogeneous_layers, whatever --moe-layer-freq says: without
# the flag a homogeneous model expects the stacked decoder.layers.<name> [L, ...] and refuses the checkpoint), experts
# stacked [E, ...] and GLU halves together (singleton_local_shards False, Megatron-LM's own value)
CONTENT_METADATA = {"non_homogeneous_layers": True, "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def is_megatron_checkpoint(path: str | os.PathLike) -> bool:
    """``path`` (a ``--save`` directory through its tracker, or one checkpoint) holds Megatron's torch_dist files:
    ``.metadata`` and the ``metadata.json`` dist-checkpointing writes. moefold's own ``--save`` directories use
    the same tracker name and DCP's ``.metadata`` but no ``metadata.json``."""
    p = Path(path)
    if (p / TRACKER).is_file():
        it = (p / TRACKER).read_text().strip()
        p = p / ("release" if it == "release" else f"iter_{int(it):07d}" if it.isdigit() else it)
    return (p / ".metadata").is_file() and (p / "metadata.json").is_file()


def find_megatron_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``path`` names (the tracker's iteration under a ``--save`` directory)."""
    p = Path(path)
    if (p / TRACKER).is_file():
        it = (p / TRACKER).read_text().strip()
        sub = p / ("release" if it == "release" else f"iter_{int(it):07d}")
        if not (sub / ".metadata").is_file():
            raise ValueError(f"{p / TRACKER} names iteration {it}, but {sub} holds no torch_dist checkpoint")
        if not (sub / "metadata.json").is_file():   # moefold's --save directories share the tracker's name
            raise ValueError(f"{sub} has no metadata.json: not a Megatron torch_dist checkpoint (a moefold "
                             "checkpoint? resume it with --load, or convert it without --from megatron)")
        return sub
    if (p / ".metadata").is_file():
        fmt = p / "metadata.json"
        if fmt.is_file():
            backend = json.loads(fmt.read_text()).get("sharded_backend")
            if backend not in ("torch_dist", None):
                raise ValueError(f"{fmt}: sharded_backend {backend!r}; moefold reads torch_dist checkpoints")
        return p
    raise ValueError(f"{path}: not a Megatron checkpoint (no {TRACKER}, no torch_dist .metadata)")


class _StandIn:
    """Takes the place of any class in ``common.pt`` other than ``argparse.Namespace``: keeps its arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def value(self) -> Any:
        return self.args[0] if len(self.args) == 1 else self.args


def megatron_args(ckpt: str | os.PathLike) -> dict[str, Any] | None:
    """The Megatron-LM ``args`` of a checkpoint directory as a dict, or None when ``common.pt`` has none."""
    from torch.serialization import get_safe_globals, get_unsafe_globals_in_checkpoint, safe_globals

    path = Path(ckpt) / COMMON
    if not path.is_file():
        return None
    names = [n for n in get_unsafe_globals_in_checkpoint(str(path)) if n != "argparse.Namespace"]
    stand_ins = [(type(n.rsplit(".", 1)[-1], (_StandIn,), {}), n) for n in names]
    # only what is not registered already: leaving the context removes what it added (e.g. megatron-core's own)
    extra = [argparse.Namespace] if argparse.Namespace not in get_safe_globals() else []
    with safe_globals(extra + stand_ins):
        common = torch.load(str(path), weights_only=True, map_location="cpu")
    args = common.get("args") if isinstance(common, dict) else None
    if args is None:
        return None
    out = dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args)
    return {k: (v.value if isinstance(v, _StandIn) else v) for k, v in out.items()}


# ------------------------------------------------------------------------------------------------ import
def _megatron_shape(src: Source, shape: tuple[int, ...], config: ModelConfig) -> tuple[int, ...]:
    if src.kind == "qkv":
        return ((config.num_attention_heads + 2 * config.kv_heads) * config.attention_head_dim, *shape[1:])
    if src.kind == "half":
        return (2 * shape[0], *shape[1:])
    if src.kind == "experts13":   # [E, 2, F, (H)] <- [E, 2F, (H)]
        return (shape[0], shape[1] * shape[2], *shape[3:])
    return shape


def _requests(src: Source, key: str, shape: tuple[int, ...], box: Box, config: ModelConfig) -> list[Box]:
    """The Megatron boxes to read for moefold's ``box`` of a tensor of full ``shape``."""
    if src.kind == "plain":
        return [box]
    if src.kind == "qkv":   # the layer's fused rows are interleaved per group: read all rows of the columns
        return [(slice(0, _megatron_shape(src, shape, config)[0]), *box[1:])]
    if src.kind == "half":
        F = shape[0]
        return [(slice(src.part * F + box[0].start, src.part * F + box[0].stop), *box[1:])]
    F = shape[2]   # experts13: one read per half (gate, up) of the w13 (bias) box
    return [(box[0], slice(g * F + box[2].start, g * F + box[2].stop), *box[3:])
            for g in range(box[1].start, box[1].stop)]


def _assemble(src: Source, parts: list[Tensor], box: Box, config: ModelConfig) -> Tensor:
    if src.kind == "qkv":
        rows = torch.tensor(qkv_rows(src.part, config))[box[0]]
        return parts[0][rows]
    if src.kind == "experts13":
        return torch.stack(parts, dim=1)
    return parts[0]


@torch.no_grad()
def load_megatron_weights(model: MoEDecoder, path: str | os.PathLike, strict: bool = True) -> None:
    """Copy this rank's slice of every parameter and persistent buffer of ``model`` from a Megatron checkpoint in
    any of Megatron-Core's layouts (``models.megatron.layouts``: per layer, stacked, singleton local shards).
    Missing tensors (and, for a whole model with ``strict``, checkpoint tensors nothing reads) fail on one line
    naming them. No communication."""
    reader = DcpReader(find_megatron_checkpoint(path))
    view = MegatronTensors(reader)
    config = model.config
    plan, missing, used = [], [], set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        shape = full_shape(tensor)
        src = source(name, config)
        present = [k for k in src.keys if k in view]
        if not present:
            missing.append(f"{src.keys[0]} (for {name}, {list(_megatron_shape(src, shape, config))})")
            continue
        key, want = present[0], _megatron_shape(src, shape, config)
        if view.shape(key) != want:
            raise ValueError(f"Megatron tensor {key!r} (for {name!r}) has shape {list(view.shape(key))}, expected "
                             f"{list(want)}")
        stacked = view.layers_stored(key)
        if stacked is not None and stacked != config.num_layers:
            raise ValueError(f"the Megatron checkpoint stores its layers stacked, {stacked} of them "
                             f"({key.split('.', 3)[0]}.layers.*), the model has num_layers={config.num_layers}")
        box = local_box(shape, shards_of(tensor))
        plan.append((name, tensor, src, box, [(key, b) for b in _requests(src, key, shape, box, config)]))
        for k in present:   # an export holds both specs' names of a norm
            used.update(view.stored(k))
    if missing:
        raise ValueError(f"{len(missing)} tensors missing in the Megatron checkpoint {path}: {', '.join(missing)}")
    if strict and model.embed_tokens is not None and model.output_head is not None \
            and len(model.layers) == config.num_layers:
        unknown = [k for k in reader.tensors if k not in used and not is_transient(k)
                   and not (config.tie_word_embeddings and k == "output_layer.weight")]
        if unknown:
            raise ValueError(f"{len(unknown)} Megatron tensors match no moefold parameter: {', '.join(unknown)} "
                             "(another architecture than the model's?)")
    values = view.read([r for *_, reqs in plan for r in reqs])
    i = 0
    for name, tensor, src, box, reqs in plan:
        part = _assemble(src, values[i:i + len(reqs)], box, config)
        i += len(reqs)
        if tuple(part.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: read a slice of shape {list(part.shape)}, the local tensor is "
                             f"{list(tensor.shape)}")
        tensor.copy_(part.to(tensor.dtype))


def megatron_config(path: str | os.PathLike, name: str | None = None) -> ModelConfig:
    """The ``ModelConfig`` of a Megatron checkpoint from its ``args`` (ValueError when it stores none)."""
    ckpt = find_megatron_checkpoint(path)
    args = megatron_args(ckpt)
    if args is None:
        raise ValueError(f"{ckpt}: no Megatron-LM args in {COMMON}; give the model (--recipe NAME and model flags)")
    reader = DcpReader(ckpt)
    vocab = reader.shape("embedding.word_embeddings.weight")[0]
    return config_from_megatron(args, vocab, name or Path(path).resolve().name)


def import_megatron(path: str | os.PathLike, dims: ParallelDims | None = None, options: ModelOptions | None = None,
                    config: ModelConfig | None = None) -> MoEDecoder:
    """Build the checkpoint's model over ``dims`` (``config``: when the checkpoint stores no args) and load it."""
    model = MoEDecoder(config or megatron_config(path), dims, options)
    load_megatron_weights(model, path)
    return model


# ------------------------------------------------------------------------------------------------ export
def _to_megatron(name: str, full: Tensor, config: ModelConfig, out: dict[str, Tensor]) -> None:
    src = source(name, config)
    key = src.keys[0]
    if src.kind == "plain":
        out[key] = full
        if name.endswith("post_attention_layernorm.weight"):   # both specs' names: local and TE layer specs load it
            for alt in src.keys[1:]:
                out[alt] = full
        return
    if src.kind == "half":
        shape = (2 * full.shape[0], *full.shape[1:])
        buf = out.setdefault(key, torch.empty(shape, dtype=full.dtype))
        buf[src.part * full.shape[0]:(src.part + 1) * full.shape[0]] = full
        return
    if src.kind == "qkv":
        rows = (config.num_attention_heads + 2 * config.kv_heads) * config.attention_head_dim
        buf = out.setdefault(key, torch.empty((rows, *full.shape[1:]), dtype=full.dtype))
        buf[torch.tensor(qkv_rows(src.part, config))] = full
        return
    E, _, F, *rest = full.shape
    out[key] = full.reshape(E, 2 * F, *rest)


_LINEAR = re.compile(r"\.(linear_qkv|linear_proj|linear_fc1|linear_fc2|eh_proj)\.weight$")


def _extra_states(tensors: dict[str, Tensor], config: ModelConfig) -> dict[str, list]:
    """The ``_extra_state`` objects a Megatron-Core model of the local layer spec saves (and its load requires):
    ``[None]`` per linear layer, one per expert (``shard_e_E``) for the experts' (SequentialMLP's fake ones)."""
    out = {}
    for key in tensors:
        if not _LINEAR.search(key):
            continue
        base = key[: -len(".weight")] + "._extra_state"
        shards = [(e, config.num_experts) for e in range(config.num_experts)] if ".experts.experts." in key \
            else [(0, 1)]
        for e, n in shards:
            out[f"{base}/shard_{e}_{n}"] = [None]
    return out


def export_megatron(model: MoEDecoder, out_dir: str | os.PathLike, writer_rank: int = 0,
                    iteration: int | None = None) -> Path:
    """Write ``model`` as a Megatron-LM checkpoint: ``OUT/latest_checkpointed_iteration.txt`` and ``OUT/release/``
    (or ``iter_NNNNNNN``) holding the torch_dist tensors, ``metadata.json`` and ``common.pt`` with the
    architecture args. Megatron-LM loads it with ``--load OUT`` (``release``: model only, iteration 0).
    Collective over the parameters' shard groups (every rank calls)."""
    if model.dims.pp > 1:
        raise ValueError(f"export_megatron gathers within one pipeline stage; the model has pp={model.dims.pp}")
    config = model.config
    args = megatron_args_from_config(config)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors: dict[str, Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        full = gather_full(tensor, shards_of(tensor))
        if rank == writer_rank:
            _to_megatron(name, full.detach().to("cpu"), config, tensors)
    out = Path(out_dir)
    sub = out / ("release" if iteration is None else f"iter_{iteration:07d}")
    if rank == writer_rank:
        tmp = sub.with_name(f".{sub.name}.tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        write_dcp({**tensors, **_extra_states(tensors, config)}, tmp)
        (tmp / "metadata.json").write_text(json.dumps(FORMAT))
        torch.save({"args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": iteration or 0,
                    "content_metadata": CONTENT_METADATA}, tmp / COMMON)
        if sub.exists():
            raise ValueError(f"{sub} exists; export into an empty directory")
        os.replace(tmp, sub)
        (out / TRACKER).write_text("release" if iteration is None else str(iteration))
    if dist.is_initialized():
        dist.barrier()
    return sub

