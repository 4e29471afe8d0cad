"""From the modules' tensors to a rank's activation peak: blocks, chunks, and the schedule's in-flight micro-batches.

A pipeline chunk (the whole model at pp = 1) is a sequence of parts: the embedding (first chunk), one part per
transformer block (or per full-recompute group of blocks), the final norm + output head + loss and the MTP depths
(last chunk). A chunk's memory profile for one micro-batch (``ChunkProfile``):

    kept        bytes its forward leaves for its backward (its parts' ``saved``, the executor's received and sent)
    fwd_peak    the most its forward holds at once: max over parts of (kept so far + the part's transient)
    bwd_peak    the most its backward holds at once: max over parts, in reverse, of (what is still kept up to
                that part + its backward transient)

A rank's peak over a step walks its schedule's action list (``pipeline.schedules``): before each forward or
backward it holds the ``kept`` bytes of every (micro-batch, chunk) whose forward ran and whose backward has not,
so the peak is ``max(held + fwd_peak, held_others + bwd_peak)`` over the actions, with each chunk's own bytes
(the first chunk holds the embedding, the last the head and its fp32 logits). That walk (``planner.schedule_walk``)
is ``exact`` mode; the search's default takes the held pairs from the schedules' warm-up counts in closed form
(``planner.inflight``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from moefold.execution.recompute import full_recompute_groups
from moefold.models.layer_factory import is_moe_block
from moefold.parallel.dims import ParallelSizes
from moefold.planner.activations import NOT_OFFLOADED, ActivationMemory, ActivationShape, Part, activation_shape
from moefold.planner.activations_deltanet import deltanet_mixer
from moefold.planner.activations_dsa import dsa_attention
from moefold.planner.activations_ffn import mlp, moe
from moefold.planner.activations_mamba import block_kind, hybrid_block, representative
from moefold.planner.activations_v4 import v4_attention, v4_hyper, v4_streams
from moefold.planner.inflight import fb_matrix, held_states, most_held, peak_bytes
from moefold.planner.schedule_walk import _events, schedule_peak, steady_schedule
from moefold.planner.static import layout_of, per_split
from moefold.training.config import RunConfig


@lru_cache(maxsize=4096)
def block(shape: ActivationShape, index: int, dispatcher: str) -> tuple[Part, ...]:
    """Transformer block ``index`` (``>= num_layers``: an MTP block) under ``shape``'s selective recompute, as two
    parts in forward order: input norm + attention, then post-attention norm + FFN (with the norm output the FFN
    keeps directly). Its backward frees the FFN's part before the attention's."""
    m, a, Tx, H = shape.model, shape.a, shape.T_x, shape.model.hidden_size
    if m.hybrid.one_sublayer and index < m.num_layers:   # Nemotron-H: one norm, one sub-layer
        return (hybrid_block(shape, index, dispatcher),)
    is_moe = is_moe_block(m, index)
    discard = "layernorm" in shape.chosen

    def norm(name: str) -> dict[str, int]:
        # layernorm recompute keeps only the norm's input (the block's input, or the attention's residual sum)
        return {f"{name} input": a * Tx * H} if discard else shape.norm(Tx, H, name)

    # DeepSeek-V4: compressed attention, mHC streams (planner.activations_v4); DeepSeek sparse attention
    # (planner.activations_dsa); Gated DeltaNet (planner.activations_deltanet)
    attention = (v4_attention(shape, index) if m.v4 is not None else dsa_attention(shape) if m.dsa is not None else
                 deltanet_mixer(shape) if m.layer_type(index) == "linear_attention" else
                 shape.mla() if m.attention == "mla" else shape.gqa())
    ffn = moe(shape, dispatcher) if is_moe else mlp(shape, m.ffn_hidden_size)
    if is_moe:   # who keeps the post-attention norm's output itself (no all-gather in between)
        shared = bool(m.moe_shared_expert_ffn_size)
        kept_by_ffn = ("moe" in shape.chosen or shape.sp or shape.tp == 1   # the router's gating GEMM keeps it
                       or (shared and (not shape.sp or "shared_experts" in shape.chosen)))
    else:   # gate/up keep it (under SP the shard: parallel.sequence_input), or their FP8 copy instead
        kept_by_ffn = not shape.fp8 or "mlp" in shape.chosen
    first = norm("input_layernorm")
    first_offload = {} if discard else dict.fromkeys(first, ("attn_norm",))
    first.update({f"attention: {k}": v for k, v in attention.saved.items()})
    first_offload.update({f"attention: {k}": v for k, v in attention.offload.items()})
    second = norm("post_attention_layernorm")
    second_offload = {} if discard else dict.fromkeys(second, ("mlp_norm",))
    if kept_by_ffn and not discard:
        second["ffn input (norm output)"] = a * Tx * H
        if is_moe and shared and not shape.sp and "shared_experts" not in shape.chosen:   # the router keeps it too
            second_offload["ffn input (norm output)"] = ("shared_experts", NOT_OFFLOADED)
    second.update({f"{ffn.name}: {k}": v for k, v in ffn.saved.items()})
    second_offload.update({f"{ffn.name}: {k}": v for k, v in ffn.offload.items()})
    gradient = a * Tx * H   # the residual stream's gradient
    if m.v4 is not None:   # the mHC around each sub-layer; the residual is hc_mult streams wide
        first.update(v4_hyper(shape, "attn_hc"))
        second.update(v4_hyper(shape, "ffn_hc"))
        gradient *= m.v4.hc_mult
    kind = "moe layer" if is_moe else "dense layer"
    return (Part(kind, first, fwd_extra=attention.fwd_extra, bwd_extra=attention.bwd_extra + gradient,
                 offload=first_offload, layer=index),
            Part(kind, second, fwd_extra=ffn.fwd_extra, bwd_extra=ffn.bwd_extra + gradient, offload=second_offload,
                 layer=index))


def embedding(shape: ActivationShape) -> Part:
    """``VocabParallelEmbedding``: the token ids (its output is the first block's input). Its backward makes a
    dense ``[V/tp, H]`` weight gradient."""
    m = shape.model
    return Part("embedding", {"input ids": 9 * shape.T_c},
                bwd_extra=shape.a * (m.vocab_size // shape.tp * m.hidden_size + shape.T_c * m.hidden_size))


def head(shape: ActivationShape, name: str = "head") -> Part:
    """Final norm, output head and vocab-parallel cross-entropy (``dense.cross_entropy``): the head's input and
    what the loss keeps for its backward. fp32 logits: their softmax ``[T_c, V/tp]`` (forward: the logits). bf16
    logits: the logits themselves plus the fp32 max and sum of exponentials per token, the softmax recomputed in
    backward (forward and backward: one fp32 copy of the logits, shifted, exponentiated and divided in place)."""
    m, a, T, Tx, H = shape.model, shape.a, shape.T_c, shape.T_x, shape.model.hidden_size
    V = m.vocab_size // shape.tp
    saved = shape.norm(Tx, H, "final norm")
    saved["head input"] = a * Tx * H   # under SP the shard, gathered again in backward (parallel.sequence_input)
    saved["labels, mask"] = 17 * T
    if a == 4:
        saved["softmax (fp32)"] = 4 * T * V
        return Part(name, saved, fwd_extra=a * T * V,
                    bwd_extra=max(4 * T * V,                                         # the softmax's gradient
                                  shape.gemm_backward(T, H, V, V * H) - 4 * T * V))  # the head's GEMMs (softmax freed)
    saved["logits"] = a * T * V
    saved["max, sum of exponentials (fp32)"] = 8 * T
    backward = max(4 * T * V + a * T * V,                         # the recomputed softmax, its gradient in bf16
                   shape.gemm_backward(T, H, V, V * H) - a * T * V)  # the head's GEMMs (the logits freed)
    return Part(name, saved, fwd_extra=4 * T * V, bwd_extra=backward)


def mtp(shape: ActivationShape, depth: int, dispatcher: str) -> list[Part]:
    """One MTP depth, in forward order: its embedding, the two norms and their concatenation; its block; its head
    and loss (freed first in the backward)."""
    m, a, Tx, H = shape.model, shape.a, shape.T_x, shape.model.hidden_size
    name = f"mtp {depth + 1}"
    saved = {"ids": 9 * shape.T_c}
    saved.update(shape.norm(Tx, H, "enorm"))
    saved.update(shape.norm(Tx, H, "hnorm"))
    saved["eh_proj input"] = 2 * a * Tx * H
    index = m.num_layers + depth
    if shape.options.recompute == "full":    # MTP blocks checkpoint themselves: their input only
        body = [dataclasses.replace(recomputed_group(block(_none(shape), index, dispatcher), "mtp block input",
                                                     a * Tx * H), name=name)]
    else:
        body = [dataclasses.replace(p, name=name) for p in block(shape, index, dispatcher)]
    return [Part(name, saved), *body, head(shape, name)]


def recomputed_group(inner: list[Part], name: str, held: int) -> Part:
    """A checkpointed run of parts that keeps only its input (``held`` bytes): its forward frees each part's
    tensors as it goes; its backward first recomputes them all, then frees them part by part in reverse."""
    kept = peak = 0
    for p in inner:
        kept += p.saved_bytes
        peak = max(peak, kept + p.bwd_extra)
    kind = "moe layer" if any(p.name == "moe layer" for p in inner) else inner[0].name
    return Part(kind, {name: held}, fwd_extra=max(p.saved_bytes + p.fwd_extra for p in inner), bwd_extra=peak)


@lru_cache(maxsize=1024)
def _none(shape: ActivationShape) -> ActivationShape:   # the same shape without recompute
    return dataclasses.replace(shape, options=dataclasses.replace(shape.options, recompute="none"))


@dataclass(frozen=True)
class ChunkProfile:
    """One micro-batch through one chunk (see the module docstring); ``parts`` in forward order."""
    parts: tuple[Part, ...]
    kept: int
    fwd_peak: int
    bwd_peak: int
    received: bool = False
    sent: bool = False
    offloaded: int = 0     # host bytes its forward leaves (activation offloading)

    @property
    def peak(self) -> int:   # of its forward or its backward
        return max(self.fwd_peak, self.bwd_peak)

    @cached_property
    def units(self) -> tuple[tuple[int, int, int, int], ...]:
        """The chunk as the batch-level overlap runs it (``pipeline.overlap``): per block (a part without a block:
        on its own), in forward order, (kept bytes, forward transient, backward transient, token exchanges): an MoE
        block's FFN is a dispatch and a combine (``models.sublayers``), each a turn of the other micro-batch."""
        out: list[list[int]] = []
        layer = None
        for p in self.parts:
            moe = any(k.startswith("moe: ") for k in p.saved) or (p.layer is None and p.name == "moe layer")
            # blocks of one kind share their representative's index: an MoE block ends with its exchanges
            if p.layer is None or p.layer != layer or not out or out[-1][3]:
                out.append([0, 0, 0, 0])
            unit = out[-1]
            unit[1] = max(unit[1], unit[0] + p.saved_bytes + p.fwd_extra)
            unit[0] += p.saved_bytes
            unit[2] = max(unit[2], unit[0] + p.bwd_extra)
            unit[3] = 2 if moe else unit[3]
            layer = p.layer
        return tuple((k, f - k, b - k, x) for k, f, b, x in out)

    @cached_property
    def by_kind(self) -> dict[str, int]:   # kept bytes per part kind (dense, moe layer, embedding, head, mtp, ...)
        out: dict[str, int] = {}
        for p in self.parts:
            kind = "mtp" if p.name.startswith("mtp") else p.name
            out[kind] = out.get(kind, 0) + p.saved_bytes
        return out


def chunk_parts(shape: ActivationShape, layers: list[int], first: bool, last: bool, dispatcher: str,
                received: bool, sent: bool) -> list[Part]:
    """The parts of a chunk holding ``layers``, the embedding (``first``) and the head and MTP (``last``).
    ``received``/``sent``: its input comes from / its output goes to another pipeline stage."""
    a, Tx, H = shape.a, shape.T_x, shape.model.hidden_size
    H *= v4_streams(shape.model)   # DeepSeek-V4 hands its n_hc residual streams from stage to stage
    parts = [embedding(shape)] if first else []
    if received:   # the executor holds the received activation for the backward; the first block's input norm
        # keeps that same tensor (dense.norm keeps its input; layernorm recompute keeps it too)
        groups = full_recompute_groups(layers, shape.options)
        norm_keeps_it = bool(groups) and not groups[0][1]
        parts.append(Part("pipeline", {"received activation": 0 if norm_keeps_it else a * Tx * H}))
    for g, (group, checkpointed) in enumerate(full_recompute_groups(layers, shape.options)):
        if not checkpointed:
            blocks = [p for i in group for p in block(shape, i, dispatcher)]
            if received and g == 0 and blocks:   # the first norm's input is the executor's received tensor
                offload = {k: v for k, v in blocks[0].offload.items() if k != "input_layernorm input"}
                blocks[0] = dataclasses.replace(blocks[0], offload=offload)
            parts += blocks
            continue
        inner = [p for i in group for p in block(_none(shape), i, dispatcher)]
        held = 0 if received and g == 0 else a * Tx * H
        parts.append(recomputed_group(inner, f"layer group {g} input", held))
    with_head, with_mtp = last if isinstance(last, tuple) else (last, last)
    if with_head:
        parts.append(head(shape))
    if with_mtp:
        parts += [p for k in range(shape.model.mtp_num_layers) for p in mtp(shape, k, dispatcher)]
    if sent:       # the executor holds the chunk's output until its backward
        parts.append(Part("pipeline", {"sent activation": a * Tx * H}))
    return parts


@lru_cache(maxsize=4096)
def chunk_profile(shape: ActivationShape, kinds: tuple[bool | str, ...], first: bool, last: bool, dispatcher: str,
                  received: bool, sent: bool) -> ChunkProfile:
    """``profile`` of a chunk whose layers are MoE or dense (or a one-sublayer stack's layer types) as ``kinds``
    says (``activations_mamba.block_kind``): a block's tensors depend only on its kind, so chunks of equal kinds
    (any stage, any layout with the same shape) share one profile."""
    layers = [_representative(shape.model, k) for k in kinds]
    parts = chunk_parts(shape, layers, first, last, dispatcher, received, sent)
    return profile(parts, received, sent, frozenset(shape.options.offload_modules))


_REPRESENTATIVES: dict[tuple, tuple] = {}


def _representative(model, kind: bool | str) -> int:
    """``activations_mamba.representative``, once per model object and kind."""
    entry = _REPRESENTATIVES.get((id(model), kind))
    if entry is None or entry[0] is not model:
        if len(_REPRESENTATIVES) > 4096:
            _REPRESENTATIVES.clear()
        entry = _REPRESENTATIVES[(id(model), kind)] = (model, representative(model, kind))
    return entry[1]


def profile(parts: list[Part], received: bool = False, sent: bool = False,
            offload: frozenset[str] = frozenset()) -> ChunkProfile:
    """``ChunkProfile`` of parts in forward order (``received``/``sent``: as for ``chunk_parts``); ``offload``:
    the offloaded modules (``dense.activation_offload``). An offloaded tensor stays on the device until its part's
    forward ends and comes back, in backward, with the rest of its layer's and the next layer's (the prefetch);
    ``offloaded``: the host bytes one micro-batch leaves."""
    kept = fwd = host = 0
    prefix, off = [], []
    for p in parts:
        o = p.offloaded_bytes(offload) if offload else 0
        fwd = max(fwd, kept + p.saved_bytes + p.fwd_extra)
        kept += p.saved_bytes - o
        host += p.host_bytes(offload) if offload else 0
        prefix.append(kept)
        off.append(o)
    # each block is two consecutive parts (``block``): its position in the chunk, for the prefetch window
    blocks = [n for n, p in enumerate(parts) if p.layer is not None]
    position = {n: k // 2 for k, n in enumerate(blocks)}
    bwd = 0
    for i, p in enumerate(parts):
        back = 0
        if i in position and any(off):
            here = position[i]
            back = sum(off[j] for j in blocks if j <= i and here - 1 <= position[j] <= here)
        bwd = max(bwd, prefix[i] + back + p.bwd_extra)
    return ChunkProfile(tuple(parts), kept, fwd, max(bwd, kept), received, sent, offloaded=host)


def activation_memory(config: RunConfig, sizes: ParallelSizes, pp_rank: int, num_micro: int,
                      device_type: str = "cuda", exact: bool = True) -> ActivationMemory:
    """Peak activation bytes of ``pp_rank`` (any rank of that stage) running ``num_micro`` micro-batches per step
    with the schedule ``moefold train`` builds for ``config``, whatever shards the static memory. ``exact``: the
    schedule's action lists walked (``schedule_peak``); else the in-flight counts of ``planner.inflight``."""
    return activation_memories(config, sizes, num_micro, device_type, exact)[pp_rank]


def activation_memories(config: RunConfig, sizes: ParallelSizes, num_micro: int, device_type: str = "cuda",
                        exact: bool = True) -> tuple[ActivationMemory, ...]:
    """``activation_memory`` of every pipeline rank, in order (once per layout, whatever shards the static memory:
    the search asks for it per rung and sharding of every layout)."""
    key = (_activations_key(config), sizes, num_micro, device_type, exact)
    if key not in _ACTIVATIONS:
        if len(_ACTIVATIONS) > MAX_LAYOUTS:
            _ACTIVATIONS.clear()
        t = config.train
        if t.use_torch_fsdp2 or t.optimizer_cpu_offload or t.optimizer_offload_fraction != 1.0:
            config = dataclasses.replace(config, train=dataclasses.replace(
                t, use_torch_fsdp2=False, optimizer_cpu_offload=False, optimizer_offload_fraction=1.0))
        _ACTIVATIONS[key] = _activation_memories(config, sizes, num_micro, device_type, exact)
    return _ACTIVATIONS[key]


_SHAPES: dict[tuple, tuple[ActivationShape, dict]] = {}
_BLOCK_KINDS: dict[int, tuple] = {}
_TRAIN_KEY: list = [None, None]   # (the train config last keyed, its key)


def _block_kinds(model) -> tuple[bool | str, ...]:
    """``activations_mamba.block_kind`` of each decoder layer (MoE or dense, or a one-sublayer stack's layer
    type), once per model object."""
    entry = _BLOCK_KINDS.get(id(model))
    if entry is None or entry[0] is not model:
        entry = _BLOCK_KINDS[id(model)] = (model, tuple(block_kind(model, i) for i in range(model.num_layers)))
    return entry[1]


SAVER_FIELDS = frozenset({"use_torch_fsdp2", "optimizer_cpu_offload", "optimizer_offload_fraction"})
MAX_LAYOUTS = 1 << 14
_ACTIVATIONS: dict[tuple, tuple[ActivationMemory, ...]] = {}


def _activations_key(config: RunConfig) -> tuple:
    """``config`` less what shards or moves the static memory (``SAVER_FIELDS``), as a key: hashing these tuples of
    the sections' fields is cheaper than making a config without the savers."""
    t = config.train
    if _TRAIN_KEY[0] is not t:   # a layout's rungs share one train object
        _TRAIN_KEY[:] = [t, tuple(tuple(v for k, v in vars(section).items() if k not in SAVER_FIELDS)
                                  if dataclasses.is_dataclass(section) else section for section in vars(t).values())]
    return config.model, config.options, _TRAIN_KEY[1]


_SPLITS: dict[tuple, tuple] = {}


def _split_chunks(config: RunConfig, pp: int) -> tuple[tuple, str, int]:
    """(per pipeline rank, its chunks as (the block kinds of their layers, first?, (head?, MTP?), received?, sent?);
    the schedule's name; vpp), once per model and pipeline split (the search plans each split with many sizes and
    every rung and saver)."""
    return per_split(_SPLITS_BY_TRAIN, config, pp, lambda: _split_chunks_by_flags(config, pp))


_SPLITS_BY_TRAIN: dict[tuple, tuple] = {}


def _split_chunks_by_flags(config: RunConfig, pp: int) -> tuple[tuple, str, int]:
    m, t = config.model, config.train
    key = (id(m), pp, t.pipeline_schedule, t.pipeline_model_parallel_layout, t.num_layers_per_virtual_pipeline_stage,
           t.decoder_first_pipeline_num_layers, t.decoder_last_pipeline_num_layers)
    entry = _SPLITS.get(key)
    if entry is None or entry[0] is not m:   # (the model kept with its entry: its id is not reused meanwhile)
        if len(_SPLITS) > MAX_LAYOUTS:
            _SPLITS.clear()
        kinds = _block_kinds(m)
        if pp == 1:
            split = (((kinds, True, (True, True), False, False),),)
            name, vpp = "1f1b", 1
        else:
            layout = layout_of(config, pp)
            last = layout.num_model_chunks - 1
            split = tuple(tuple((tuple(kinds[i] for i in c.layers), c.has_embedding, (c.has_head, c.has_mtp),
                                 c.model_chunk > 0, c.model_chunk < last) for c in layout.rank_chunks(r))
                          for r in range(pp))
            name, vpp = config.schedule_name(layout.vpp), layout.vpp
        entry = _SPLITS[key] = (m, (split, name, vpp))
    return entry[1]


def _activation_memories(config: RunConfig, sizes: ParallelSizes, num_micro: int, device_type: str,
                         exact: bool) -> tuple[ActivationMemory, ...]:
    from moefold.planner.step_bound import compute_token

    # the shape reads tp, cp, ep and etp, not the pipeline (``activations.activation_shape``; the options it makes
    # read the flags' tp and cp, ``training.build.model_options``): one per search's options and those sizes, whatever
    # pp and dp are (chunks alike in layouts of different pp share their profiles)
    shape_key = (compute_token(config), config.parallel.tp, config.parallel.cp, sizes.tp, sizes.cp, sizes.ep,
                 sizes.etp, device_type)
    if shape_key not in _SHAPES:
        if len(_SHAPES) > MAX_LAYOUTS:
            _SHAPES.clear()
        shape = activation_shape(config, sizes, device_type)
        _SHAPES[shape_key] = (shape, {})
    shape, profile_of = _SHAPES[shape_key]   # profile_of: chunk_profile's, keyed without the shape
    dispatcher = config.options.resolved_dispatcher(sizes.ep, sizes.etp)
    m = config.model
    overlap = config.train.overlap_moe_expert_parallel_comm
    message = shape.a * shape.T_x * m.hidden_size * v4_streams(m)
    split, name, vpp = _split_chunks(config, sizes.pp)
    out = []
    for pp_rank in range(sizes.pp):
        if sizes.pp == 1:
            # with the overlap two micro-batches are in flight (F0, FB(1, 0), ...)
            schedule = ("1f1b", 1, num_micro, 1, True) if overlap else None
        else:
            schedule = (name, sizes.pp, num_micro, vpp, overlap)
        profiles = []
        for kinds, first, last_chunk, received, sent in split[pp_rank]:
            key = (kinds, first, last_chunk, dispatcher, received, sent)
            if key not in profile_of:
                profile_of[key] = chunk_profile(shape, *key)
            profiles.append(profile_of[key])
        host = max((p.offloaded for p in profiles), default=0)
        if not exact:
            name, pp, micro, vpp, overlapped = schedule or ("1f1b", 1, num_micro, 1, False)
            states = held_states(name, pp, vpp, micro, pp_rank)
            fb = fb_matrix(profiles) if overlapped else None
            peak = peak_bytes(states, [p.kept for p in profiles], [p.peak for p in profiles], message, pp > 1, fb)
            in_flight = most_held(states) + int(overlapped)   # an FB step's two pairs, each in part
            host = max(sum(n * p.offloaded for n, p in zip(state, profiles)) for state in states) if host else 0
        else:
            peak, in_flight = schedule_peak(schedule, profiles, pp_rank, message)
        if exact and schedule is not None and host:   # the offloaded bytes of the pairs held, and the running one's
            live = _events(steady_schedule(schedule, pp_rank), pp_rank)[0]
            host = int((live @ np.array([p.offloaded for p in profiles], dtype=np.float64)).max()) + host
        by_kind: dict[str, int] = {}
        for p in profiles:
            for kind, n in p.by_kind.items():
                by_kind[kind] = by_kind.get(kind, 0) + n
        out.append(ActivationMemory(peak=peak, in_flight=in_flight, per_microbatch=tuple(p.kept for p in profiles),
                                    by_kind=by_kind, host=host))
    return tuple(out)
