"""The planner's memory savers past ZeRO-1: activation offloading, FSDP2 and optimizer offload as choices.

- Static bytes: the planner's FSDP2 shards (``planner.static.fsdp_static``, from the stage's meta model) equal
  what the real trainer holds (``static_bytes`` of a ``Trainer`` with ``--use-torch-fsdp2``), byte for byte, at
  dp2 and tp2 x ep2 x dp2 in a 4-rank world; the optimizer offload's device and host bytes equal the real trainer's
  at world 1 (fraction 0.5 and 1); the lower bound never exceeds them.
- Step time: activation offloading adds PCIe time only beyond each action's compute (a slow link shows it, a fast
  one hides it); FSDP2 moves the gradient sync into every micro-batch (``dp`` per action, no step-end sync);
  optimizer offload costs the CPU update beyond what the next forward hides (``offload``).
- The search takes a saver only where it lets a layout fit with less activation saving, picks the fastest way
  each layout fits, says in the report which savers a layout needs, and its train commands carry the flags; a
  host too small for the offloaded states makes a saver not fit, and ``why_not`` says it is host memory.
"""

from __future__ import annotations

import dataclasses

import pytest

from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.planner.cluster import CLUSTERS
from moefold.planner.report import commands, needs, train_flags, why_not
from moefold.planner.search import SHARDING, evaluate, recompute_ladder, search
from moefold.planner.static import exact_static, static_lower_bound
from moefold.planner.step_time import estimate_step_time
from moefold.training.cli import build_parser
from moefold.training.observe.memory import static_bytes
from moefold.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.training.trainer_common import tiny_config

COMPONENTS = ("params", "grads", "exp_avg", "exp_avg_sq")
FSDP_LAYOUTS = {"dp4": ParallelConfig(), "tp2xep2.dp2": ParallelConfig(tp=2, ep=2), "pp2.dp2": ParallelConfig(pp=2)}


def _fsdp_bytes() -> dict:
    out = {}
    for name, pc in FSDP_LAYOUTS.items():
        dims = ParallelDims.build(pc)
        trainer = Trainer(tiny_config(pc, steps=1, use_torch_fsdp2=True), dims, log=lambda _m: None)
        out[name] = (dims.pp_rank, static_bytes(trainer.sync, trainer.optimizer))
    return out


def test_fsdp_static_bytes_equal_the_trainers() -> None:
    measured = run_distributed(_fsdp_bytes, 4, timeout=400)
    for name, pc in FSDP_LAYOUTS.items():
        config = tiny_config(pc, steps=1, use_torch_fsdp2=True)
        sizes, _ = config.resolve(4)
        planned, lower = exact_static(config, sizes), static_lower_bound(config, sizes)
        for rank, per_rank in enumerate(measured):
            pp_rank, counted = per_rank[name]
            plan = dataclasses.asdict(planned[pp_rank])
            assert {k: plan[k] for k in COMPONENTS} == {k: counted[k] for k in COMPONENTS}, (name, rank)
            assert plan["master"] == counted["master"] == 0
            assert lower[pp_rank].total <= planned[pp_rank].total
        assert planned[0].buffers > 0


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_optimizer_offload_static_bytes_equal_the_trainers(fraction: float) -> None:
    config = tiny_config(steps=1, bucket_numel=2048, optimizer_cpu_offload=True, optimizer_offload_fraction=fraction)
    trainer = Trainer(config, ParallelDims.single(), log=lambda _m: None)
    counted = static_bytes(trainer.sync, trainer.optimizer)
    trainer.optimizer.close()
    planned = exact_static(config, config.resolve(1)[0])[0]
    assert (planned.params, planned.grads, planned.optimizer, planned.host) == (
        counted["params"], counted["grads"], counted["optimizer"], counted["host_optimizer"])
    assert planned.host > 0
    assert static_lower_bound(config, config.resolve(1)[0])[0].total <= planned.total


# ----------------------------------------------------------------------------------------------- step time
def _big(**train) -> object:
    """Qwen3-30B-A3B's recipe at tp2 x cp2 x pp2 x ep4 on 8 GPUs (docs/planner.md's first example)."""
    from moefold.models.recipes import get_recipe
    from moefold.training.config import RunConfig, TrainConfig

    t = TrainConfig(micro_batch_size=1, global_batch_size=512, seq_length=4096, bf16=True, lr_warmup_iters=0, **train)
    return RunConfig(model=get_recipe("qwen3_moe_30b_a3b"), parallel=ParallelConfig(tp=2, cp=2, pp=2, ep=4),
                     options=ModelOptions(dtype="bf16"), train=t, recipe="qwen3_moe_30b_a3b")


