"""The layouts ``moefold plan`` considers, the memory each needs per rank, and which of them fit and run fastest.

``evaluate(config, world, ...)`` plans one layout (the one ``config.parallel`` and its options describe):

- memory per rank, for every pipeline stage, by component: parameters, main gradients, optimizer states
  (``training.plan.static``: a lower bound first, then the exact bytes of the trainer's own buffers built on the
  meta device for the layouts that may fit), activations (``training.plan.profile``: the modules' saved tensors
  walked through the schedule's action lists) and DeepEP's buffer with the flex dispatcher
  (``training.plan.deepep``). The stage with the largest total is the layout's requirement; it fits when that
  total is at most the GPU's memory less ``headroom`` (the CUDA context, NCCL's buffers and the caching
  allocator's fragmentation, which the model does not count);
- the step time (``training.plan.step_time.estimate_step_time``), for a layout that fits.

``search`` enumerates every layout of ``world`` GPUs (tp, cp, pp with its stage split and virtual stages, ep,
etp, the micro-batch size, the pipeline schedule with or without the batch-level overlap, and the recompute
setting) that ``moefold train`` would accept (``validate_layout``), keeping what the user fixed; for each layout
it takes the least activation saving that fits (``recompute_ladder``: more recompute never runs faster), and ranks
what fits by tokens/s/GPU. The schedules tried (``_schedules``): at pp = 1 plain accumulation and, with ep > 1,
the overlap; at pp > 1 1F1B and ZB-H1 with one chunk per rank, interleaved 1F1B (with and without the overlap)
and, when the layers split evenly over 2 pp chunks, ZB-V and DualPipeV (with and without its FB pairs
overlapped). The overlap always comes with --delay-wgrad-compute (it only removes exposed time).

Memory savers past ZeRO-1 are choices of the search too (``SHARDING``): FSDP2 (``--use-torch-fsdp2``) and optimizer
offload (``--optimizer-cpu-offload``, fraction 1). A layout that fits with no activation saving under ZeRO-1 is
taken as it is; otherwise each saver is tried with the least activation saving it needs, kept only when that is
less than what ZeRO-1 needs (the same saving with a saver never runs faster), and of those the fastest is the
layout's plan. Activation offloading is a rung of the ladder (``offload``). Host memory (the offloaded activations
of the micro-batches in flight, the offloaded optimizer states) must fit the host's share per GPU too. A saver
``moefold train`` refuses with the layout's schedule (``training.config.saver_conflict``: FSDP2 with split
backwards or the batch-level overlap, activation offloading with the overlap) is not tried with it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from moefold.models.config import ModelConfig
from moefold.parallel.dims import ParallelConfig, ParallelSizes
from moefold.training.cli.train import validate_layout
from moefold.training.config import RunConfig
from moefold.training.plan.cluster import Cluster
from moefold.training.plan.deepep import deepep_buffer_bytes
from moefold.training.plan.profile import ActivationMemory, activation_memory
from moefold.training.plan.static import StaticMemory, exact_static, static_lower_bound
from moefold.training.plan.step_time import StepTime, estimate_step_time

HEADROOM = 0.1           # share of the GPU's memory left for what the model does not count (module docstring)
MAX_PP = 64
MICRO_BATCH_SIZES = (1,)   # searched unless --micro-batch-size is given (Megatron's MoE recipes all use 1)
PROGRESS_EVERY_S = 5.0   # between the search's status lines
PER_WORKER = 64            # step-time estimates per process before the search forks more processes
SIMULATED_PER_TOP = 8      # layouts (by the fast estimate) whose pipelines are simulated, per layout printed
REASON_CHARS = 90         # rejection reasons are grouped by their first characters
COMPONENTS = ("params", "main grads", "optimizer", "activations", "buffers")
OFFLOADED = ("core_attn", "attn_proj", "expert_fc1")   # the ladder's offload rung: Megatron's suggested split
# what shards or moves the static memory past ZeRO-1 (TrainConfig fields), in the order they are tried
SHARDING: dict[str, dict] = {"zero1": {}, "fsdp": {"use_torch_fsdp2": True},
                             "cpu-adam": {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0}}


def recompute_ladder(model: ModelConfig) -> dict[str, dict]:
    """Activation savings from the fastest to the leanest (ModelOptions fields): none; Megatron's default
    selective (core attention); selective of every cheap module (core attention, norms, the MoE activation, MLA's
    up-projections); ``offload``: the cheap modules but core attention recomputed, core attention, its projection
    and the experts' first GEMM offloaded to host memory (Megatron's suggested split); full recompute."""
    mla = ("mla_up_proj",) if model.attention == "mla" else ()
    cheap = ("core_attn", "layernorm", "moe_act", *mla)
    return {"none": {"recompute": "none"},
            "selective": {"recompute": "selective", "recompute_modules": ("core_attn",)},
            "selective+": {"recompute": "selective", "recompute_modules": cheap},
            "offload": {"recompute": "selective", "recompute_modules": ("layernorm", "moe_act", *mla),
                        "offload_modules": OFFLOADED},
            "full": {"recompute": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}


def sharding_of(config: RunConfig) -> str:
    """The ``SHARDING`` name of ``config``'s optimizer and parameter layout."""
    t = config.train
    return "fsdp" if t.use_torch_fsdp2 else "cpu-adam" if t.optimizer_cpu_offload else "zero1"


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank of pipeline stage ``pp_rank`` needs, by component."""

    pp_rank: int
    static: StaticMemory
    activations: ActivationMemory
    deepep: int = 0

    @property
    def components(self) -> dict[str, int]:
        """GPU memory by component; ``buffers``: DeepEP's buffer and FSDP's gathered units."""
        s = self.static
        return {"params": s.params, "main grads": s.grads, "optimizer": s.optimizer,
                "activations": self.activations.peak, "buffers": self.deepep + s.buffers}

    @property
    def host(self) -> int:
        """Host memory per GPU: offloaded activations (the micro-batches in flight) and optimizer states."""
        return self.static.host + self.activations.host

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def largest(self) -> str:
        c = self.components
        return max(c, key=c.get)


@dataclass(frozen=True)
class Plan:
    """One layout: its config (``config.parallel`` and options as ``moefold train`` takes them), its sizes, the
    micro-batches per step, the memory of its fullest stage, the usable memory, and its step time if it fits."""

    config: RunConfig
    sizes: ParallelSizes
    num_micro: int
    recompute: str
    memory: RankMemory
    usable: int
    time: StepTime | None = None
    host_usable: int | None = None   # host memory per GPU the plan may use (None: unbounded)

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host and self.memory.static.exact

    @property
    def fits_gpu(self) -> bool:
        return self.memory.total <= self.usable

    @property
    def fits_host(self) -> bool:
        return self.host_usable is None or self.memory.host <= self.host_usable

    @property
    def sharding(self) -> str:
        return sharding_of(self.config)

    @property
    def vpp(self) -> int:
        return self.config.pipeline_layout(self.sizes.pp).vpp if self.sizes.pp > 1 else 1

    @property
    def schedule(self) -> str:
        """The schedule ``moefold train`` runs (``+ov``: with the batch-level overlap; pp = 1: "-" or "overlap")."""
        overlap = self.config.train.overlap_moe_expert_parallel_comm
        if self.sizes.pp == 1:
            return "overlap" if overlap else "-"
        return self.config.schedule_name(self.vpp) + ("+ov" if overlap else "")


def _memory(config: RunConfig, sizes: ParallelSizes, num_micro: int, exact: bool, gpus_per_node: int) -> RankMemory:
    static = (exact_static if exact else static_lower_bound)(config, sizes)
    flex = config.options.resolved_dispatcher(sizes.ep, sizes.etp) == "flex"
    deepep = deepep_buffer_bytes(config, sizes, gpus_per_node) if flex else 0
    ranks = [RankMemory(r, static[r], activation_memory(config, sizes, r, num_micro), deepep)
             for r in range(sizes.pp)]
    return max(ranks, key=lambda m: m.total)


def stage_memory(plan: Plan) -> list[RankMemory]:
    """Every pipeline stage's memory per GPU for ``plan`` (exact static bytes), in pipeline order."""
    config, sizes = plan.config, plan.sizes
    static = exact_static(config, sizes)
    flex = config.options.resolved_dispatcher(sizes.ep, sizes.etp) == "flex"
    deepep = deepep_buffer_bytes(config, sizes) if flex else 0
    return [RankMemory(r, static[r], activation_memory(config, sizes, r, plan.num_micro), deepep)
            for r in range(sizes.pp)]


