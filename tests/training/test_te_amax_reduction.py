"""``--fp8-backend te`` with delayed scaling: the amax all-reduces Transformer Engine issues, counted by the TE
stand-in (tests/moe/te_standin.py keeps TE's FP8 global state: a forward reduction at each outermost autocast
exit, a backward one in the region's first module's backward, each over the region's group).

What must hold on real GPUs (else TE hangs or deadlocks): every rank of a pipeline stage's dp x cp x tp group
issues the same reductions, in the same order and of the same size, on that group (never the world), one
forward and one backward per micro-batch; a rank whose experts got no rows included. Each layout trains two
steps with the expert bias of the second ep rank's experts pushed to -1e3, so those experts never get a row.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.precision.fp8 import FP8Config
from moefold.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.moe import te_standin
from tests.training.trainer_common import tiny_config, tiny_data

STEPS = 2
LAYOUTS = (  # world 4: pipeline stages of 2 ranks; tensor parallel; full recompute (replays TE in backward)
    ("pp2 ep2", ParallelConfig(pp=2, ep=2), "none"),
    ("tp2 dp2 ep2", ParallelConfig(tp=2, ep=2), "none"),
    ("tp2 dp2 ep2 full recompute", ParallelConfig(tp=2, ep=2), "full"),
)


def _run_layouts() -> list[dict]:
    out = []
    for name, parallel, recompute in LAYOUTS:
        te_standin.reset()
        config = tiny_config(parallel, steps=STEPS, recipe="deepseek_v3_tiny")
        options = ModelOptions(gemm_backend="te", fp8=FP8Config("hybrid", "delayed", backend="te"),
                               recompute=recompute)
        config = dataclasses.replace(config, options=options)
        dims = ParallelDims.build(parallel)
        trainer = Trainer(config, dims, log=lambda _m: None)
        for router in trainer.routers.values():
            with torch.no_grad():   # experts of ep rank 1 never selected: that rank's experts get no rows
                router.expert_bias[router.expert_bias.numel() // 2:] = -1e3
        experts_rows = None
        trainer.fit(tiny_data(), stop_at=STEPS)
        grouped = te_standin.GroupedLinear.instances
        if grouped:
            experts_rows = sum(sum(call["m_splits"]) for g in grouped for call in g.forward_calls)
        te_calls = [call["recipe"] for g in grouped for call in g.forward_calls]
        te_calls += [recipe for lin in te_standin.Linear.instances for recipe in lin.calls]
        out.append({"layout": name, "rank": dist.get_rank(), "stage_group": tuple(dist.get_process_group_ranks(
                    dims.tp_cp_dp_group)), "reductions": list(te_standin._State.reductions),
                    "experts_rows": experts_rows, "num_micro": trainer.num_micro,
                    "te_calls_outside_fp8": sum(r is None for r in te_calls), "te_calls": len(te_calls)})
    return out


def test_delayed_scaling_amax_reductions_match_on_the_stage_group(monkeypatch):
    te_standin.install(monkeypatch)   # forked ranks inherit the stand-in
    per_rank = run_distributed(_run_layouts, 4, timeout=300)
    for i, (name, _parallel, recompute) in enumerate(LAYOUTS):
        runs = [ranks[i] for ranks in per_rank]
        assert any(r["experts_rows"] == 0 for r in runs), f"{name}: no rank ran its experts with 0 rows: {runs}"
        for r in runs:
            where = f"{name}, rank {r['rank']}"
            assert r["te_calls"] > 0 and r["te_calls_outside_fp8"] == 0, f"{where}: TE ran outside FP8: {r}"
            groups = {red.group for red in r["reductions"]}
            assert groups == {r["stage_group"]}, f"{where}: reduced over {groups}, not the stage {r['stage_group']}"
            directions = [red.direction for red in r["reductions"]]
            if recompute == "none":   # one forward + one backward reduction per micro-batch forward of the stage
                assert sorted(directions) == ["backward"] * (STEPS * r["num_micro"]) + \
                    ["forward"] * (STEPS * r["num_micro"]), f"{where}: {directions}"
            peers = [p for p in runs if p["stage_group"] == r["stage_group"]]
            assert all(p["reductions"] == r["reductions"] for p in peers), \
                f"{where}: the stage's ranks issue different reductions: {[p['reductions'] for p in peers]}"
