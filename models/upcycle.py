"""Upcycling: a dense model becomes a mixture of experts that computes exactly what it computed.

    moe_config = upcycled_config(dense_config, num_experts=8, topk=2)                 # every expert = the MLP
    moe_config = upcycled_config(dense_config, num_experts=16, topk=4, moe_ffn_hidden_size=F // 2)  # granular
    model = MoEDecoder(moe_config, dims, options); model.init_weights(seed)
    load_upcycled_weights(model, "dense_hf_dir")   # each rank reads only its slices (HF or moefold naming)

Megatron-Core's ``--moe-use-upcycling`` (``upcycling_utils.py``, arXiv 2410.07524), made exact for SwiGLU:
the dense FFN of size F is cut into ``g = F / moe_ffn_hidden_size`` slices along F (``g = 1``: every
expert is a copy of the MLP); expert ``e`` is slice ``s = e % g`` with its ``down_proj`` scaled by ``g``
(scaling the gate or up projection instead would not commute with SiLU). The router keeps its small,
layout-independent initialisation, except that with ``g > 1`` the experts ``j*g .. j*g+g-1`` share
router row ``j`` (Megatron's replication), so a token selects whole copies ``j`` of the MLP (``topk`` a
multiple of ``g``), each of its ``g`` experts with the same probability ``q_j``. With renormalised top-k
probabilities (``sum_j g * q_j = 1``: the upcycled config sets ``moe_norm_topk_prob``; Mixtral's softmax
over the top k is normalised by definition) the output is
``sum_j q_j * sum_s g * slice_s(x) = sum_j g * q_j * dense(x) = dense(x)``: at step 0 the MoE model's
logits equal the dense model's. (Dropless routing: a capacity factor that drops tokens, a top-k scaling
factor or shared experts would break this, so the upcycled config sets none.)

Everything that is not an expert (embedding, attention, norms, dense layers kept by ``moe_layer_freq``,
head) is read unchanged.
"""

from __future__ import annotations

import os
import re

import torch
from torch import Tensor

from moefold.models.config import ModelConfig
from moefold.models.decoder import MoEDecoder
from moefold.models.hf.importer import local_box, read_plain
from moefold.models.hf.mapping import hf_names
from moefold.models.tensor_io import DictReader, TensorReader
from moefold.parallel.sharding import full_shape, shards_of

# fields an upcycled model may change; every other architecture field must equal the dense model's
MOE_FIELDS = ("name", "num_experts", "moe_ffn_hidden_size", "moe_topk", "moe_layer_freq", "first_k_dense_replace",
              "extra")


def granularity(dense: ModelConfig, moe: ModelConfig) -> int:
    """How many expert slices make one copy of the dense FFN."""
    return dense.ffn_hidden_size // moe.moe_ffn_hidden_size


def upcycled_config(dense: ModelConfig, num_experts: int, topk: int, moe_ffn_hidden_size: int | None = None,
                    moe_layer_freq: int | tuple[int, ...] = 1) -> ModelConfig:
    """The MoE model of ``dense``'s family that ``load_upcycled_weights`` fills so that it equals ``dense``.

    ``moe_ffn_hidden_size``: expert size (default: the dense FFN size; a divisor of it for granular
    upcycling). ``moe_layer_freq``: which layers become MoE (Megatron's int or 0/1 pattern; default all).
    """
    if dense.num_experts:
        raise ValueError(f"upcycling starts from a dense model, but {dense.name} already has "
                         f"num_experts={dense.num_experts}")
    F = dense.ffn_hidden_size
    expert_ffn = moe_ffn_hidden_size or F
    if expert_ffn < 1 or F % expert_ffn:
        raise ValueError(f"--moe-ffn-hidden-size={expert_ffn} must divide the dense ffn_hidden_size={F} "
                         "(granular upcycling cuts the dense MLP into equal slices)")
    g = F // expert_ffn
    if num_experts < 1 or num_experts % g:
        raise ValueError(f"--num-experts={num_experts} must be a positive multiple of the granularity "
                         f"ffn_hidden_size / moe_ffn_hidden_size = {F} / {expert_ffn} = {g}")
    if topk < 1 or topk % g or topk > num_experts:
        raise ValueError(f"--moe-router-topk={topk} must be a multiple of the granularity {g} (a token must "
                         f"select whole copies of the dense MLP) and at most --num-experts={num_experts}")
    if dense.moe_score_function == "sigmoid" and topk == 1:
        raise ValueError("sigmoid routing with --moe-router-topk=1 is not renormalised: the upcycled model would "
                         "scale the dense MLP by its router probability; use topk >= 2")
    return dense.with_(name=f"{dense.name}-upcycled-{num_experts}e-top{topk}", num_experts=num_experts,
                       moe_ffn_hidden_size=expert_ffn, moe_topk=topk, moe_layer_freq=moe_layer_freq,
                       first_k_dense_replace=0, moe_norm_topk_prob=True, moe_topk_scaling_factor=1.0,
                       moe_num_groups=None, moe_group_topk=None, moe_group_score_topk=None,
                       moe_shared_expert_ffn_size=0, moe_expert_capacity_factor=None)


