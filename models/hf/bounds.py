"""A config is checked against the weights beside it before anything is allocated.

An HF ``config.json`` (or ``moefold_config.json``) says how big the model is; the safetensors headers say how
big it really is (each tensor's shape, read without its data). ``--load-hf``, ``convert`` and ``generate`` build
the model the config describes and then read the tensors into it, so a config that declares 10^7 experts or a
hidden size of 10^9 allocated until the OOM killer came (or failed with a raw allocator error). Here the number
of elements the config implies (its model's state dict, built on the meta device: no memory) must equal the
number the headers hold (rotary caches and DeepSeek's per-MTP copies of the embedding and head aside, which no
one reads). A config implying more than ``SLACK`` times what the files hold is refused here, before any
allocation, in one line naming the config field that disagrees with the tensors (the layer count, the expert
count, a width) or giving both counts; a smaller mismatch (a model that fits in memory) goes on to the
tensor-by-tensor read, which names the missing or misshapen tensor exactly.

Building even on the meta device takes time per layer (about 5 ms: 10^6 layers ran past 300 s), so first a
lower bound of the elements is computed from the config's numbers alone (``floor_numel``: the embedding, two
norms per layer and each layer's smallest possible MLP), and a config whose floor already exceeds ``SLACK``
times the files is refused without building anything; only a config within reach of its files is built.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from moefold.models.config import ModelConfig
from moefold.models.hf.mapping import ignored_hf_names, is_ignorable

SLACK = 1.25   # a config may imply at most this many times the files' elements before the tensors are read


def implied_numel(config: ModelConfig) -> int:
    """Elements of the state dict (parameters and saved buffers) of the model ``config`` describes, world 1."""
    from moefold.models.decoder import MoEDecoder
    from moefold.parallel.dims import ParallelDims

    model = MoEDecoder(config, ParallelDims.single(), device="meta")
    return sum(t.numel() for t in model.state_dict().values())


def floor_numel(config: ModelConfig) -> int:
    """A lower bound of ``implied_numel(config)`` from the config's numbers alone (nothing built): the input
    embedding, two norms per layer and, per layer, the smaller of a dense MLP (up and down projections) and an
    MoE layer's routed experts (each an up and a down projection)."""
    h = config.hidden_size
    mlps = [2 * h * config.ffn_hidden_size] if config.ffn_hidden_size else []
    if config.num_experts:
        mlps.append(2 * h * config.moe_ffn_hidden_size * config.num_experts)
    # Nemotron-H's one-sublayer layers: one norm each, an MLP only in its FFN layers
    ffn_layers = sum(map(config.has_ffn, range(config.num_layers)))
    norms = 1 if config.hybrid.one_sublayer else 2
    return config.vocab_size * h + config.num_layers * norms * h + ffn_layers * min(mlps, default=0)


def held_numel(reader: Any, config: ModelConfig) -> int:
    """Elements of the tensors in ``reader``'s headers that a model of ``config`` reads."""
    skip = set(ignored_hf_names(config))
    return sum(math.prod(reader.shape(n)) for n in reader.names() if n not in skip and not is_ignorable(n, config))


def _fmt(n: int) -> str:
    return f"{n:,}" if n < 10**7 else f"{n:.3e}"


def _key_of(hf: dict[str, Any] | None, value: int, fallback: str) -> str:
    """The config.json key holding ``value`` (the field a reader edits), else ``fallback``."""
    for k, v in (hf or {}).items():
        if v == value and not isinstance(v, bool) and k not in ("torch_dtype",):
            return k
    return fallback


def _culprit(config: ModelConfig, reader: Any, hf: dict[str, Any] | None) -> str | None:
    """Which field disagrees with the tensors (their structure, from the names and shapes), if one can tell."""
    names = reader.names()
    layers = {int(m[1]) for n in names if (m := re.match(r"(?:model\.)?layers\.(\d+)\.", n))}
    held_layers = max(layers) + 1 if layers else 0
    if held_layers and held_layers != config.num_layers + config.mtp_num_layers:
        key = _key_of(hf, config.num_layers, "num_layers")
        return f"{key}={config.num_layers} but the safetensors hold {held_layers} layers"
    embed = next((n for n in names if n.endswith("embed_tokens.weight") and "layers." not in n), None)
    if embed is not None:
        vocab, hidden = reader.shape(embed)[:2]
        if hidden != config.hidden_size:
            key = _key_of(hf, config.hidden_size, "hidden_size")
            return f"{key}={config.hidden_size} but {embed} has shape {reader.shape(embed)}"
        if vocab != config.vocab_size:
            key = _key_of(hf, config.vocab_size, "vocab_size")
            return f"{key}={config.vocab_size} but {embed} has shape {reader.shape(embed)}"
    if config.num_experts:
        per_layer: dict[int, set[int]] = {}
        fused: dict[int, int] = {}
        for n in names:
            if m := re.match(r"(?:model\.)?layers\.(\d+)\..*experts\.(\d+)\.", n):
                per_layer.setdefault(int(m[1]), set()).add(int(m[2]))
            elif m := re.match(r"(?:model\.)?layers\.(\d+)\..*experts\.\w*(gate_up|w13|w1|gate)\w*$", n):
                fused[int(m[1])] = reader.shape(n)[0]
        counts = {i: len(e) for i, e in per_layer.items()} | fused
        for layer, held in sorted(counts.items()):
            if held != config.num_experts:
                key = _key_of(hf, config.num_experts, "num_experts")
                return f"{key}={config.num_experts} but layer {layer} of the safetensors holds {held} experts"
    return None


def check_weights_match_config(path: str | os.PathLike, config: ModelConfig, reader: Any,
                               hf_config: dict[str, Any] | None = None, config_file: str = "config.json") -> None:
    """ValueError (one line, naming the field where it can) when ``config`` implies more than ``SLACK`` times the
    elements ``reader`` holds (module docstring). Reads headers only; builds the model on the meta device."""
    held = held_numel(reader, config)
    floor = floor_numel(config)
    implied = floor if floor > SLACK * held else implied_numel(config)   # built only when within reach
    if implied <= SLACK * held:
        return   # equal, or a small mismatch that the tensor-by-tensor read names
    where = Path(path) / config_file
    culprit = _culprit(config, reader, hf_config)
    detail = f"{culprit}: " if culprit else ""
    size = f"at least {_fmt(implied)}" if implied == floor and floor > SLACK * held else _fmt(implied)
    raise ValueError(f"{where}: {detail}it describes a model of {size} parameters, but the safetensors "
                     f"headers hold {_fmt(held)}; refusing to allocate it (a config that does not belong to these "
                     "weights)")
