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
(the first chunk holds the embedding, the last the head and its fp32 logits). That walk is ``exact`` mode; the
search's default takes the held pairs from the schedules' warm-up counts in closed form (``planner.inflight``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from moefold.execution.recompute import full_recompute_groups
from moefold.models.layer_factory import is_moe_block
from moefold.parallel.dims import ParallelSizes
from moefold.pipeline.actions import ActionKind, is_local, model_chunk, split_batches
from moefold.pipeline.schedules import Schedule, build_schedule
from moefold.planner.activations import NOT_OFFLOADED, ActivationMemory, ActivationShape, Part, activation_shape
from moefold.planner.activations_dsa import dsa_attention
from moefold.planner.activations_ffn import mlp, moe
from moefold.planner.activations_mamba import block_kind, hybrid_block, representative
from moefold.planner.activations_v4 import v4_attention, v4_hyper, v4_streams
from moefold.planner.inflight import held_states, most_held, peak_bytes
from moefold.planner.static import layout_of
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
    # (planner.activations_dsa)
    attention = (v4_attention(shape, index) if m.v4 is not None else dsa_attention(shape) if m.dsa is not None else
                 shape.mla() if m.attention == "mla" else shape.gqa())
    ffn = moe(shape, dispatcher) if is_moe else mlp(shape, m.ffn_hidden_size)
    if is_moe:   # who keeps the post-attention norm's output itself (no all-gather in between)
        shared = bool(m.moe_shared_expert_ffn_size)
        kept_by_ffn = ("moe" in shape.chosen or (a == 4 and (shape.sp or shape.tp == 1))
                       or (shared and (not shape.sp or "shared_experts" in shape.chosen)))
    else:
        kept_by_ffn = not shape.sp or "mlp" in shape.chosen
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
    """Final norm, output head and vocab-parallel cross-entropy: the head's input and the fp32 softmax
    ``[T_c, V/tp]`` it keeps (``dense.cross_entropy``); forward: the logits and their fp32 copy (bf16)."""
    m, a, T, Tx, H = shape.model, shape.a, shape.T_c, shape.T_x, shape.model.hidden_size
    V = m.vocab_size // shape.tp
    saved = shape.norm(Tx, H, "final norm")
    saved["head input"] = a * T * H
    saved["softmax (fp32)"] = 4 * T * V
    saved["labels, mask"] = 17 * T
    upcast = 4 * T * V if a != 4 else 0
    forward = a * T * V + upcast
    backward = max(4 * T * V + (a * T * V if a != 4 else 0),               # the softmax's gradient
                   shape.gemm_backward(T, H, V, V * H) - 4 * T * V)       # the head's GEMMs (softmax freed)
    return Part(name, saved, fwd_extra=forward, bwd_extra=backward)


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
        # keeps that same tensor when it saves its input (an fp32 model, or layernorm recompute)
        groups = full_recompute_groups(layers, shape.options)
        norm_keeps_it = bool(groups) and not groups[0][1] and (a == 4 or "layernorm" in shape.chosen)
        parts.append(Part("pipeline", {"received activation": 0 if norm_keeps_it else a * Tx * H}))
    for g, (group, checkpointed) in enumerate(full_recompute_groups(layers, shape.options)):
        if not checkpointed:
            blocks = [p for i in group for p in block(shape, i, dispatcher)]
            if received and g == 0 and a == 4:   # the first norm's fp32 input is the executor's received tensor
                offload = {k: v for k, v in blocks[0].offload.items() if k != "input_layernorm fp32 input"}
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
    layers = [representative(shape.model, k) for k in kinds]
    parts = chunk_parts(shape, layers, first, last, dispatcher, received, sent)
    return profile(parts, received, sent, frozenset(shape.options.offload_modules))


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


def schedule_peak(schedule: tuple[str, int, int, int, bool] | None, profiles: list[ChunkProfile], pp_rank: int,
                  message: int = 0, steady: bool = True) -> tuple[int, int]:
    """(peak activation bytes, most (micro-batch, chunk) pairs held at once) of ``pp_rank`` over a step, walking
    its action list (``schedule``: (name, pp, micro-batches, vpp, overlap)); ``profiles[c]``: its chunk c;
    ``message``: bytes of one activation crossing stages; ``schedule`` None: pp = 1 without the overlap.
    ``steady``: a long step's states from a short one's (``steady_schedule``; False: the whole action list)."""
    if schedule is None:
        return profiles[0].peak, 1
    walked = steady_schedule(schedule, pp_rank) if steady else schedule
    live, messages, kinds, chunks, most = _events(walked, pp_rank)
    kept = np.array([p.kept for p in profiles], dtype=np.float64)
    transient = np.zeros(len(kinds))
    fwd, bwd = (kinds == 1) | (kinds == 4), kinds == 2
    transient[fwd] = np.array([p.fwd_peak for p in profiles], dtype=np.float64)[chunks[fwd]]
    transient[bwd] = np.array([p.bwd_peak for p in profiles], dtype=np.float64)[chunks[bwd]]
    return int((live @ kept + messages * float(message) + transient).max()), most

STEADY_PROBES = (6, 8)   # x pp micro-batches: the two short steps whose states stand for a long one's


@lru_cache(maxsize=4096)
def steady_schedule(schedule: tuple[str, int, int, int, bool], pp_rank: int) -> tuple[str, int, int, int, bool]:
    """The schedule whose action list ``_events`` walks for ``schedule`` on ``pp_rank``: past its warm-up a schedule
    repeats its steady state, so a long step (more than 2 x 8 pp micro-batches) holds the same states (held pairs
    per chunk, messages, the action and its chunk) as a short one. When the steps of 6 pp and 8 pp micro-batches
    reach the same set of states and the same most pairs held, the 6 pp one stands for ``schedule`` (any peak, a
    maximum over those states, is then the same); otherwise ``schedule`` itself is walked. Building and walking a
    step of 1,024 micro-batches costs seconds; this makes every long step cost that of 6 pp + 8 pp (cached)."""
    name, pp, m, vpp, overlap = schedule
    probes = [(name, pp, k * pp, vpp, overlap) for k in STEADY_PROBES]
    if m <= 2 * probes[-1][2]:
        return schedule
    try:
        states = [_states(p, pp_rank) for p in probes]
    except ValueError:   # a probe this schedule refuses (its micro-batch count): walk the step itself
        return schedule
    return probes[0] if states[0] == states[1] else schedule


def _states(schedule: tuple[str, int, int, int, bool], pp_rank: int) -> tuple[frozenset, int]:
    """The distinct states of ``_events`` (what any peak is a maximum over) and the most pairs held."""
    live, messages, kinds, chunks, most = _events(schedule, pp_rank)
    return frozenset(zip(map(tuple, live.tolist()), messages.tolist(), kinds.tolist(), chunks.tolist())), most


@lru_cache(maxsize=1024)
def _events(schedule: tuple[str, int, int, int, bool], pp_rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                                np.ndarray, int]:
    """``pipeline.executor.run_schedule``'s buffers, action by action, as counts: for each posted batch and compute
    of ``pp_rank``, the (micro-batch, chunk) pairs of each chunk held then (a backward's own pair already released)
    and the point-to-point messages held; plus the event kind (0 a batch posted, 1 forward, 2 backward or I, 3 W,
    4 an FB), its chunk (an FB's: its forward's), and the most pairs held at once. A rank holds, before an action,
    the ``kept`` bytes of each held pair plus that many messages plus the action's own transient
    (``schedule_peak``): a forward's (an FB's: its forward half's, while its backward half still holds its pair:
    an upper bound, the backward releasing layer by layer) or a backward's. An I keeps its pair until its W (the
    weight gradients read the saved inputs).

    Messages, as the executor holds them: a receive buffer from its posting until its consumer ran (a received
    activation is then its chunk's input, in ``kept``; a received gradient is freed after its backward); an input
    gradient from its backward until its batch is waited on (a compute waits for its input's batch and the ones
    before it); a sent output is in its chunk's ``kept`` until its backward, then a message while its batch is not
    waited on. A hand-over between the V placement's two chunks of a rank is no message."""
    _, pp, _, vpp, _ = schedule
    built = _schedule(*schedule)
    placement = built.placement
    last = pp * vpp - 1
    live = [0] * vpp
    rows, messages, kinds, chunks = [], [], [], []
    receiving = gradients = most = 0   # receive buffers not yet consumed; input gradients not yet posted
    unwaited: dict[int, tuple[int, list[tuple[int, int]]]] = {}   # batch -> (input gradients, outputs) it sends
    batch_of: dict[tuple[str, int, int], int] = {}               # a posted receive -> its batch
    backward_done: set[tuple[int, int]] = set()

    def held() -> int:
        sent = sum(g + sum(o in backward_done for o in outputs) for g, outputs in unwaited.values())
        return receiving + gradients + sent

    def wait_for(key: tuple[str, int, int]) -> None:
        for b in [b for b in unwaited if b <= batch_of[key]]:
            del unwaited[b]

    def remote(c: int, direction: str) -> bool:
        """Whether the chunk's input (direction 'F') / output gradient ('B') crosses ranks."""
        mc = model_chunk(pp_rank, c, pp, placement)
        if direction == "F":
            return mc > 0 and not is_local(pp_rank, c, "B", pp, placement)
        return mc < last and not is_local(pp_rank, c, "F", pp, placement)

    for index, item in enumerate(split_batches(built.rank_actions(pp_rank))):
        if isinstance(item, tuple):
            outputs = [(a.microbatch, a.chunk) for a in item if a.kind is ActionKind.SEND_F]
            sent_gradients = sum(a.kind is ActionKind.SEND_B for a in item)
            unwaited[index] = (sent_gradients, outputs)
            gradients -= sent_gradients
            for a in item:
                if a.kind.startswith("RECV"):
                    batch_of[(a.kind[-1], a.microbatch, a.chunk)] = index
                    receiving += 1
            rows.append(list(live))
            messages.append(held())
            kinds.append(0)
            chunks.append(item[0].chunk)
            continue
        after = []   # what each part does once the action ran
        for part in item.parts():
            c = part.chunk
            if part.kind is ActionKind.F:
                if remote(c, "F"):
                    wait_for(("F", part.microbatch, c))
                    receiving -= 1   # the receive buffer is now the chunk's input (in ``kept``)
                after.append(("hold", part))
            elif part.kind is ActionKind.W:
                live[c] -= 1
            else:   # B, I
                if remote(c, "B"):
                    wait_for(("B", part.microbatch, c))   # the received gradient lives through the backward
                if item.kind is not ActionKind.FB:   # an FB's backward half keeps its pair in the step (upper bound)
                    live[c] -= 1
                after.append(("backward", part))
        rows.append(list(live))
        messages.append(held())
        kinds.append({ActionKind.F: 1, ActionKind.B: 2, ActionKind.I: 2, ActionKind.W: 3, ActionKind.FB: 4}[item.kind])
        chunks.append(item.chunk)
        for what, part in after:
            c = part.chunk
            if what == "hold":
                live[c] += 1
                continue
            receiving -= int(remote(c, "B"))
            gradients += int(remote(c, "F"))
            backward_done.add((part.microbatch, c))
            if part.kind is ActionKind.I:
                live[c] += 1   # held until its W
            elif item.kind is ActionKind.FB:
                live[c] -= 1
        most = max(most, sum(live))
    return (np.array(rows, dtype=np.float64), np.array(messages, dtype=np.float64), np.array(kinds),
            np.array(chunks), most)


def activation_memory(config: RunConfig, sizes: ParallelSizes, pp_rank: int, num_micro: int,
                      device_type: str = "cuda", exact: bool = True) -> ActivationMemory:
    """Peak activation bytes of ``pp_rank`` (any rank of that stage) running ``num_micro`` micro-batches per step
    with the schedule ``moefold train`` builds for ``config``, whatever shards the static memory. ``exact``: the
    schedule's action lists walked (``schedule_peak``); else the in-flight counts of ``planner.inflight``."""
    return activation_memories(config, sizes, num_micro, device_type, exact)[pp_rank]


def activation_memories(config: RunConfig, sizes: ParallelSizes, num_micro: int, device_type: str = "cuda",
                        exact: bool = True) -> tuple[ActivationMemory, ...]:
    """``activation_memory`` of every pipeline rank, in order."""
    t = config.train
    if t.use_torch_fsdp2 or t.optimizer_cpu_offload or t.optimizer_offload_fraction != 1.0:   # one cache entry
        config = dataclasses.replace(config, train=dataclasses.replace(
            t, use_torch_fsdp2=False, optimizer_cpu_offload=False, optimizer_offload_fraction=1.0))
    return _activation_memories(config, sizes, num_micro, device_type, exact)


@lru_cache(maxsize=4096)
def _activation_memories(config: RunConfig, sizes: ParallelSizes, num_micro: int, device_type: str,
                         exact: bool) -> tuple[ActivationMemory, ...]:
    shape = activation_shape(config, sizes, device_type)
    dispatcher = config.options.resolved_dispatcher(sizes.ep, sizes.etp)
    m = config.model
    overlap = config.train.overlap_moe_expert_parallel_comm
    message = shape.a * shape.T_x * m.hidden_size * v4_streams(m)
    out = []
    for pp_rank in range(sizes.pp):
        if sizes.pp == 1:
            chunks = [(list(range(m.num_layers)), True, (True, True), False, False)]
            # with the overlap two micro-batches are in flight (F0, FB(1, 0), ...)
            schedule = ("1f1b", 1, num_micro, 1, True) if overlap else None
        else:
            layout = layout_of(config, sizes.pp)
            last = layout.num_model_chunks - 1
            chunks = [(list(c.layers), c.has_embedding, (c.has_head, c.has_mtp), c.model_chunk > 0,
                       c.model_chunk < last) for c in layout.rank_chunks(pp_rank)]
            schedule = (config.schedule_name(layout.vpp), sizes.pp, num_micro, layout.vpp, overlap)
        profiles = [chunk_profile(shape, tuple(block_kind(m, i) for i in layers), first, last_chunk, dispatcher,
                                  received, sent) for layers, first, last_chunk, received, sent in chunks]
        host = max((p.offloaded for p in profiles), default=0)
        if not exact:
            name, pp, micro, vpp, overlapped = schedule or ("1f1b", 1, num_micro, 1, False)
            states = held_states(name, pp, vpp, micro, pp_rank, overlapped)
            peak = peak_bytes(states, [p.kept for p in profiles], [p.peak for p in profiles], message, pp > 1)
            in_flight = most_held(states)
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

@lru_cache(maxsize=256)
def _schedule(name: str, pp: int, num_micro: int, vpp: int, overlap: bool = False) -> Schedule:
    return build_schedule(name, pp, num_micro, vpp, overlap=overlap)
