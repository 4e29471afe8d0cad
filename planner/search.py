"""The layouts ``moefold plan`` considers, the memory each needs per rank, and which of them fit and run fastest.

``evaluate(config, world, ...)`` plans one layout (the one ``config.parallel`` and its options describe):

- memory per rank, for every pipeline stage, by component: parameters, main gradients, optimizer states
  (``planner.static``: a lower bound first, then the exact bytes of the trainer's own buffers built on the
  meta device for the layouts that may fit), activations (``planner.profile``: the modules' saved tensors
  walked through the schedule's action lists) and DeepEP's buffer with the flex dispatcher
  (``planner.deepep``). The stage with the largest total is the layout's requirement; it fits when that
  total is at most the GPU's memory less ``headroom`` (the CUDA context, NCCL's buffers and the caching
  allocator's fragmentation, which the model does not count);
- the step time (``planner.step_time.estimate_step_time``), for a layout that fits.

``search`` plans each layout from formulas (``search(exact=False)``, ``moefold plan``'s default): the static bytes
per layer kind without the buckets' padding, the activations held as each schedule's warm-up count says
(``planner.inflight``), the pipeline clock in closed form (``pipeline_clock.formula_makespan``);
``tests/planner/test_formula.py`` bounds each against its oracle. ``exact=True`` (``--exact``) re-plans the
leading layouts with the meta build, the walked action lists and the simulated clock, as ``evaluate`` does.

``search`` enumerates every layout of ``world`` GPUs (tp, cp, pp with its stage split and virtual stages, ep,
etp, the micro-batch size, the pipeline schedule with or without the batch-level overlap, and the recompute
setting) that ``moefold train`` would accept (``validate_layout``), keeping what the user fixed; for each layout
it takes the least activation saving that fits (``recompute_ladder``: more recompute never runs faster), and ranks
what fits by tokens/s/GPU. Branch and bound: layouts are planned in the order of a lower bound of their step
(``planner.step_bound``, at the first rung: the least of the rungs'); once the ``top`` fastest steps are known, a
layout whose bound is above them is not planned, and a fitting way (rung and saver) whose own bound is above them is
not timed. The layouts and schedules tried: ``planner.candidates``.

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

import bisect
import dataclasses
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from moefold.models.config import ModelConfig
from moefold.parallel.dims import ParallelSizes
from moefold.planner.activations import ActivationMemory
from moefold.planner.candidates import Fixed, candidates
from moefold.planner.cluster import Cluster
from moefold.planner.deepep import deepep_buffer_bytes
from moefold.planner.profile import activation_memories
from moefold.planner.static import StaticMemory, exact_static, layout_of, static_lower_bound
from moefold.planner.step_bound import step_lower_bound
from moefold.planner.step_terms import StepTime
from moefold.planner.step_time import estimate_step_time
from moefold.training.cli.train import validate_layout
from moefold.training.config import RunConfig

HEADROOM = 0.1           # share of the GPU's memory left for what the model does not count (module docstring)
PROGRESS_EVERY_S = 0.5   # between the search's progress reports
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
        return self.fits_gpu and self.fits_host

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
        return layout_of(self.config, self.sizes.pp).vpp if self.sizes.pp > 1 else 1

    @property
    def schedule(self) -> str:
        """The schedule ``moefold train`` runs (``+ov``: with the batch-level overlap; pp = 1: "-" or "overlap")."""
        overlap = self.config.train.overlap_moe_expert_parallel_comm
        if self.sizes.pp == 1:
            return "overlap" if overlap else "-"
        return self.config.schedule_name(self.vpp) + ("+ov" if overlap else "")


def _memory(config: RunConfig, sizes: ParallelSizes, num_micro: int, exact: bool, gpus_per_node: int,
            walk: bool = True) -> RankMemory:
    """The fullest stage's memory; ``exact``: static bytes from the meta build (else the formula);
    ``walk``: activations from the schedule's action lists (else ``planner.inflight``'s closed form)."""
    static = (exact_static if exact else static_lower_bound)(config, sizes)
    flex = config.options.resolved_dispatcher(sizes.ep, sizes.etp) == "flex"
    deepep = deepep_buffer_bytes(config, sizes, gpus_per_node) if flex else 0
    activations = activation_memories(config, sizes, num_micro, exact=walk)
    ranks = [RankMemory(r, static[r], activations[r], deepep) for r in range(sizes.pp)]
    return max(ranks, key=lambda m: m.total)


def stage_memory(plan: Plan, exact: bool = True) -> list[RankMemory]:
    """Every pipeline stage's memory per GPU for ``plan``, in pipeline order (``exact``: the meta build and the
    walked schedule, else the formulas, as ``_memory``)."""
    config, sizes = plan.config, plan.sizes
    static = (exact_static if exact else static_lower_bound)(config, sizes)
    flex = config.options.resolved_dispatcher(sizes.ep, sizes.etp) == "flex"
    deepep = deepep_buffer_bytes(config, sizes) if flex else 0
    activations = activation_memories(config, sizes, plan.num_micro, exact=exact)
    return [RankMemory(r, static[r], activations[r], deepep) for r in range(sizes.pp)]


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


@dataclass
class SearchResult:
    """The fitting plans, fastest first; the counts of what was considered (``fitting``: of the layouts planned;
    ``unranked`` valid layouts were not planned, branch and bound); the best non-fitting plan (the one needing the
    least memory) when nothing fits."""

    plans: list[Plan]
    considered: int = 0
    valid: int = 0
    fitting: int = 0
    closest: Plan | None = None
    rejected: dict[str, int] = field(default_factory=dict)
    unranked: int = 0   # valid layouts not planned: their step's lower bound is above the steps of those printed


def _least_recompute(candidate: RunConfig, sizes: ParallelSizes, num_micro: int, ladder: dict[str, dict],
                     usable: int, gpus_per_node: int, host_usable: int | None = None, walk: bool = True,
                     shared: dict | None = None) -> tuple[Plan | None, Plan | None]:
    """(the plan with the least activation saving of ``ladder`` that fits, or None; the leanest plan, None when
    ``moefold train`` refuses every rung with this layout). The leanest is tried first: when it does not fit,
    nothing does (host memory aside: the offload rung may be the only one that does not fit there). A rung
    ``moefold train`` refuses with the candidate's schedule (the offload rung with the batch-level overlap) is
    skipped. ``shared``: what one layout's shardings share (each rung's activations: they do not depend on what
    shards the static memory, ``profile.activation_memories``; DeepEP's buffer), filled here;
    the static bytes do not depend on the rung, so they are counted once per sharding."""
    shared = {} if shared is None else shared
    configs: dict[str, RunConfig] = {}

    def planned(name: str) -> RunConfig:
        if name not in configs:
            configs[name] = dataclasses.replace(candidate, options=_rung_options(candidate.options, name, ladder))
        return configs[name]

    names = [name for name in ladder if not planned(name).memory_saver_conflict(sizes.pp)]
    if not names:
        return None, None
    static = static_lower_bound(candidate, sizes)
    if "deepep" not in shared:
        flex = candidate.options.resolved_dispatcher(sizes.ep, sizes.etp) == "flex"
        shared["deepep"] = deepep_buffer_bytes(candidate, sizes, gpus_per_node) if flex else 0

    def plan_of(name: str) -> Plan:
        config = planned(name)
        if ("activations", name) not in shared:
            shared[("activations", name)] = activation_memories(config, sizes, num_micro, exact=walk)
        activations = shared[("activations", name)]
        memory = max((RankMemory(r, static[r], activations[r], shared["deepep"]) for r in range(sizes.pp)),
                     key=lambda m: m.total)
        return Plan(config, sizes, num_micro, name, memory, usable, host_usable=host_usable)

    leanest = plan_of(names[-1])
    if not leanest.fits_gpu:
        return None, leanest
    for name in names[:-1]:
        plan = plan_of(name)
        if plan.fits_gpu and plan.fits_host:
            return plan, leanest
    return (leanest, leanest) if leanest.fits_host else (None, leanest)


_RUNGS: dict[tuple, tuple] = {}   # (id(options), rung, ladder's fields) -> (options, options at that rung)


def _rung_options(options, name: str, ladder: dict[str, dict]):
    """``options`` at the ladder's rung ``name``, made once per options object and rung (a search's candidates share
    one options object: each rung's options are made once per search, not once per layout)."""
    key = (id(options), name, tuple(ladder[name].items()))
    entry = _RUNGS.get(key)
    if entry is None or entry[0] is not options:
        if len(_RUNGS) > 4096:
            _RUNGS.clear()
        entry = _RUNGS[key] = (options, dataclasses.replace(options, **ladder[name]))
    return entry[1]


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
                  host_usable: int, world: int, shardings: list[str], gpus_per_node: int,
                  walk: bool = True) -> tuple[list[Plan], Plan]:
    """The plans worth timing for one layout (module docstring) and its leanest plan (the closest when none fits)."""
    rungs = list(ladder)
    plans, closest, best = [], None, len(rungs)
    shared: dict = {}
    for name in shardings:
        config = candidate if name == sharding_of(candidate) else _with_sharding(candidate, name, world)
        if config is None or config.memory_saver_conflict(sizes.pp):
            continue
        fits, leanest = _least_recompute(config, sizes, num_micro, ladder, usable, gpus_per_node, host_usable, walk,
                                         shared)
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
              efficiency: float, simulate: bool = True) -> list[StepTime]:
    return [estimate_step_time(c, s, cluster, gpus_per_node, efficiency, simulate=simulate) for c, s in jobs]


