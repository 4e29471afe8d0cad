"""The same tiny 5-step fp32 run at world 1 and at tp2, ep2, etp2, cp2, dp, tp2 x ep2, pp2 (1F1B) x tp2 and
pp2 (GPipe) x ep2, pp2 x 2 virtual stages (interleaved 1F1B, 4 layers), with the ZeRO-1 optimizer
everywhere: same losses and same final weights, to TOL."""

from __future__ import annotations

import dataclasses

import torch

from parallel.dims import ParallelConfig, ParallelDims
from tests.distributed import run_distributed
from tests.training.trainer_common import run, tiny_config

TOL = 1e-4  # absolute, on losses and on every final weight (fp32)

LAYOUTS = {
    "tp2.dp2": ParallelConfig(tp=2),
    "ep2.dp4": ParallelConfig(ep=2),
    "etp2.dp4": ParallelConfig(etp=2),
    "cp2.dp2": ParallelConfig(cp=2),
    "dp4": ParallelConfig(),
    "tp2xep2.dp2": ParallelConfig(tp=2, ep=2),
    "pp2xtp2": ParallelConfig(pp=2, tp=2),
    "pp2xep2.dp2.gpipe": ParallelConfig(pp=2, ep=2),
}


def _deep(config):
    """4 layers, for the interleaved schedule (pp2 x 2 virtual stages of one layer each)."""
    return dataclasses.replace(config, model=config.model.with_(num_layers=4))


def _layouts() -> dict:
    out = {}
    pc = ParallelConfig(pp=2)
    losses, params, trainer = run(_deep(tiny_config(pc, num_layers_per_virtual_pipeline_stage=1)),
                                  ParallelDims.build(pc))
    out["interleaved"] = (losses, params, trainer.optimizer.state_bytes(), trainer.overlapped_buckets)
    for name, pc in LAYOUTS.items():
        dims = ParallelDims.build(pc)
        kw = {"pipeline_schedule": "gpipe"} if name.endswith("gpipe") else {}
        losses, params, trainer = run(tiny_config(pc, **kw), dims)
        out[name] = (losses, params, trainer.optimizer.state_bytes(), trainer.overlapped_buckets)
    return out


def test_layouts_match_world_1():
    ref_losses, ref_params, ref_trainer = run(tiny_config())
    deep_losses, deep_params, _ = run(_deep(tiny_config()))
    results = run_distributed(_layouts, 4, timeout=400)
    for name in [*LAYOUTS, "interleaved"]:
        if name == "interleaved":
            ref_losses, ref_params = deep_losses, deep_params
        losses = results[0][name][0]
        params = {}
        for rank_result in results:   # pipeline stages hold different parameters
            params.update(rank_result[name][1])
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), atol=TOL, rtol=0), (name, losses,
                                                                                                 ref_losses)
        assert params.keys() == ref_params.keys()
        worst = 0.0
        for k, v in ref_params.items():
            err = (params[k] - v).abs().max().item()
            worst = max(worst, err)
            assert err <= TOL, f"{name}: {k} differs by {err}"
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        print(f"{name}: max loss diff {loss_diff:.2e}, max weight diff {worst:.2e}")
    # ZeRO-1: optimizer state per rank falls ~1/dp (dp4 vs world 1)
    full = ref_trainer.optimizer.state_bytes()
    dp4 = results[0]["dp4"][2]
    print(f"optimizer state bytes per rank: world 1 {full}, dp4 {dp4} ({dp4 / full:.3f} of world 1)")
    assert dp4 <= full / 4 + 4096
    assert results[0]["dp4"][3] > 0   # some bucket all-reduces started during the backward (overlap)
