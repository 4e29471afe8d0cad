"""The same tiny 5-step fp32 run at world 1 and at tp2, ep2, etp2, cp2, dp, tp2 x ep2 (ZeRO-1 everywhere):
same losses and same final weights, to TOL."""

from __future__ import annotations

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
}


def _layouts() -> dict:
    out = {}
    for name, pc in LAYOUTS.items():
        dims = ParallelDims.build(pc)
        losses, params, trainer = run(tiny_config(pc), dims)
        out[name] = (losses, params if dims.rank == 0 else None, trainer.optimizer.state_bytes())
    return out


def test_layouts_match_world_1():
    ref_losses, ref_params, ref_trainer = run(tiny_config())
    results = run_distributed(_layouts, 4, timeout=400)
    for name in LAYOUTS:
        losses, params, _ = results[0][name]
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), atol=TOL, rtol=0), (name, losses,
                                                                                                 ref_losses)
        assert params.keys() == ref_params.keys()
        worst = 0.0
        for k, v in ref_params.items():
            err = (params[k] - v).abs().max().item()
            worst = max(worst, err)
            assert err <= TOL, f"{name}: {k} differs by {err}"
        print(f"{name}: max loss diff {max(abs(a - b) for a, b in zip(losses, ref_losses)):.2e}, max weight diff {worst:.2e}")
    # ZeRO-1: optimizer state per rank falls ~1/dp (dp4 vs world 1)
    full = ref_trainer.optimizer.state_bytes()
    dp4 = results[0]["dp4"][2]
    print(f"optimizer state bytes per rank: world 1 {full}, dp4 {dp4} ({dp4 / full:.3f} of world 1)")
    assert dp4 <= full / 4 + 4096