def _step_times(jobs: list[tuple[RunConfig, ParallelSizes]], cluster: Cluster, gpus_per_node: int,
                efficiency: float, workers: int | None, simulate: bool = True) -> list[StepTime]:
    """``estimate_step_time`` of every job, in order; with ``simulate`` split over forked processes when there are
    many (each simulates pipeline schedules, the exact mode's slowest part)."""
    workers = min(workers or os.cpu_count() or 1, max(len(jobs) // PER_WORKER, 1))
    if not simulate or workers == 1 or "fork" not in multiprocessing.get_all_start_methods():
        return _times_of(jobs, cluster, gpus_per_node, efficiency, simulate)
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
           efficiency: float | None = None, workers: int | None = None, exact: bool = False,
           progress: Callable[[str, int, int], None] | None = None) -> SearchResult:
    """Plans of every valid layout; ``top`` fitting ones with their step times, fastest first (module docstring).
    By default every layout's memory and time come from formulas: static bytes counted per layer kind
    (``static.static_lower_bound``: the exact count without the buckets' padding), activations held as the
    schedule's warm-up counts say (``planner.inflight``), the pipeline clock in closed form
    (``pipeline_clock.formula_makespan``). ``exact``: the fastest layouts by the formulas (``SIMULATED_PER_TOP`` per
    plan printed) are then re-planned with the trainer's buffers built on the meta device, the action lists walked
    and the clock simulated (in ``workers`` processes, default one per CPU), and ranked by that. ``progress`` is
    called with (phase, done, total) every ``PROGRESS_EVERY_S`` seconds and at each phase's end."""
    ladder = {"fixed": fixed.recompute} if fixed.recompute is not None else recompute_ladder(config.model)
    shardings = [fixed.sharding] if fixed.sharding is not None else list(SHARDING)
    usable = int((memory_bytes or cluster.memory_bytes) * (1 - headroom))
    host_usable = int(cluster.host_memory_bytes * (1 - headroom))
    result = SearchResult(plans=[])
    last = time.monotonic()

    def report(phase: str, done: int, total: int) -> None:
        nonlocal last
        if progress is not None and (done == total or time.monotonic() - last > PROGRESS_EVERY_S):
            last = time.monotonic()
            progress(phase, done, total)

    layouts = list(candidates(config, world, gpus_per_node, fixed))
    valid = []
    first_rung: dict[int, tuple] = {}   # id(options) -> (options, options at the ladder's first rung)
    for candidate in layouts:
        result.considered += 1
        report("layouts", result.considered, len(layouts))
        try:
            sizes = validate_layout(candidate, world)   # (it resolves the layout: the micro-batches per step follow)
            num_micro = candidate.train.global_batch_size // (candidate.train.micro_batch_size * sizes.dp)
        except ValueError as exc:
            reason = str(exc).split(" (")[0].split(":")[0]
            reason = reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS - 3] + "..."
            result.rejected[reason] = result.rejected.get(reason, 0) + 1
            continue
        # a lower bound on the step of every way this layout may fit: its first rung (the least recompute) and any
        # sharding (``planner.step_bound``: the busiest rank's block compute and unhidden TP/CP/EP communication)
        if id(candidate.options) not in first_rung:   # the candidates share one options object: one replace
            first_rung[id(candidate.options)] = (candidate.options, dataclasses.replace(
                candidate.options, **next(iter(ladder.values()))))
        fastest = dataclasses.replace(candidate, options=first_rung[id(candidate.options)][1])
        valid.append((step_lower_bound(fastest, sizes, cluster, num_micro, efficiency, gpus_per_node), candidate, sizes,
                      num_micro))
    result.valid = len(valid)
    # branch and bound: plan the layouts in the order of their bounds; once a layout's bound is above the
    # ``needed``-th fastest step planned so far, neither it nor any after it can rank
    needed = max(SIMULATED_PER_TOP * top, 24) if exact else top
    valid.sort(key=lambda v: v[0])
    timed: list[list[Plan]] = []
    steps: list[float] = []   # each fitting layout's fastest step, ascending
    for n, (bound, candidate, sizes, num_micro) in enumerate(valid):
        report("memory and step times", n + 1, len(valid))
        if len(steps) >= needed and bound > steps[needed - 1]:
            result.unranked = len(valid) - n
            report("memory and step times", len(valid), len(valid))
            break
        plans, leanest = _least_saving(candidate, sizes, num_micro, ladder, usable, host_usable, world, shardings,
                                       gpus_per_node, walk=False)
        if not plans:
            if leanest is not None and (result.closest is None or
                                        leanest.memory.total < result.closest.memory.total):
                result.closest = leanest
            continue
        result.fitting += 1
        if len(steps) >= needed:   # a way whose own bound (rung and saver) is above the needed-th step is not timed
            plans = [p for p in plans if step_lower_bound(p.config, sizes, cluster, num_micro, efficiency,
                                                          gpus_per_node) <= steps[needed - 1]]
            if not plans:
                continue
        ways = sorted((dataclasses.replace(p, time=estimate_step_time(p.config, p.sizes, cluster, gpus_per_node,
                                                                      efficiency, simulate=False))
                       for p in plans), key=lambda p: -p.time.tokens_per_s_per_gpu)
        timed.append(ways)
        bisect.insort(steps, ways[0].time.total)
    # each layout's ways to fit, fastest first; the layouts by their fastest
    timed.sort(key=lambda ways: (-ways[0].time.tokens_per_s_per_gpu, ways[0].memory.total))
    if not exact:
        result.plans = [ways[0] for ways in timed[:top]]
        return result
    timed = timed[:max(SIMULATED_PER_TOP * top, 24)]
    flat = [p for ways in timed for p in ways]
    report("exact", 0, len(flat))
    times = iter(_step_times([(p.config, p.sizes) for p in flat], cluster, gpus_per_node, efficiency, workers))
    timed = [sorted((dataclasses.replace(p, time=next(times)) for p in ways),
                    key=lambda p: -p.time.tokens_per_s_per_gpu) for ways in timed]
    timed.sort(key=lambda ways: (-ways[0].time.tokens_per_s_per_gpu, ways[0].memory.total))
    for ways in timed:   # with the exact bytes (bucket padding, FSDP's gathered units, the walked peak), until top fit
        for plan in ways:
            exact_plan = dataclasses.replace(plan, memory=_memory(plan.config, plan.sizes, plan.num_micro, True,
                                                                  gpus_per_node))
            if exact_plan.fits:
                result.plans.append(exact_plan)
                break
        if len(result.plans) == top:
            break
    report("exact", len(flat), len(flat))
    result.plans.sort(key=lambda p: (-p.time.tokens_per_s_per_gpu, p.memory.total))
    return result
