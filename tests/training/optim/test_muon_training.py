"""Training with ``--optimizer muon``: pipeline, tensor, context and expert layouts equal world 1 (one 4-rank world);
a resume through another layout (dp4 -> world 1 -> dp4: every matrix changes owner) is bit-identical, bf16 masters
and momenta included."""

from __future__ import annotations

import torch

from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.optim.muon import DistributedMuon
from tests.distributed import run_distributed
from tests.training.trainer_common import run, tiny_config

STEPS = 2
TOL = 1e-4   # absolute, on losses and weights after 2 steps (fp32), as tests/training/test_trainer_layouts.py
# tp-split matrices gathered whole (duplicated) and the iteration in fp32: a layout computes world 1's update
MUON = {"optimizer_type": "muon", "muon_tp_mode": "duplicated", "muon_fp32_matmul_prec": "highest"}
# MuonClip with a threshold inside the tiny model's logit range (0.06-0.09 at init): some kv groups clip each step
QK_CLIP = {"recipe": "mixtral_tiny", "qk_clip": True, "qk_clip_threshold": 0.07}
# (etp and the tp modes at every layout: test_muon.py's optimizer-level comparison, without the model's cost)
LAYOUTS = {"pp2xtp2": (ParallelConfig(pp=2, tp=2), {}), "cp2xep2.dp2": (ParallelConfig(cp=2, ep=2), {}),
           "mixtral.qk_clip.tp2.dp2": (ParallelConfig(tp=2), QK_CLIP)}


def _layouts(_unused: int) -> dict:
    out = {}
    for name, (pc, kwargs) in LAYOUTS.items():
        losses, params, trainer = run(tiny_config(pc, steps=STEPS, **MUON, **kwargs), ParallelDims.build(pc))
        assert isinstance(trainer.optimizer, DistributedMuon)
        out[name] = {"losses": losses, "params": params, "owned": len(trainer.optimizer.matrices)}
    return out


def test_layouts_equal_world_1():
    ranks = run_distributed(_layouts, 4, 0, timeout=400)
    for name, (_, kwargs) in LAYOUTS.items():
        losses, params, trainer = run(tiny_config(steps=STEPS, **MUON, **kwargs))
        # the last pipeline stage reports the losses; every rank gathers its stage's full parameters
        got = [r[name]["losses"] for r in ranks if r[name]["losses"]]
        assert got and all(max(abs(a - b) for a, b in zip(g, losses)) <= TOL for g in got), (name, got, losses)
        assert set().union(*(r[name]["params"] for r in ranks)) == set(params), name
        for r in ranks:
            worst = max((v - params[k]).abs().max().item() for k, v in r[name]["params"].items())
            assert worst <= TOL, (name, worst)
        # the matrices are shared out: no rank of a dp/edp group of >= 2 owns them all
        if name == "cp2xep2.dp2":
            assert all(r[name]["owned"] < len(trainer.optimizer.matrices) for r in ranks), name
    # the clip did act: without it the query projections end elsewhere
    _, unclipped, _ = run(tiny_config(steps=STEPS, **MUON, **{**QK_CLIP, "qk_clip": False}))
    q = "layers.0.self_attn.q_proj.weight"
    assert (unclipped[q] - params[q]).abs().max() > 100 * TOL


# ----------------------------------------------------------------------------------------------- resume
RESUME = {**MUON, "bf16": True}


def _leg(root: str, load: str | None, save: str | None, stop_at: int | None) -> dict:
    losses, params, _ = run(tiny_config(steps=4, save=save, **RESUME), ParallelDims.build(ParallelConfig()),
                            load=load, stop_at=stop_at)
    return {"losses": losses, "params": params}


def test_resume_through_world_1_is_bit_identical(tmp_path):
    root = str(tmp_path)
    run_distributed(_leg, 4, root, None, f"{root}/a", 2, timeout=300)          # dp4: 2 steps, saved
    run(tiny_config(steps=4, save=f"{root}/b", **RESUME), load=f"{root}/a", stop_at=2)   # world 1: load, save
    resumed = run_distributed(_leg, 4, root, f"{root}/b", None, None, timeout=300)
    full = run_distributed(_leg, 4, root, None, None, None, timeout=300)
    for r, f in zip(resumed, full):
        assert r["losses"] == f["losses"][2:]
        assert r["params"].keys() == f["params"].keys()
        for k, v in r["params"].items():
            assert torch.equal(v, f["params"][k]), k