def evaluate(config: RunConfig, world: int, cluster: Cluster, gpus_per_node: int, memory_bytes: int | None = None,
             *, headroom: float = HEADROOM, efficiency: float | None = None, recompute: str = "",
             with_time: bool = True) -> Plan:
    """The plan of ``config``'s own layout on ``world`` GPUs (ValueError naming the flags if ``moefold train``
    would refuse it). Static bytes are exact unless the lower bound already does not fit."""
    sizes = validate_layout(config, world)
    _, num_micro = config.resolve(world)
    usable = int((memory_bytes or cluster.memory_bytes) * (1 - headroom))
    memory = _memory(config, sizes, num_micro, exact=False, gpus_per_node=gpus_per_node)
    if memory.total <= usable:
        memory = _memory(config, sizes, num_micro, exact=True, gpus_per_node=gpus_per_node)
    plan = Plan(config, sizes, num_micro, recompute or config.options.recompute, memory, usable,
                host_usable=int(cluster.host_memory_bytes * (1 - headroom)))
    if with_time and plan.fits:
        plan = dataclasses.replace(plan, time=estimate_step_time(config, sizes, cluster, gpus_per_node, efficiency))
    return plan


# ----------------------------------------------------------------------------------------------- enumeration
@dataclass(frozen=True)
class Fixed:
    """What the user fixed on the command line (None: searched)."""

    tp: int | None = None
    cp: int | None = None
    pp: int | None = None
    ep: int | None = None
    etp: int | None = None
    layers_per_virtual_stage: int | None = None
    first_stage_layers: int | None = None     # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None      # --decoder-last-pipeline-num-layers
    virtual_stages: int | None = None    # --num-virtual-stages-per-pipeline-rank: vpp, the standard layouts searched
    layout: str | None = None            # --pipeline-model-parallel-layout
    micro_batch_size: int | None = None
    recompute: dict | None = None        # ModelOptions fields (recompute and activation offloading)
    sharding: str | None = None          # a ``SHARDING`` name
    schedule: str | None = None          # --pipeline-schedule
    overlap: bool | None = None          # --overlap-moe-expert-parallel-comm


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


