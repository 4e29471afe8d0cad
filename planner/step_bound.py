"""A lower bound on a layout's step time from its blocks' compute (and, for the search, their unhidden communication
and the pipeline's textbook bubble), so that the search times only the layouts that can still rank among those it
prints (branch and bound: ``planner.search``). Why it is a bound on
``step_time.estimate_step_time``'s total: the step's terms are the critical rank's (the rank busiest in the pipeline
clock) plus the bubble, the data-parallel sync, the optimizer and offload terms, all >= 0. The critical rank's terms
less the expert exchange the batch-level overlap hides are its busy time (the overlap hides ``min(exchange,
compute)`` of the exchange, never compute), and its busy time is at least any other rank's. So the total is at least
every rank's busy time, which is at least that rank's compute: ``m`` micro-batches through its chunks' blocks, each
block's forward, backward and at least its selective recompute (full recompute runs the whole forward again, which
is more); the bound is the busiest rank's. Every block's compute is calibrated as
the actions' is (``step_terms.Calibration.compute_seconds``: single GEMMs as timed, grouped expert GEMMs and the
rest each by its constant, all positive, so a block's selective recompute stays at most its full forward; the flat
model of ``--efficiency`` is not calibrated), and the routing kernels' traffic, the head, the embedding and every
communication term only add to it.

Uniform full recompute checkpoints every block, so a block's backward runs its forward again: that forward is in the
bound (block-method full recompute and selective recompute count ``recompute``, what selective recompute repeats).

The search's bound (``gpus_per_node`` given) is tighter, and holds for the closed-form clock the search ranks by:
the busy time also counts each block's collectives that nothing hides (TP's, never overlapped in moefold; the expert
exchange where the schedule has no batch-level overlap to hide it; the cp exchange but what core attention hides of
it with ``p2p``, forward behind the forward's and backward behind twice that), scaled by the calibration's
``communication`` as the actions are, and the closed form adds ``busy x f / (1 - f)`` of idle time to it for 1F1B,
interleaved 1F1B, GPipe and ZB-H1 (``f``: ``pipeline.schedules.expected_bubble_fraction``), so the total is at least
``busy / (1 - f)``.

The search bounds every valid layout (tens of thousands for DeepSeek-V3 on 1,024 GPUs), so the bound is assembled
from two caches: each block kind's seconds (``compute_time.block_compute``, called once per kind and per what it
reads: the model, the options, the train fields but the pipeline's split and schedule, tp, cp, ep and etp) and each
pipeline split's count of block kinds per rank (the layout parsed once per split).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

from moefold.dense.recompute import recomputed_modules
from moefold.models.config import ModelConfig
from moefold.models.layer_factory import is_moe_block
from moefold.parallel.dims import ParallelSizes
from moefold.planner.cluster import Cluster
from moefold.planner.compute_time import block_compute
from moefold.planner.step_terms import CALIBRATION, UNCALIBRATED, host_waits
from moefold.training.config import RunConfig

# execution fields that place layers on pipeline ranks or order the actions: no block's compute reads them
PIPELINE_FIELDS = frozenset({"pipeline_schedule", "overlap_moe_expert_parallel_comm", "delay_wgrad_compute",
                             "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                             "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout"})
INNER_GROUPS = frozenset({"tp", "tp_cp", "cp", "ep", "etp", "etp_ep"})   # the tp, cp, ep terms' groups (skip dp, pp)
MAX_ENTRIES = 1 << 16   # per cache; cleared when full (a search needs a few thousand)
_COSTS: dict[tuple, dict[tuple, float]] = {}   # context -> {block kind: seconds}
_RANK_KINDS: dict[tuple, tuple] = {}   # -> (model, per rank ((block kind, how many), ...))
_PIPELINE_ORDER = tuple(sorted(PIPELINE_FIELDS))
_LAYER_KINDS: dict[tuple, tuple[tuple, ...]] = {}
_EXPOSED: dict[tuple, dict[tuple, float]] = {}
_COLLECTIVES: dict[tuple, list] = {}


def compute_key(config: RunConfig) -> tuple:
    """What a block's compute may depend on in ``config``: everything but the pipeline's split and schedule
    (``PIPELINE_FIELDS``) and the memory savers of the optimizer (ZeRO-1 / FSDP2 / offload change no block's
    compute, ``step_time._actions_key``'s own normalisation, which ``block_compute`` is called under)."""
    t = config.train
    # the model, the options and the train sections as ``value_token``s: hashing them field by field for every
    # layout, rung and saver was a good share of the search
    train = tuple(value_token(v) if dataclasses.is_dataclass(v) else v for k, v in vars(t).items()
                  if k != "execution")
    execution = tuple(v for k, v in vars(t.execution).items() if k not in PIPELINE_FIELDS)
    return value_token(config.model), value_token(config.options), train, execution


_OBJECTS: dict[int, tuple[object, int]] = {}   # id -> (the object, kept so that its id is not reused; its token)
_VALUES: dict[object, int] = {}


def value_token(obj: object) -> int:
    """A small integer standing for the value of the hashable ``obj`` (equal values, equal tokens; a token is never
    reused), hashed once per object rather than at every lookup (a frozen config's hash walks all its fields)."""
    entry = _OBJECTS.get(id(obj))
    if entry is None or entry[0] is not obj:
        if len(_OBJECTS) > MAX_ENTRIES:
            _OBJECTS.clear()
            _VALUES.clear()
        token = _VALUES.get(obj)
        if token is None:
            token = _VALUES[obj] = next(_NEXT_TOKEN)
        entry = _OBJECTS[id(obj)] = (obj, token)
    return entry[1]


_TOKENS: dict[tuple, int] = {}
_NEXT_TOKEN = itertools.count()
_LAST_TOKEN: list = [None, -1]   # (the config last asked about, its token)


def compute_token(config: RunConfig) -> int:
    """A small integer standing for ``compute_key(config)`` (equal keys, equal tokens; a token is never reused), so
    that the caches keyed by it hash an int rather than the model, options and train sections each time."""
    if _LAST_TOKEN[0] is not config:
        key = compute_key(config)
        token = _TOKENS.get(key)
        if token is None:
            if len(_TOKENS) > MAX_ENTRIES:
                _TOKENS.clear()
            token = _TOKENS[key] = next(_NEXT_TOKEN)
        _LAST_TOKEN[:] = [config, token]
    return _LAST_TOKEN[1]


def _layer_kinds(model: ModelConfig, seq: int) -> tuple[tuple, ...]:
    """Per block index (decoder layers, then MTP depths): (MoE?, MTP?, core attention's multiply-adds per token,
    the layer's mixer: a Gated DeltaNet or Mamba-2 block is timed apart from an attention one)."""
    from moefold.planner.step_time import _score_macs

    key = (model, seq)
    if key not in _LAYER_KINDS:
        n = model.num_layers + model.mtp_num_layers
        _LAYER_KINDS[key] = tuple((is_moe_block(model, i), i >= model.num_layers, _score_macs(model, seq, i),
                                   model.layer_type(i)) for i in range(n))
    return _LAYER_KINDS[key]


def rank_block_kinds(config: RunConfig, sizes: ParallelSizes) -> tuple[tuple[tuple[tuple, int], ...], ...]:
    """Per pipeline rank, ((block kind, how many), ...) of the blocks it runs per micro-batch (its chunks' decoder
    layers and MTP depths), computed once per model, sequence length and pipeline split."""
    from moefold.planner.static import per_split

    return per_split(_RANK_KINDS_BY_TRAIN, config, sizes.pp, lambda: _rank_block_kinds(config, sizes))


_RANK_KINDS_BY_TRAIN: dict[tuple, tuple] = {}


def _rank_block_kinds(config: RunConfig, sizes: ParallelSizes) -> tuple[tuple[tuple[tuple, int], ...], ...]:
    from moefold.planner.step_time import rank_chunks

    m, t = config.model, config.train
    e = t.execution
    key = (id(m), t.seq_length, sizes.pp, *(getattr(e, f) for f in _PIPELINE_ORDER))
    entry = _RANK_KINDS.get(key)
    if entry is None or entry[0] is not m:   # (the model kept with its entry: its id is not reused meanwhile)
        if len(_RANK_KINDS) > MAX_ENTRIES:
            _RANK_KINDS.clear()
        kinds = _layer_kinds(m, t.seq_length)
        out = []
        for rank in range(sizes.pp):
            count: Counter = Counter()
            for chunk in rank_chunks(config, sizes, rank):
                count.update(kinds[i] for i in chunk.layers)
                if chunk.has_mtp:
                    count.update(kinds[m.num_layers + d] for d in range(m.mtp_num_layers))
            out.append(tuple(count.items()))
        entry = _RANK_KINDS[key] = (m, tuple(out))
    return entry[1]


def step_lower_bound(config: RunConfig, sizes: ParallelSizes, cluster: Cluster, micro_batches: int,
                     efficiency: float | None = None, gpus_per_node: int | None = None) -> float:
    """Seconds: at most ``estimate_step_time(config, sizes, cluster, ..., efficiency)``'s total (module docstring),
    for the default ``exchange_overlap``, ``compute_share`` and ``calibration``; ``micro_batches``: per step and
    pipeline (``RunConfig.resolve``). With ``gpus_per_node``, a tighter bound on the closed-form clock's total
    (``simulate=False``, what the search ranks by): the busiest rank's blocks' unhidden communication is added
    (``_exposed``), and the busy time is divided by ``1 - f`` for the schedules ``pipeline_clock.formula_makespan``
    gives the textbook bubble fraction ``f`` (its idle time is ``busy x f / (1 - f)`` of the busiest rank)."""
    from moefold.planner.step_time import _actions_key

    flop_s = None if efficiency is None else cluster.bf16_tflops * 1e12 * efficiency
    # a block's GEMMs are sized by tp, cp, ep and etp (``compute_time._gemms``), not by pp or dp
    context = (compute_token(config), sizes.tp, sizes.cp, sizes.ep, sizes.etp, value_token(cluster), flop_s)
    costs = _COSTS.get(context)
    if costs is None:
        if len(_COSTS) > MAX_ENTRIES:
            _COSTS.clear()
        costs = _COSTS[context] = {}
    shared: RunConfig | None = None

    def seconds(kind: tuple) -> float:
        nonlocal shared
        if kind not in costs:
            shared = shared or _actions_key(config)
            o = shared.options
            index = _layer_kinds(config.model, config.train.seq_length).index(kind)
            cost = block_compute(shared, sizes, index, cluster, kind[2],
                                 recomputed_modules(o.recompute, o.recompute_modules), flop_s)
            # uniform full recompute checkpoints every block (decoder and MTP): its backward runs its forward again
            every = o.recompute == "full" and o.recompute_method == "uniform"
            total = cost.forward + cost.backward + (cost.forward if every else cost.recompute)
            gemm, grouped = (p[0] + p[1] + (p[0] if every else p[2]) for p in (cost.gemm, cost.grouped))
            # calibrated as ``_Action.calibrate`` does (the flat model is not: its parts are zero, ``other`` is 1)
            cal = CALIBRATION if efficiency is None else UNCALIBRATED
            costs[kind] = (cal.compute_seconds(total, gemm, grouped), cost.core_attention)
        return costs[kind][0]

    def cp_seconds(kind: tuple) -> float:
        """A decoder block's cp exchange left exposed: with ``p2p`` what its core attention does not hide (forward
        behind the forward's, backward behind twice that), as ``step_time._chunk_actions`` exposes it."""
        forward, backward = cp.get(kind[:2], (0.0, 0.0))
        if not forward and not backward:
            return 0.0
        seconds(kind)
        hidden = costs[kind][1] if config.options.cp_comm == "p2p" else 0.0
        return max(0.0, forward - hidden) + max(0.0, backward - 2 * hidden)

    exposed, cp = ({}, {}) if gpus_per_node is None else _exposed(config, sizes, cluster, gpus_per_node, efficiency)
    comm = 1.0 if efficiency is not None else CALIBRATION.communication
    # the host-bound seconds the calibration adds to every block's compute (``_Action.calibrate``): on the busy path
    host = CALIBRATION.layer_seconds if efficiency is None and host_waits(config) else 0.0
    busiest = max(sum(n * (seconds(kind) + host + comm * (exposed.get(kind[:2], 0.0) + cp_seconds(kind)))
                      for kind, n in rank) for rank in rank_block_kinds(config, sizes))
    bound = micro_batches * busiest
    if gpus_per_node is not None and sizes.pp > 1:   # the closed-form clock's idle time: busy x f / (1 - f)
        from moefold.pipeline.schedules import V_SCHEDULES, expected_bubble_fraction
        from moefold.planner.static import layout_of

        vpp = layout_of(config, sizes.pp).vpp
        name = config.schedule_name(vpp)
        if name not in V_SCHEDULES:
            bound /= 1 - expected_bubble_fraction(name, sizes.pp, micro_batches, vpp)
    return bound


def _exposed(config: RunConfig, sizes: ParallelSizes, cluster: Cluster, gpus_per_node: int,
             efficiency: float | None) -> tuple[dict[tuple, float], dict[tuple, tuple[float, float]]]:
    """({(MoE?, MTP?): seconds} of a decoder block's collectives that nothing hides, forward and backward, before
    calibration: the ``tp`` term (no TP overlap in moefold) and, without the batch-level overlap, the ``ep`` term (the
    exchanges that may hide behind the shared experts excluded); {(MoE?, MTP?): (forward, backward) seconds of its
    ``cp`` term} before core attention hides any of it (``step_bound`` subtracts that per block kind)):
    ``step_time._chunk_actions`` adds at least these to the block's actions (recompute's collectives, pp, the
    collectives over tp x cp x dp and the MTP blocks' only add more)."""
    from moefold.planner.comm import block_collectives
    from moefold.planner.links import Links, by_term
    from moefold.planner.step_time import _actions_key

    overlap = config.train.overlap_moe_expert_parallel_comm
    terms = ("tp",) if overlap else ("tp", "ep")
    key = compute_token(config)
    # rank 0's groups inside the pipeline and data-parallel dims (tp-cp-dp-pp, etp-ep-edp-pp rank order) are the same
    # whatever pp and dp are: one entry per tp, cp, ep, etp (the collectives over tp x cp x dp are left out)
    context = (key, sizes.tp, sizes.cp, sizes.ep, sizes.etp, value_token(cluster), gpus_per_node, terms)
    if context not in _EXPOSED:
        if len(_EXPOSED) > MAX_ENTRIES:
            _EXPOSED.clear()
        links, shared = Links(sizes, cluster, gpus_per_node), None
        out, cp = {}, {}
        for moe in {kind[0] for kind in _layer_kinds(config.model, config.train.seq_length) if not kind[1]}:
            # a block's collectives are sized by tp, cp, ep and etp (``comm.block_collectives``); their seconds
            # depend on where the groups' ranks sit (``Links``: every size)
            which = (key, sizes.tp, sizes.cp, sizes.ep, sizes.etp, moe)
            if which not in _COLLECTIVES:
                if len(_COLLECTIVES) > MAX_ENTRIES:
                    _COLLECTIVES.clear()
                shared = shared or _actions_key(config)
                _COLLECTIVES[which] = [c for c in block_collectives(shared, sizes, moe)
                                       if not c.overlaps and c.group in INNER_GROUPS]
            out[(moe, False)] = sum(by_term(links, _COLLECTIVES[which], phase).get(term, 0.0)
                                    for phase in ("forward", "backward") for term in terms)
            cp[(moe, False)] = tuple(by_term(links, _COLLECTIVES[which], phase).get("cp", 0.0)
                                     for phase in ("forward", "backward"))
        _EXPOSED[context] = out, cp
    return _EXPOSED[context]


__all__ = ["PIPELINE_FIELDS", "compute_key", "compute_token", "value_token", "rank_block_kinds", "step_lower_bound"]