def test_step_time_terms_of_the_savers() -> None:
    base = _big()
    sizes, _ = base.resolve(8)
    h100 = CLUSTERS["h100"]
    plain = estimate_step_time(base, sizes, h100, 8)
    assert plain.terms["offload"] == 0.0
    offload = dataclasses.replace(base, options=dataclasses.replace(
        base.options, **recompute_ladder(base.model)["offload"]))
    fast = estimate_step_time(offload, sizes, h100, 8)
    slow = estimate_step_time(offload, sizes, dataclasses.replace(h100, pcie_gbps=0.5), 8)
    assert fast.terms["offload"] < slow.terms["offload"] and slow.terms["offload"] > 0
    fsdp = estimate_step_time(dataclasses.replace(base, train=dataclasses.replace(base.train, use_torch_fsdp2=True)),
                              sizes, h100, 8)
    assert fsdp.terms["dp"] > plain.terms["dp"]   # every micro-batch gathers and reduce-scatters
    cpu = estimate_step_time(_big(optimizer_cpu_offload=True), sizes, h100, 8)
    assert cpu.terms["offload"] > 0
    half = estimate_step_time(_big(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5), sizes, h100, 8)
    assert half.terms["offload"] < cpu.terms["offload"]


# ----------------------------------------------------------------------------------------------- search
def test_the_fixed_layout_needs_and_commands() -> None:
    """The planner page's Qwen3-30B-A3B layout fits under ZeRO-1 only with full recompute; optimizer offload lets it run
    without recompute, faster; the report says so and the command carries the flags, which `moefold train` parses."""
    base = _big()
    h100 = CLUSTERS["h100"]
    zero1 = evaluate(dataclasses.replace(base, options=dataclasses.replace(
        base.options, **recompute_ladder(base.model)["full"])), 8, h100, 8, recompute="full")
    cpu = evaluate(_big(**SHARDING["cpu-adam"]), 8, h100, 8, recompute="none")
    assert zero1.fits and cpu.fits and not evaluate(base, 8, h100, 8).fits
    assert cpu.time.tokens_per_s_per_gpu > zero1.time.tokens_per_s_per_gpu
    assert needs(cpu) == "optimizer offload" and needs(zero1) == "full recompute"
    flags = train_flags(cpu, ["--recipe", "qwen3_moe_30b_a3b"])
    assert flags[-3:] == ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1"]
    local, _ = commands(cpu, ["--recipe", "qwen3_moe_30b_a3b"], 8)
    argv = local.split()[1:]
    assert argv[0] == "train"
    build_parser("train").parse_args(argv)
    small_host = dataclasses.replace(h100, host_memory_bytes=10 * 10**9)
    cramped = evaluate(_big(**SHARDING["cpu-adam"]), 8, small_host, 8, recompute="none")
    assert cramped.fits_gpu and not cramped.fits
    assert "host memory" in why_not(cramped)


def test_search_picks_a_saver_only_where_it_helps() -> None:
    from moefold.planner.candidates import Fixed

    base = _big()
    fixed = Fixed(tp=2, cp=2, pp=2, ep=4, etp=1, layers_per_virtual_stage=None, micro_batch_size=1)
    result = search(base, 8, CLUSTERS["h100"], 8, fixed=fixed, top=3, workers=1)
    assert result.plans and result.plans[0].sharding == "cpu-adam" and result.plans[0].recompute == "none"
    roomy = search(base, 8, dataclasses.replace(CLUSTERS["h100"], memory_bytes=400 * 10**9), 8, fixed=fixed, top=3,
                   workers=1)
    assert roomy.plans[0].sharding == "zero1" and roomy.plans[0].recompute == "none"   # nothing needed


def test_search_skips_the_savers_the_schedules_refuse() -> None:
    """FSDP2 with the overlap or a split backward, activation offloading with the overlap: ``moefold train`` refuses
    them (``RunConfig.memory_saver_conflict``), so the search never plans them; FSDP2 still plans 1F1B/interleaved."""
    from moefold.planner.candidates import Fixed

    base = _big()
    layout = dict(tp=2, cp=2, pp=2, ep=4, etp=1, micro_batch_size=1)
    roomy = dataclasses.replace(CLUSTERS["h100"], memory_bytes=400 * 10**9)
    result = search(base, 8, roomy, 8, fixed=Fixed(**layout, sharding="fsdp"), top=20, workers=1)
    assert {p.schedule for p in result.plans} == {"1f1b", "interleaved"}
    for plan in result.plans:
        t = plan.config.train
        assert plan.sharding == "fsdp" and not t.overlap_moe_expert_parallel_comm, plan.schedule
        assert t.pipeline_schedule not in ("zb-h1", "zbv", "dualpipev"), plan.schedule
    offload = recompute_ladder(base.model)["offload"]
    # pp2: the overlap comes only with the schedules that can run it (interleaved, dualpipev); none is planned with
    # offloading, the ones without the overlap are
    planned = search(base, 8, roomy, 8, fixed=Fixed(**layout, overlap=True, recompute=offload), top=20, workers=1)
    assert planned.plans and {p.schedule for p in planned.plans} <= {"1f1b", "zb-h1", "zbv"}
    # pp1: the overlap is the only schedule, so nothing is left
    refused = search(base, 8, roomy, 8, fixed=Fixed(**{**layout, "pp": 1}, overlap=True, recompute=offload), top=5,
                     workers=1)
    assert refused.valid > 0 and not refused.plans and refused.closest is None
