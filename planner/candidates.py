"""The layouts ``moefold plan`` considers (``planner.search`` validates, sizes and times them): every tp, cp,
pp with its stage splits and virtual stages, ep, etp, micro-batch size and pipeline schedule (with or without the
batch-level overlap) of ``world`` GPUs, keeping what the user fixed (``Fixed``), each at the lowest recompute
setting.

The schedules tried (``_schedules``): at pp = 1 plain accumulation and, with ep > 1, the overlap; at pp > 1 1F1B and
ZB-H1 with one chunk per rank, interleaved 1F1B (with and without the overlap) and, when the layers split evenly
over 2 pp chunks, ZB-V and DualPipeV (with and without its FB pairs overlapped). The overlap always comes with
--delay-wgrad-compute (it only removes exposed time). The stage splits (``stage_splits``): the given ones, else per
vpp in ``VIRTUAL_STAGES`` the standard layouts of ``pipeline.layout``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from moefold.parallel.dims import ParallelConfig
from moefold.training.config import RunConfig, TrainConfig

MAX_PP = 64


MICRO_BATCH_SIZES = (1,)   # searched unless --micro-batch-size is given (Megatron's MoE recipes all use 1)


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


def stage_splits(num_layers: int, pp: int, fixed: Fixed, mtp_num_layers: int = 0) -> Iterator[dict]:
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
    """Virtual stages per rank of one split of ``stage_splits``."""
    from moefold.pipeline.layout import parse_layout

    if split.get("pipeline_model_parallel_layout") is not None:
        return max(len(parse_layout(split["pipeline_model_parallel_layout"])) // pp, 1)
    per = split.get("num_layers_per_virtual_pipeline_stage")
    return num_layers // (pp * per) if per else 1


def candidates(config: RunConfig, world: int, gpus_per_node: int, fixed: Fixed) -> Iterator[RunConfig]:
    """Every layout of ``world`` GPUs to consider (not yet validated), at the lowest recompute setting."""
    m, t = config.model, config.train
    experts = max(m.num_experts, 1)
    trains: dict[tuple, TrainConfig] = {}   # the layouts of one split and schedule share their TrainConfig
    if m.v4 is not None and fixed.overlap is None:   # DeepSeek-V4's mHC blocks do not run as overlap pieces
        fixed = dataclasses.replace(fixed, overlap=False)
    for tp in [fixed.tp] if fixed.tp else _divisors(world, gpus_per_node):
        for cp in [fixed.cp] if fixed.cp else _divisors(world // tp, 16):
            for pp in [fixed.pp] if fixed.pp else _divisors(world // (tp * cp), min(MAX_PP, m.num_layers)):
                dense_ranks = world // pp
                for etp in [fixed.etp] if fixed.etp else _divisors(dense_ranks, gpus_per_node):
                    eps = [fixed.ep] if fixed.ep else [e for e in _divisors(experts, dense_ranks // etp)
                                                       if (dense_ranks // etp) % e == 0]
                    for ep in eps:
                        for split in stage_splits(m.num_layers, pp, fixed, m.mtp_num_layers):
                            for schedule in _schedules(m.num_layers, pp, ep, split, fixed):
                                for mbs in [fixed.micro_batch_size] if fixed.micro_batch_size else MICRO_BATCH_SIZES:
                                    pipeline = {"num_layers_per_virtual_pipeline_stage": None,
                                                "decoder_first_pipeline_num_layers": None,
                                                "decoder_last_pipeline_num_layers": None,
                                                "pipeline_model_parallel_layout": None, **split, **schedule}
                                    key = (mbs, tuple(pipeline.items()))
                                    if key not in trains:   # one per split, schedule and micro-batch size
                                        trains[key] = dataclasses.replace(t, micro_batch_size=mbs, **pipeline)
                                    train = trains[key]
                                    yield dataclasses.replace(config, parallel=ParallelConfig(
                                        tp=tp, cp=cp, pp=pp, ep=ep, etp=etp), train=train)