VIRTUAL_STAGES = (1, 2, 4)   # vpp tried per pp (each with the standard layouts, pipeline.layout.standard_layouts)


def _stage_splits(num_layers: int, pp: int, fixed: Fixed, mtp_num_layers: int = 0) -> Iterator[dict]:
    """TrainConfig fields of the pipeline splits tried at ``pp``: the given layout, or the even split of the given
    layers per virtual stage, or per vpp in ``VIRTUAL_STAGES`` (the given one only) the standard layouts of
    ``pipeline.layout`` (even, balanced, standalone loss/MTP) as ``--pipeline-model-parallel-layout`` text."""
    from moefold.pipeline.layout import format_layout, standard_layouts

    if fixed.first_stage_layers is not None or fixed.last_stage_layers is not None:
        yield {"decoder_first_pipeline_num_layers": fixed.first_stage_layers,
               "decoder_last_pipeline_num_layers": fixed.last_stage_layers}
        return

    if pp == 1:
        yield {}
        return
    if fixed.layout is not None:
        yield {"pipeline_model_parallel_layout": fixed.layout}
        return
    if fixed.layers_per_virtual_stage is not None:
        yield {"num_layers_per_virtual_pipeline_stage": fixed.layers_per_virtual_stage}
        return
    for vpp in [fixed.virtual_stages] if fixed.virtual_stages else VIRTUAL_STAGES:
        if pp * vpp > num_layers + 2 + mtp_num_layers:
            continue
        for stages in standard_layouts(num_layers, pp, vpp, mtp_num_layers).values():
            yield {"pipeline_model_parallel_layout": format_layout(stages)}