def check_upcyclable(dense: ModelConfig, moe: ModelConfig) -> None:
    """Raise naming the fields when ``moe`` is not an upcycling of ``dense`` (same model apart from experts)."""
    if dense.num_experts:
        raise ValueError(f"upcycling starts from a dense model, but {dense.name} has num_experts={dense.num_experts}")
    if not moe.num_experts:
        raise ValueError(f"{moe.name} has no experts to upcycle into")
    skip = set(MOE_FIELDS) | {name for name in ModelConfig.FLAT_NAMES if name.startswith("moe_")}
    dense_values, moe_values = dense.flat_dict(), moe.flat_dict()   # every section's value by its flat name
    diff = {name: (dense_values[name], moe_values[name]) for name in ModelConfig.FLAT_NAMES
            if name not in skip and dense_values[name] != moe_values[name]}
    if diff:
        raise ValueError(f"{moe.name} is not an upcycling of {dense.name}: (dense, moe) differ in {diff}")
    if dense.ffn_hidden_size % moe.moe_ffn_hidden_size:
        raise ValueError(f"moe_ffn_hidden_size={moe.moe_ffn_hidden_size} does not divide the dense "
                         f"ffn_hidden_size={dense.ffn_hidden_size}")


class _DenseTensors:
    """The dense model's full tensors by moefold name, read a box at a time (HF or moefold naming)."""

    def __init__(self, reader: TensorReader | DictReader, config: ModelConfig, hf: bool) -> None:
        self.reader, self.config, self.hf = reader, config, hf

    def read(self, name: str, shape: tuple[int, ...], box: tuple[slice, ...]) -> Tensor:
        candidates = hf_names(name, self.config) if self.hf else [name]
        return read_plain(self.reader, name, candidates, shape, box)[0]


_EXPERTS = re.compile(r"(.*)\.mlp\.experts\.(w13|w2)$")
_ROUTER = re.compile(r".*\.mlp\.router\.(weight|expert_bias)$")


@torch.no_grad()
def upcycle_weights(model: MoEDecoder, dense: _DenseTensors) -> None:
    """Fill ``model`` (initialised; any layout, any pipeline stage) from the dense tensors. No communication."""
    config = model.config
    check_upcyclable(dense.config, config)
    g = granularity(dense.config, config)
    F, Fe, H = dense.config.ffn_hidden_size, config.moe_ffn_hidden_size, config.hidden_size
    for name, tensor in model.state_dict(keep_vars=True).items():
        shape = full_shape(tensor)
        box = local_box(shape, shards_of(tensor))
        if _ROUTER.fullmatch(name):
            if name.endswith("weight") and g > 1:   # copies j*g .. j*g+g-1 of the MLP share router row j
                assert not shards_of(tensor), "the router weight is replicated on every rank"
                tensor.copy_(tensor[: config.num_experts // g].repeat_interleave(g, dim=0))
            continue
        m = _EXPERTS.fullmatch(name)
        if m is None:
            tensor.copy_(dense.read(name, shape, box).to(tensor.dtype))
            continue
        mlp, which = f"{m.group(1)}.mlp", m.group(2)
        experts, rows = range(box[0].start, box[0].stop), box[-2 if which == "w13" else -1]
        parts = []
        for e in experts:
            s = e % g   # expert e is slice s of the dense FFN
            f = slice(s * Fe + rows.start, s * Fe + rows.stop)
            if which == "w13":
                parts.append(torch.stack([dense.read(f"{mlp}.{p}.weight", (F, H), (f, box[3]))
                                          for p in ("gate_proj", "up_proj")]))
            else:
                parts.append(g * dense.read(f"{mlp}.down_proj.weight", (H, F), (box[1], f)))
        tensor.copy_(torch.stack(parts).to(tensor.dtype))


def load_upcycled_weights(model: MoEDecoder, path: str | os.PathLike) -> None:
    """Upcycle the dense checkpoint directory ``path`` (HF or moefold) into ``model``; each rank reads its slices."""
    from moefold.models.pretrained import open_pretrained

    with open_pretrained(path) as (config, reader, hf):
        upcycle_weights(model, _DenseTensors(reader, config, hf))


def upcycle_model(dense_model: MoEDecoder, model: MoEDecoder) -> None:
    """Upcycle an in-memory world-1 dense model (e.g. loaded from a training checkpoint) into ``model``."""
    tensors = {k: v.detach() for k, v in dense_model.state_dict().items()}
    upcycle_weights(model, _DenseTensors(DictReader(tensors), dense_model.config, hf=False))
