"""Time per training step of a planned layout: GEMMs, the exposed part of every collective, the pipeline bubble.

Compute: ``planner.compute_time``: every GEMM of a block at the shape one rank runs it, timed in its dtype
(bf16, or FP8 where the run's FP8 recipe covers the module) by ``planner.gemm_efficiency``'s roofline fitted
to published cuBLAS / DeepGEMM figures; core attention at FlashAttention-3's rate; the elementwise kernels and
the fused Adam step over the rank's optimizer shard bound by HBM. Backward = the input- and weight-gradient GEMMs
of every forward GEMM, plus the forward that recompute runs again (full: the recomputed layers; selective: the
chosen modules). ``efficiency=`` (``moefold plan --efficiency``) instead puts every FLOP of
``training.observe.flops`` at that share of the dense bf16 peak (the flat model).

Communication: the collectives of ``planner.comm`` (the bytes the code passes to torch.distributed), each
timed by ``planner.links`` over the link its group uses: NVLink when the group's ranks share a node, else the
network (rank order of ``parallel.dims``, consecutive ranks ``gpus_per_node`` to a node: ``planner.grid``).
Ring algorithms move (n-1)/n of the buffer per rank (twice for an all-reduce), a uniform all-to-all (n-1)/n, its
intra-node share over NVLink and the rest over the network at the same time. What is hidden behind compute is
stated per term in ``StepTime.exposed_notes`` (``OVERLAP``).

Pipeline: each (rank, virtual chunk) forward and backward takes its compute plus its exposed communication; the
schedule's action lists run on ``pipeline.simulator``'s clock with those durations (``planner.pipeline_clock``),
and the bubble is the critical rank's idle time in the simulated step. The step's terms are that rank's. The
split-backward schedules (zb-h1, zbv, dualpipev) run a backward as I (everything but the weight-gradient GEMMs, which
take as long as the forward's GEMMs) and W.

Batch-level overlap (``--overlap-moe-expert-parallel-comm``: FB steps, also at pp = 1): in an FB step each
micro-batch's expert exchange (the token all-to-all / DeepEP's dispatch and combine, forward and backward) runs
while the other micro-batch computes, so the step takes the sum of both halves less ``min(their EP exchange, their
compute)``: the exchange is hidden up to the computation there is to hide it behind (ideal interleaving), the rest
stays exposed, and the ``ep`` term drops by what is hidden. ``--delay-wgrad-compute`` also hides the backward
exchange of a backward that runs alone behind its own weight-gradient GEMMs. The unpaired forwards and backwards
(warm-up, cool-down, and at pp = 1 the first forward and the last backward) keep their exchanges exposed.

Memory savers past ZeRO-1 (``planner.search.SHARDING``, the ladder's ``offload`` rung):

- activation offloading: each chunk's offloaded bytes (``planner.profile``: what its offloaded modules save
  for one micro-batch) cross PCIe (``Cluster.pcie_gbps``) to the host in its forward and back in its backward, on
  side streams: exposed only beyond that action's compute (term ``offload``);
- FSDP2: every micro-batch's forward all-gathers the chunk's parameters (compute dtype) over each kind's mesh, its
  backward all-gathers them again (unless units stay gathered: pipelining, TorchTitan's default) and
  reduce-scatters the gradients (main-grads dtype); FSDP prefetches the next unit while one computes, so the
  exposed part is the first unit's or what does not fit behind the action's compute (term ``dp``, per action;
  no step-end gradient sync);
- optimizer offload: the CPU AdamW (read parameter, gradient, both moments, write three: 28 bytes per element over
  ``Cluster.host_memory_gbps``) and the gradients' and parameters' PCIe copies, overlapped with the next step's
  first forward of the buckets not offloaded (none at fraction 1) (term ``offload``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

from moefold.dense.recompute import recomputed_modules
from moefold.execution.recompute import full_recompute_groups
from moefold.models.config import ModelConfig
from moefold.models.layer_factory import is_moe_block
from moefold.parallel.dims import ParallelSizes
from moefold.pipeline.schedules import V_SCHEDULES
from moefold.pipeline.stages import ChunkSpec
from moefold.planner import comm, step_terms
from moefold.planner.chunk_cache import cached_actions
from moefold.planner.cluster import Cluster
from moefold.planner.collective import GROUP_DIMS, Collective
from moefold.planner.compute_time import ELEMENTWISE_SHARE, block_compute, head_compute
from moefold.planner.grid import spans_nodes
from moefold.planner.links import Links, by_term, group_ranks
from moefold.planner.pipeline_clock import formula_makespan, step_makespan
from moefold.planner.static import layout_of, stage_numel
from moefold.planner.step_terms import COMM_TERMS, OVERLAP, TERMS, UNCALIBRATED, Calibration, StepTime, host_waits
from moefold.training.config import RunConfig
from moefold.training.observe.flops import dsa_macs, train_flops_per_token
from moefold.training.observe.flops_v4 import v4_score_macs

# The flat model's share of the dense bf16 peak (``--efficiency``; ``estimate_step_time(efficiency=...)``): every
# FLOP at one rate, the non-GEMM kernels folded in. The default model times each GEMM at its shape instead.
EFFICIENCY = 0.5
# Fused Adam over one element of the optimizer shard: read fp32 param, main grad, exp_avg, exp_avg_sq (16 B),
# write param, exp_avg, exp_avg_sq (12 B) and the bf16 model copy (2 B).
OPTIMIZER_BYTES = 30

@lru_cache(maxsize=1024)
def _block(config: RunConfig, sizes: ParallelSizes, moe: bool) -> tuple[Collective, ...]:
    return tuple(comm.block_collectives(config, sizes, moe))


# ----------------------------------------------------------------------------------------------- compute
def _score_macs(m: ModelConfig, seq: int, index: int) -> float:
    """Per token: the attention score and value products of layer ``index`` (what core-attention recompute
    repeats)."""
    if m.v4 is not None:   # DeepSeek-V4: the window and the compressed entries each query reads
        return v4_score_macs(m, seq, index)
    if m.dsa is not None:   # DeepSeek sparse attention: the top-k keys, the (quadratic) indexer and its loss
        return dsa_macs(m, seq)
    if m.attention == "mla":
        dqk, dv = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim, m.mla.v_head_dim
    else:
        dqk = dv = m.attention_head_dim
    window = m.layer_sliding_window(index)
    context = (seq + 1) / 2 if window is None else min((seq + 1) / 2, float(window))
    return m.num_attention_heads * (dqk + dv) * context


@dataclass
class _Action:
    """Seconds of one (rank, chunk) forward or backward of one micro-batch, by term; ``weight``: of a backward's
    compute, the weight-gradient GEMMs (a split backward's W); ``gemm`` and ``grouped``: of the compute, the GEMMs'
    seconds and of those the grouped expert GEMMs' (``Calibration.compute_seconds`` scales them apart);
    ``weight_parts``: the same two of ``weight`` (the forward's)."""

    terms: dict[str, float]
    weight: float = 0.0
    blocks: int = 0        # transformer blocks (MTP ones included) this action runs: the host-bound time's count
    gemm: float = 0.0
    grouped: float = 0.0
    weight_parts: tuple[float, float] = (0.0, 0.0)

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    def calibrate(self, cal: Calibration, backward: bool, host_bound: bool) -> None:
        """Scale compute (``Calibration.compute_seconds``) and communication and add the host-bound time per block
        (``Calibration``; only where ``host_bound``: ``host_waits``); the weight-gradient GEMMs as the forward's compute
        they take the time of (``weight_parts``)."""
        host = (2 if backward else 1) / 3 * self.blocks * cal.layer_seconds if host_bound else 0.0
        self.terms["compute"] = cal.compute_seconds(self.terms.get("compute", 0.0), self.gemm, self.grouped) + host
        self.weight = cal.compute_seconds(self.weight, *self.weight_parts)
        for term in COMM_TERMS:
            if term in self.terms:
                self.terms[term] *= cal.communication

    @property
    def hideable(self) -> tuple[float, float]:
        """(the expert exchange another micro-batch's compute can hide, the compute that can hide another's)."""
        return self.terms.get("ep", 0.0), self.terms.get("compute", 0.0)


def rank_chunks(config: RunConfig, sizes: ParallelSizes, pp_rank: int) -> list[ChunkSpec]:
    """The virtual chunks of pipeline rank ``pp_rank`` (the whole model as one chunk at pp = 1: with its MTP
    layers, which the FLOP count of the MFU includes too)."""
    if sizes.pp == 1:
        m = config.model
        return [ChunkSpec(0, 0, 0, range(m.num_layers), True, True, has_mtp=m.mtp_num_layers > 0,
                          has_final_norm=True)]
    return layout_of(config, sizes.pp).rank_chunks(pp_rank)


def _actions_key(config: RunConfig) -> RunConfig:
    """``config`` without what no action's duration depends on (the schedule, the overlap, optimizer offload), so
    that the search's variants of one layout share ``_chunk_actions``."""
    t = config.train
    schedule = t.pipeline_schedule if t.pipeline_schedule in V_SCHEDULES else "1f1b"   # V: its own placement
    if (t.pipeline_schedule, t.overlap_moe_expert_parallel_comm, t.delay_wgrad_compute, t.optimizer_cpu_offload) == \
            (schedule, False, False, False) and t.optimizer_offload_fraction == 1.0:
        return config
    return dataclasses.replace(config, train=dataclasses.replace(
        t, pipeline_schedule=schedule, overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=False,
        optimizer_cpu_offload=False, optimizer_offload_fraction=1.0))


def _copied(pair: tuple[_Action, _Action]) -> tuple[_Action, _Action]:
    """Fresh copies of a cached (forward, backward) (the step calibrates them in place)."""
    return tuple(_Action(dict(a.terms), a.weight, a.blocks, a.gemm, a.grouped, a.weight_parts) for a in pair)


def _chunk_actions(config: RunConfig, sizes: ParallelSizes, chunk: ChunkSpec, links: Links, cluster: Cluster,
                   flop_s: float | None, last_model_chunk: int, exchange_overlap: float) -> tuple[_Action, _Action]:
    """(forward, backward) of one micro-batch through ``chunk``: compute (``planner.compute_time``; the flat
    model at ``flop_s`` when given) and exposed communication by term."""
    m, o, t = config.model, config.options, config.train
    chosen = recomputed_modules(o.recompute, o.recompute_modules)
    fwd: dict[str, float] = defaultdict(float)
    bwd: dict[str, float] = defaultdict(float)
    gemm = [0.0, 0.0]      # of the (forward, backward) compute: GEMM seconds
    grouped = [0.0, 0.0]   # of those: the grouped expert GEMMs'
    # (block, inside a full-recompute checkpoint, the last block of that checkpoint)
    blocks = [(i, ckpt, j == len(ids) - 1) for ids, ckpt in full_recompute_groups(list(chunk.layers), o)
              for j, i in enumerate(ids)]
    if chunk.has_mtp:   # MTP blocks checkpoint themselves under full recompute
        blocks += [(m.num_layers + d, o.recompute == "full", True) for d in range(m.mtp_num_layers)]

    def add(collectives: list[Collective], shared_experts: float = 0.0,
            core_attention: tuple[float, float] = (0.0, 0.0)) -> None:
        """Exposed communication of ``collectives``: what overlaps the shared experts hides behind their
        ``shared_experts`` seconds, cp p2p behind the (forward, backward) seconds of core attention."""
        for phase, out, cp_hidden in (("forward", fwd, core_attention[0]), ("backward", bwd, core_attention[1])):
            hideable = [c for c in collectives if c.phase == phase and c.overlaps == "shared_experts"]
            rest = [c for c in collectives if c.phase == phase and not c.overlaps]
            if hideable:
                out["ep"] += (1 - exchange_overlap) * max(0.0, sum(links.seconds(c) for c in hideable)
                                                          - shared_experts)
            for term, seconds in by_term(links, rest, phase).items():
                if term == "cp" and o.cp_comm == "p2p":
                    seconds = max(0.0, seconds - cp_hidden)
                out[term] += (1 - exchange_overlap) * seconds if term == "ep" else seconds

    exposed: dict[tuple, tuple[dict[str, float], dict[str, float]]] = {}
    for index, recompute_all, last_in_checkpoint in blocks:
        moe = is_moe_block(m, index)
        cost = block_compute(config, sizes, index, cluster, _score_macs(m, t.seq_length, index), chosen, flop_s)
        fwd["compute"] += cost.forward
        bwd["compute"] += cost.backward + (cost.forward if recompute_all else cost.recompute)
        for parts, seconds in ((gemm, cost.gemm), (grouped, cost.grouped)):
            parts[0] += seconds[0]
            parts[1] += seconds[1] + (seconds[0] if recompute_all else seconds[2])
        if index >= m.num_layers:   # an MTP block, with its embedding, head and loss
            collectives = comm.mtp_collectives(config, sizes)
            head_f, head_b = head_compute(config, sizes, cluster, flop_s)
            fwd["compute"] += head_f
            bwd["compute"] += head_b
            if flop_s is None:
                gemm[0], gemm[1] = gemm[0] + head_f, gemm[1] + head_b
        else:
            # equal blocks expose equal communication: each kind is worked out once per chunk
            key = (moe, recompute_all, last_in_checkpoint, cost.shared_experts, cost.core_attention)
            if key not in exposed:
                block = list(_block(config, sizes, moe))
                before = (dict(fwd), dict(bwd))
                add(block + comm.recompute_collectives(block, o, full=recompute_all, moe=moe,
                                                       last_in_checkpoint=last_in_checkpoint),
                    shared_experts=cost.shared_experts, core_attention=(cost.core_attention, 2 * cost.core_attention))
                exposed[key] = tuple({k: v[k] - b.get(k, 0.0) for k in v} for v, b in zip((fwd, bwd), before))
            else:
                for out, extra in zip((fwd, bwd), exposed[key]):
                    for term, seconds in extra.items():
                        out[term] += seconds
            continue
        add(collectives, shared_experts=cost.shared_experts, core_attention=(cost.core_attention,
                                                                             2 * cost.core_attention))
    if chunk.has_embedding:
        add(comm.embedding_collectives(config, sizes))
    if chunk.has_head:
        add(comm.head_collectives(config, sizes))
        head_f, head_b = head_compute(config, sizes, cluster, flop_s)
        fwd["compute"] += head_f
        bwd["compute"] += head_b
        if flop_s is None:
            gemm[0], gemm[1] = gemm[0] + head_f, gemm[1] + head_b
    for c in comm.pipeline_collectives(config, sizes, chunk.model_chunk, last_model_chunk + 1):
        (fwd if c.phase == "forward" else bwd)["pp"] += links.seconds(c)
    if o.offload_modules:   # the chunk's offloaded bytes, out in its forward and back in its backward
        copy = _offloaded_bytes(config, sizes, chunk, last_model_chunk) / (links.cluster.pcie_gbps * 1e9)
        fwd["offload"] += max(0.0, copy - fwd["compute"])
        bwd["offload"] += max(0.0, copy - bwd["compute"])
    if t.use_torch_fsdp2:
        for phase, out in (("forward", fwd), ("backward", bwd)):
            seconds, units = _fsdp_seconds(config, sizes, chunk, links, phase)
            out["dp"] += max(seconds / max(units, 1), seconds - out["compute"])
    # the weight-gradient GEMMs of the backward take what the forward's GEMMs take (dw = dy^T x per y = x w^T)
    return (_Action(dict(fwd), blocks=len(blocks), gemm=gemm[0], grouped=grouped[0]),
            _Action(dict(bwd), weight=fwd["compute"], blocks=len(blocks), gemm=gemm[1], grouped=grouped[1],
                    weight_parts=(gemm[0], grouped[0])))


def _offloaded_bytes(config: RunConfig, sizes: ParallelSizes, chunk: ChunkSpec, last_model_chunk: int) -> int:
    """Host bytes one micro-batch's forward through ``chunk`` leaves (``planner.profile.chunk_profile``)."""
    from moefold.planner.profile import activation_shape, chunk_profile

    m = config.model
    shape = activation_shape(config, sizes)
    dispatcher = config.options.resolved_dispatcher(sizes.ep, sizes.etp)
    from moefold.planner.activations_mamba import block_kind

    kinds = tuple(block_kind(m, i) for i in chunk.layers)
    received, sent = chunk.model_chunk > 0, chunk.model_chunk < last_model_chunk
    return chunk_profile(shape, kinds, chunk.has_embedding, chunk.has_head, dispatcher, received, sent).offloaded


def _fsdp_seconds(config: RunConfig, sizes: ParallelSizes, chunk: ChunkSpec, links: Links, phase: str,
                  ) -> tuple[float, int]:
    """(seconds of FSDP2's collectives for one micro-batch through ``chunk`` in ``phase``, units in the chunk): the
    parameters' all-gather (again in backward without pipelining) and the gradients' reduce-scatter."""
    t = config.train
    per_layer = _stage_numel_per_layer(config, sizes, chunk)
    compute = 2 if t.bf16 else 4
    grad = 2 if t.main_grads_dtype == "bf16" else 4
    seconds = 0.0
    for (kind, _), n in per_layer.items():
        group = comm.KIND_GROUPS[kind]
        if phase == "forward" or sizes.pp == 1:
            seconds += links.seconds(Collective(group, "all_gather", n * compute, phase, "fsdp"))
        if phase == "backward":
            seconds += links.seconds(Collective(group, "reduce_scatter", n * grad, phase, "fsdp"))
    return seconds, len(chunk.layers) + int(chunk.has_embedding) + int(chunk.has_head)


def _stage_numel_per_layer(config: RunConfig, sizes: ParallelSizes, chunk: ChunkSpec) -> dict[tuple[str, str], int]:
    """Elements per (kind, dtype) of ``chunk``: the stage's, shared out by the chunk's part of its layers."""
    numel = stage_numel(config, sizes, chunk.pp_rank)
    chunks = rank_chunks(config, sizes, chunk.pp_rank)
    layers = sum(len(c.layers) for c in chunks) or 1
    share = max(len(chunk.layers), 1) / layers
    return {k: int(n * share) for k, n in numel.items()}


# ----------------------------------------------------------------------------------------------- data parallel
def _cpu_adam_seconds(config: RunConfig, sizes: ParallelSizes, pp_rank: int, links: Links,
                      fwd_window: float) -> float:
    """Optimizer offload's exposed seconds per step (module docstring)."""
    t = config.train
    group_size = {"dense": sizes.dp * sizes.cp, "sp": sizes.tp * sizes.cp * sizes.dp, "expert": sizes.edp}
    owned = t.optimizer_offload_fraction * sum(n / group_size[kind]
                                               for (kind, _), n in stage_numel(config, sizes, pp_rank).items())
    cluster = links.cluster
    grad, param = (2 if t.main_grads_dtype == "bf16" else 4), (2 if t.bf16 else 4)
    host = owned * 28 / (cluster.host_memory_gbps * 1e9) + owned * (grad + param) / (cluster.pcie_gbps * 1e9)
    return max(0.0, host - (1 - t.optimizer_offload_fraction) * fwd_window)


def _dp_seconds(config: RunConfig, sizes: ParallelSizes, pp_rank: int, links: Links, fwd_window: float,
                bwd_window: float) -> float:
    t = config.train
    if t.use_torch_fsdp2:   # FSDP's collectives are the actions' own (per micro-batch)
        return 0.0
    # per group, runs of equal buckets (comm.grad_sync_buckets): (how many, seconds of each)
    rs: dict[str, list[tuple[int, float]]] = defaultdict(list)
    ag: dict[str, list[tuple[int, float]]] = defaultdict(list)
    grad_bytes = 4 if t.main_grads_dtype == "fp32" else 2
    for kind, dtype, count, padded in comm.grad_sync_buckets(config, sizes, stage_numel(config, sizes, pp_rank)):
        group, p_bytes = comm.KIND_GROUPS[kind], 4 if dtype == "fp32" else 2
        rs[group].append((count, links.seconds(Collective(group, "reduce_scatter", padded * grad_bytes, "step",
                                                                 "grad_sync"))))
        ag[group].append((count, links.seconds(Collective(group, "all_gather", padded * p_bytes, "step",
                                                                 "param_sync"))))
    exposed = 0.0
    for runs in rs.values():   # buckets in backward order: the last one launches last
        total = sum(n * s for n, s in runs)
        exposed += max(runs[-1][1], total - bwd_window) if t.overlap_grad_reduce else total
    for runs in ag.values():
        total = sum(n * s for n, s in runs)
        exposed += max(runs[0][1], total - fwd_window) if t.overlap_param_gather else total
    return exposed


# ----------------------------------------------------------------------------------------------- the step
def _optimizer_seconds(config: RunConfig, sizes: ParallelSizes, pp_rank: int, cluster: Cluster) -> float:
    """The fused Adam step over this rank's shard of the distributed optimizer (dense parameters sharded over
    dp x cp, experts over edp): ``OPTIMIZER_BYTES`` per element through HBM at the elementwise share."""
    numel = 0.0
    for (kind, _), n in stage_numel(config, sizes, pp_rank).items():
        numel += n / (sizes.edp if kind == "expert" else sizes.dp * sizes.cp)
    return numel * OPTIMIZER_BYTES / (ELEMENTWISE_SHARE * cluster.hbm_gbps * 1e9)


def estimate_step_time(config: RunConfig, sizes: ParallelSizes, cluster: Cluster, gpus_per_node: int,
                       efficiency: float | None = None, exchange_overlap: float = 0.0,
                       compute_share: float = 1.0, simulate: bool = True,
                       calibration: Calibration | None = None) -> StepTime:
    """Seconds per step of ``config`` in layout ``sizes`` on ``cluster`` (module docstring); ValueError for a
    layout the run would refuse (``RunConfig.resolve``). ``efficiency``: the flat model (every FLOP at that share
    of the bf16 peak, nothing else counted) instead of the calibrated one; ``exchange_overlap``: the share of the
    otherwise exposed expert exchange hidden behind compute (0 in moefold's schedules; 1 models a schedule that
    hides it, such as DeepSeek's DualPipe); ``compute_share``: the share of the GPU's SMs the compute kernels get
    (below 1 when communication kernels run beside them all along: DualPipe's all-to-all holds 20 of 132 SMs).
    ``simulate=False``: the pipeline clock in closed form (``pipeline_clock.formula_makespan``: textbook bubbles
    and idle-time formulas, FB steps counted from the warm-up) instead of simulated, what the search ranks with
    (the simulation is its ``--exact`` mode). ``calibration``: the end-to-end constants (default
    ``CALIBRATION``; not applied to the flat model)."""
    if efficiency is not None and not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency!r} must be in (0, 1]")
    if not 0 <= exchange_overlap <= 1:
        raise ValueError(f"exchange_overlap={exchange_overlap!r} must be in [0, 1]")
    if not 0 < compute_share <= 1:
        raise ValueError(f"compute_share={compute_share!r} must be in (0, 1]")
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node={gpus_per_node!r} must be a positive integer")
    _, m = config.resolve(sizes.world_size)
    links = Links(sizes, cluster, gpus_per_node)
    flop_s = None if efficiency is None else cluster.bf16_tflops * 1e12 * efficiency
    vpp = layout_of(config, sizes.pp).vpp if sizes.pp > 1 else 1
    last = sizes.pp * vpp - 1
    shared = _actions_key(config)
    actions = [[_copied(cached_actions(_chunk_actions, shared, sizes, c, links, cluster, flop_s, last,
                                       exchange_overlap))
                for c in rank_chunks(config, sizes, r)] for r in range(sizes.pp)]
    cal = (step_terms.CALIBRATION if calibration is None else calibration) if efficiency is None else UNCALIBRATED
    if cal != UNCALIBRATED:
        host_bound = host_waits(config)
        for rank in actions:
            for f, b in rank:
                f.calibrate(cal, backward=False, host_bound=host_bound)
                b.calibrate(cal, backward=True, host_bound=host_bound)
    if compute_share < 1:
        for rank in actions:
            for action in (a for pair in rank for a in pair):
                action.terms["compute"] = action.terms.get("compute", 0.0) / compute_share
                action.weight /= compute_share
    t = config.train
    overlap, delay = t.overlap_moe_expert_parallel_comm, t.delay_wgrad_compute
    # a chunk without weight GEMMs (an embedding-only or loss-only stage) gets a W of no length (the clock needs > 0)
    # (its I = B - W too: hence a B of at least 2e-12)
    durations = tuple(tuple((max(f.total, 1e-12), max(b.total, 2e-12),
                             max(min(b.weight, 0.5 * max(b.total, 2e-12)), 1e-12),
                             f.hideable, b.hideable) for f, b in rank) for rank in actions)
    if sizes.pp == 1 and not overlap:
        makespan = m * sum(f.total + b.total for f, b in actions[0])
        critical, busy, hidden = 0, (makespan,), 0.0
    else:   # at pp = 1 with the overlap: F0, FB(1, 0), ..., B(m-1) on one rank
        name = config.schedule_name(vpp) if sizes.pp > 1 else "1f1b"
        clock = step_makespan if simulate else formula_makespan
        makespan, busy, hidden = clock(name, sizes.pp, vpp, m, durations, overlap, delay)
        critical = max(range(sizes.pp), key=lambda r: busy[r])
    terms = dict.fromkeys(TERMS, 0.0)
    for f, b in actions[critical]:
        for term, seconds in (*f.terms.items(), *b.terms.items()):
            terms[term] += m * seconds
    terms["ep"] = max(0.0, terms["ep"] - hidden)
    terms["bubble"] = max(0.0, makespan - busy[critical])
    fwd_window = sum(f.total for f, _ in actions[critical])
    bwd_window = sum(b.total for _, b in actions[critical])
    terms["dp"] += cal.communication * _dp_seconds(config, sizes, critical, links, fwd_window, bwd_window)
    if config.train.optimizer_cpu_offload:
        terms["offload"] += _cpu_adam_seconds(config, sizes, critical, links, fwd_window)
    if flop_s is None:
        terms["compute"] += _optimizer_seconds(config, sizes, critical, cluster) / compute_share
    tokens = config.train.global_batch_size * config.train.seq_length
    flops = train_flops_per_token(config.model, config.train.seq_length) * tokens / sizes.world_size
    links = {}
    for group in GROUP_DIMS:
        members = group_ranks(sizes, group)
        if len(members) > 1:
            links[group] = "network" if spans_nodes(members, gpus_per_node) else "NVLink"
    return StepTime(terms=terms, exposed_notes=dict(OVERLAP), flops_per_gpu=flops, tokens_per_step=tokens,
                    gpus=sizes.world_size, links=links)