OVERLAP_FIELDS = ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute")


def _schedules(num_layers: int, pp: int, ep: int, split: dict, fixed: Fixed) -> Iterator[dict]:
    """TrainConfig fields of the schedules tried with one stage split (module docstring)."""
    overlaps = [fixed.overlap] if fixed.overlap is not None else ([False, True] if ep > 1 else [False])

    def with_overlap(schedule: str, can_overlap: bool) -> Iterator[dict]:
        if fixed.schedule is not None and fixed.schedule != schedule:
            return
        for on in overlaps if can_overlap else [False]:
            yield {"pipeline_schedule": schedule, **dict.fromkeys(OVERLAP_FIELDS, on)}

    if pp == 1:
        yield from with_overlap(fixed.schedule or "1f1b", True)
    elif _split_vpp(num_layers, pp, split) == 1:
        for schedule in ("1f1b", "zb-h1", "gpipe") if fixed.schedule == "gpipe" else ("1f1b", "zb-h1"):
            yield from with_overlap(schedule, False)
    else:
        yield from with_overlap("1f1b", True)   # interleaved (implied by the virtual stages)
        if _split_vpp(num_layers, pp, split) == 2:   # 2 chunks per rank: V placed
            yield from with_overlap("zbv", False)
            yield from with_overlap("dualpipev", True)


