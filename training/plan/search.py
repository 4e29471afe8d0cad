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
it takes the least recompute that fits (more recompute never runs faster), and ranks what fits by tokens/s/GPU.
The schedules tried (``_schedules``): at pp = 1 plain accumulation and, with ep > 1, the overlap; at pp > 1 1F1B
and ZB-H1 with one chunk per rank, interleaved 1F1B (with and without the overlap) and, when the layers split
evenly over 2 pp chunks, ZB-V and DualPipeV (with and without its FB pairs overlapped). The overlap always comes
with --delay-wgrad-compute (it only removes exposed time).
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
REASON_CHARS = 90         # rejection reasons are grouped by their first characters
COMPONENTS = ("params", "main grads", "optimizer", "activations", "deepep")


def recompute_ladder(model: ModelConfig) -> dict[str, dict]:
    """Recompute settings from the fastest to the leanest (ModelOptions fields): none; Megatron's default
    selective (core attention); selective of every cheap module (core attention, norms, the MoE activation, MLA's
    up-projections); full recompute of every layer."""
    cheap = ("core_attn", "layernorm", "moe_act") + (("mla_up_proj",) if model.attention == "mla" else ())
    return {"none": {"recompute": "none"},
            "selective": {"recompute": "selective", "recompute_modules": ("core_attn",)},
            "selective+": {"recompute": "selective", "recompute_modules": cheap},
            "full": {"recompute": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank of pipeline stage ``pp_rank`` needs, by component."""

    pp_rank: int
    static: StaticMemory
    activations: ActivationMemory
    deepep: int = 0

    @property
    def components(self) -> dict[str, int]:
        s = self.static
        return {"params": s.params, "main grads": s.grads, "optimizer": s.optimizer,
                "activations": self.activations.peak, "deepep": self.deepep}

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

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable and self.memory.static.exact

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
    plan = Plan(config, sizes, num_micro, recompute or config.options.recompute, memory, usable)
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
    micro_batch_size: int | None = None
    recompute: dict | None = None        # ModelOptions fields
    schedule: str | None = None          # --pipeline-schedule
    overlap: bool | None = None          # --overlap-moe-expert-parallel-comm


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _stage_splits(num_layers: int, pp: int, fixed: Fixed) -> Iterator[dict]:
    """TrainConfig fields of the pipeline splits tried at ``pp``: even (and 2 virtual stages when each stage's
    layers are even) or, when the layers do not divide, the first and last stages taking the remainder."""
    if pp == 1:
        yield {}
        return
    if fixed.layers_per_virtual_stage is not None:
        yield {"num_layers_per_virtual_pipeline_stage": fixed.layers_per_virtual_stage}
        return
    if num_layers % pp == 0:
        yield {}
        per = num_layers // pp
        if per % 2 == 0:
            yield {"num_layers_per_virtual_pipeline_stage": per // 2}
        return
    per = -(-num_layers // pp)
    while per >= 1:
        rest = num_layers - per * (pp - 2)
        first, last = rest - rest // 2, rest // 2
        if last >= 1 and first <= per:
            yield {"decoder_first_pipeline_num_layers": first, "decoder_last_pipeline_num_layers": last}
            return
        per -= 1


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
    elif split.get("num_layers_per_virtual_pipeline_stage") is None:
        for schedule in ("1f1b", "zb-h1", "gpipe") if fixed.schedule == "gpipe" else ("1f1b", "zb-h1"):
            yield from with_overlap(schedule, False)
    else:
        yield from with_overlap("1f1b", True)   # interleaved (implied by the virtual stages)
        if num_layers == 2 * pp * split["num_layers_per_virtual_pipeline_stage"]:   # 2 chunks per rank: V placed
            yield from with_overlap("zbv", False)
            yield from with_overlap("dualpipev", True)


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
                        for split in _stage_splits(m.num_layers, pp, fixed):
                            for schedule in _schedules(m.num_layers, pp, ep, split, fixed):
                                for mbs in [fixed.micro_batch_size] if fixed.micro_batch_size else MICRO_BATCH_SIZES:
                                    pipeline = {"num_layers_per_virtual_pipeline_stage": None,
                                                "decoder_first_pipeline_num_layers": None,
                                                "decoder_last_pipeline_num_layers": None, **split, **schedule}
                                    train = dataclasses.replace(t, micro_batch_size=mbs, **pipeline)
                                    yield dataclasses.replace(config, parallel=ParallelConfig(
                                        tp=tp, cp=cp, pp=pp, ep=ep, etp=etp), train=train)


def _least_recompute(candidate: RunConfig, sizes: ParallelSizes, num_micro: int, ladder: dict[str, dict],
                     usable: int, gpus_per_node: int) -> tuple[Plan | None, Plan]:
    """(the plan with the least recompute of ``ladder`` that fits, or None; the leanest plan). The leanest is
    tried first: when it does not fit, nothing does."""
    def plan_of(name: str) -> Plan:
        planned = dataclasses.replace(candidate, options=dataclasses.replace(candidate.options, **ladder[name]))
        return Plan(planned, sizes, num_micro, name, _memory(planned, sizes, num_micro, False, gpus_per_node), usable)

    names = list(ladder)
    leanest = plan_of(names[-1])
    if leanest.memory.total > usable:
        return None, leanest
    for name in names[:-1]:
        plan = plan_of(name)
        if plan.memory.total <= usable:
            return plan, leanest
    return leanest, leanest


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
    usable = int((memory_bytes or cluster.memory_bytes) * (1 - headroom))
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
        fits, leanest = _least_recompute(candidate, sizes, num_micro, ladder, usable, gpus_per_node)
        if fits is not None:
            fitting.append(fits)
        elif result.closest is None or leanest.memory.total < result.closest.memory.total:
            result.closest = leanest
    result.fitting = len(fitting)
    if progress is not None:
        progress(f"memory: {result.considered} layouts considered, {len(fitting)} fit; estimating their step times "
                 f"({time.monotonic() - started:.0f} s)")
    times = _step_times([(p.config, p.sizes) for p in fitting], cluster, gpus_per_node, efficiency, workers)
    timed = [dataclasses.replace(plan, time=time) for plan, time in zip(fitting, times)]
    timed.sort(key=lambda p: (-p.time.tokens_per_s_per_gpu, p.memory.total))
    for plan in timed:   # the exact static bytes (bucket padding) of the fastest, until ``top`` still fit
        exact = dataclasses.replace(plan, memory=_memory(plan.config, plan.sizes, plan.num_micro, True, gpus_per_node))
        if exact.fits:
            result.plans.append(exact)
        if len(result.plans) == top:
            break
    return result