def _split_vpp(num_layers: int, pp: int, split: dict) -> int:
    """Virtual stages per rank of one split of ``_stage_splits``."""
    from moefold.pipeline.layout import parse_layout

    if split.get("pipeline_model_parallel_layout") is not None:
        return max(len(parse_layout(split["pipeline_model_parallel_layout"])) // pp, 1)
    per = split.get("num_layers_per_virtual_pipeline_stage")
    return num_layers // (pp * per) if per else 1


@dataclass
class SearchResult:
    """The fitting plans, fastest first; the counts of what was considered; the best non-fitting plan
    (the one needing the least memory) when nothing fits."""

    plans: list[Plan]
    considered: int = 0
    valid: int = 0
    fitting: int = 0
    closest: Plan | None = None
    rejected: dict[str, int] = field(default_factory=dict)


def candidates(config: RunConfig, world: int, gpus_per_node: int, fixed: Fixed) -> Iterator[RunConfig]:
    """Every layout of ``world`` GPUs to consider (not yet validated), at the lowest recompute setting."""
    m, t = config.model, config.train
    experts = max(m.num_experts, 1)
    for tp in [fixed.tp] if fixed.tp else _divisors(world, gpus_per_node):
        for cp in [fixed.cp] if fixed.cp else _divisors(world // tp, 16):
            for pp in [fixed.pp] if fixed.pp else _divisors(world // (tp * cp), min(MAX_PP, m.num_layers)):
                dense_ranks = world // pp
                for etp in [fixed.etp] if fixed.etp else _divisors(dense_ranks, gpus_per_node):
                    eps = [fixed.ep] if fixed.ep else [e for e in _divisors(experts, dense_ranks // etp)
                                                       if (dense_ranks // etp) % e == 0]
                    for ep in eps:
                        for split in _stage_splits(m.num_layers, pp, fixed, m.mtp_num_layers):
                            for schedule in _schedules(m.num_layers, pp, ep, split, fixed):
                                for mbs in [fixed.micro_batch_size] if fixed.micro_batch_size else MICRO_BATCH_SIZES:
                                    pipeline = {"num_layers_per_virtual_pipeline_stage": None,
                                                "decoder_first_pipeline_num_layers": None,
                                                "decoder_last_pipeline_num_layers": None,
                                                "pipeline_model_parallel_layout": None, **split, **schedule}
                                    train = dataclasses.replace(t, micro_batch_size=mbs, **pipeline)
                                    yield dataclasses.replace(config, parallel=ParallelConfig(
                                        tp=tp, cp=cp, pp=pp, ep=ep, etp=etp), train=train)


def _least_recompute(candidate: RunConfig, sizes: ParallelSizes, num_micro: int, ladder: dict[str, dict],
                     usable: int, gpus_per_node: int, host_usable: int | None = None,
                     ) -> tuple[Plan | None, Plan | None]:
    """(the plan with the least activation saving of ``ladder`` that fits, or None; the leanest plan, None when
    ``moefold train`` refuses every rung with this layout). The leanest is tried first: when it does not fit,
    nothing does (host memory aside: the offload rung may be the only one that does not fit there). A rung
    ``moefold train`` refuses with the candidate's schedule (the offload rung with the batch-level overlap) is
    skipped."""
    def planned(name: str) -> RunConfig:
        return dataclasses.replace(candidate, options=dataclasses.replace(candidate.options, **ladder[name]))

    def plan_of(name: str) -> Plan:
        return Plan(planned(name), sizes, num_micro, name,
                    _memory(planned(name), sizes, num_micro, False, gpus_per_node), usable, host_usable=host_usable)

    names = [name for name in ladder if not planned(name).memory_saver_conflict(sizes.pp)]
    if not names:
        return None, None
    leanest = plan_of(names[-1])
    if not leanest.fits_gpu:
        return None, leanest
    for name in names[:-1]:
        plan = plan_of(name)
        if plan.fits_gpu and plan.fits_host:
            return plan, leanest
    return (leanest, leanest) if leanest.fits_host else (None, leanest)


def _with_sharding(candidate: RunConfig, name: str, world: int) -> RunConfig | None:
    """``candidate`` with the ``SHARDING`` choice ``name``; None where ``moefold train`` would refuse it."""
    from moefold.training.optim.fsdp import check_fsdp

    train = dataclasses.replace(candidate.train, **{**SHARDING["zero1"], "use_torch_fsdp2": False,
                                                    "optimizer_cpu_offload": False, **SHARDING[name]})
    try:
        check_fsdp(train, candidate.options, world)
    except ValueError:
        return None
    return dataclasses.replace(candidate, train=train)


def _least_saving(candidate: RunConfig, sizes: ParallelSizes, num_micro: int, ladder: dict[str, dict], usable: int,
                  host_usable: int, world: int, shardings: list[str], gpus_per_node: int) -> tuple[list[Plan], Plan]:
    """The plans worth timing for one layout (module docstring) and its leanest plan (the closest when none fits)."""
    rungs = list(ladder)
    plans, closest, best = [], None, len(rungs)
    for name in shardings:
        config = candidate if name == sharding_of(candidate) else _with_sharding(candidate, name, world)
        if config is None or config.memory_saver_conflict(sizes.pp):
            continue
        fits, leanest = _least_recompute(config, sizes, num_micro, ladder, usable, gpus_per_node, host_usable)
        if leanest is not None and (closest is None or leanest.memory.total < closest.memory.total):
            closest = leanest
        # a saver is worth timing when it needs no more activation saving than the best so far (ZeRO-1 first: with
        # the same saving nothing runs faster than it)
        if fits is not None and (rungs.index(fits.recompute) < best or
                                 (name != "zero1" and rungs.index(fits.recompute) == best)):
            plans.append(fits)
            best = rungs.index(fits.recompute)
        if best == 0 and name == "zero1":   # fits with no activation saving: nothing else can be faster
            break
    return plans, closest


def _times_of(jobs: list[tuple[RunConfig, ParallelSizes]], cluster: Cluster, gpus_per_node: int,
              efficiency: float) -> list[StepTime]:
    return [estimate_step_time(c, s, cluster, gpus_per_node, efficiency) for c, s in jobs]


def _step_times(jobs: list[tuple[RunConfig, ParallelSizes]], cluster: Cluster, gpus_per_node: int,
                efficiency: float, workers: int | None) -> list[StepTime]:
    """``estimate_step_time`` of every job, in order; split over forked processes when there are many (each
    simulates pipeline schedules, the search's slowest part)."""
    workers = min(workers or os.cpu_count() or 1, max(len(jobs) // PER_WORKER, 1))
    if workers == 1 or "fork" not in multiprocessing.get_all_start_methods():
        return _times_of(jobs, cluster, gpus_per_node, efficiency)
    slices = [jobs[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        parts = list(pool.map(_times_of, slices, [cluster] * workers, [gpus_per_node] * workers,
                              [efficiency] * workers))
    out: list[StepTime | None] = [None] * len(jobs)
    for i, part in enumerate(parts):
        out[i::workers] = part
    return out


def search(config: RunConfig, world: int, cluster: Cluster, gpus_per_node: int, memory_bytes: int | None = None,
           *, fixed: Fixed = Fixed(), top: int = 5, headroom: float = HEADROOM,
           efficiency: float | None = None, workers: int | None = None,
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """Plans of every valid layout; ``top`` fitting ones with their step times, fastest first (module docstring).
    Static bytes are exact for every plan returned (a lower bound rules out the rest first). The step times of
    the fitting layouts are estimated in ``workers`` processes (default: one per CPU). ``progress`` is called
    with a one-line status every few seconds (a search over thousands of GPUs takes minutes)."""
    ladder = {"fixed": fixed.recompute} if fixed.recompute is not None else recompute_ladder(config.model)
    shardings = [fixed.sharding] if fixed.sharding is not None else list(SHARDING)
    usable = int((memory_bytes or cluster.memory_bytes) * (1 - headroom))
    host_usable = int(cluster.host_memory_bytes * (1 - headroom))
    result = SearchResult(plans=[])
    fitting: list[Plan] = []
    started = last = time.monotonic()
    for candidate in candidates(config, world, gpus_per_node, fixed):
        result.considered += 1
        if progress is not None and time.monotonic() - last > PROGRESS_EVERY_S:
            last = time.monotonic()
            progress(f"memory: {result.considered} layouts considered, {len(fitting)} fit ({last - started:.0f} s)")
        try:
            sizes = validate_layout(candidate, world)
            _, num_micro = candidate.resolve(world)
        except ValueError as exc:
            reason = str(exc).split(" (")[0].split(":")[0]
            reason = reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS - 3] + "..."
            result.rejected[reason] = result.rejected.get(reason, 0) + 1
            continue
        result.valid += 1
        plans, leanest = _least_saving(candidate, sizes, num_micro, ladder, usable, host_usable, world, shardings,
                                       gpus_per_node)
        if plans:
            fitting.append(plans)
        elif leanest is not None and (result.closest is None or leanest.memory.total < result.closest.memory.total):
            result.closest = leanest
    result.fitting = len(fitting)
    if progress is not None:
        progress(f"memory: {result.considered} layouts considered, {len(fitting)} fit; estimating their step times "
                 f"({time.monotonic() - started:.0f} s)")
    # a fast estimate of every way each layout fits (the bubble from its expected fraction), then the simulated
    # pipeline clock for the ways of the layouts that estimate ranks first
    fast = [[estimate_step_time(p.config, p.sizes, cluster, gpus_per_node, efficiency, simulate=False).total
             for p in plans] for plans in fitting]
    order = sorted(range(len(fitting)), key=lambda i: min(fast[i]))[:max(SIMULATED_PER_TOP * top, 24)]
    fitting = [fitting[i] for i in order]
    flat = [p for plans in fitting for p in plans]
    times = iter(_step_times([(p.config, p.sizes) for p in flat], cluster, gpus_per_node, efficiency, workers))
    # each layout's ways to fit, fastest first; the layouts by their fastest
    timed = [sorted((dataclasses.replace(p, time=next(times)) for p in plans),
                    key=lambda p: -p.time.tokens_per_s_per_gpu) for plans in fitting]
    timed.sort(key=lambda ways: (-ways[0].time.tokens_per_s_per_gpu, ways[0].memory.total))
    for ways in timed:   # with the exact static bytes (bucket padding, FSDP's gathered units), until ``top`` fit
        for plan in ways:
            exact = dataclasses.replace(plan, memory=_memory(plan.config, plan.sizes, plan.num_micro, True,
                                                                         gpus_per_node))
            if exact.fits:
                result.plans.append(exact)
                break
        if len(result.plans) == top:
            break
    result.plans.sort(key=lambda p: (-p.time.tokens_per_s_per_gpu, p.memory.total))
    return result


