"""ZeRO-1 DistributedAdamW equals torch.optim.AdamW on the gathered full parameters; its gradient norm
counts every element once; its memory falls with the group size; LR schedules."""

from __future__ import annotations

import zlib

import pytest
import torch

from moefold.models.decoder import MoEDecoder
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import full_shape, local_slice, shards_of
from moefold.training.grad_sync import GradSync
from moefold.training.lr_schedule import LRSchedule
from moefold.training.optimizer import DistributedAdamW, decays
from moefold.training.trainer import named_full_params
from tests.distributed import run_distributed

TOL = 1e-6


def _compare(layouts: list[ParallelConfig]) -> list[tuple[float, float]]:
    out = []
    for pc in layouts:
        dims = ParallelDims.build(pc)
        model = MoEDecoder(get_recipe("deepseek_v3_tiny").with_(num_layers=2, vocab_size=256), dims)
        model.init_weights(3)
        sync = GradSync(model.named_parameters(), dims)
        opt = DistributedAdamW(sync, dims, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        ref = {n: p.clone().requires_grad_(True) for n, p in named_full_params(model).items()}
        groups = [{"params": [p for n, p in ref.items() if decays(n, p)], "weight_decay": 0.1},
                  {"params": [p for n, p in ref.items() if not decays(n, p)], "weight_decay": 0.0}]
        ref_opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
        params = dict(model.named_parameters())
        for step in range(3):
            full_grads = {}
            for name, p in params.items():
                gen = torch.Generator().manual_seed(step * 7919 + zlib.crc32(name.encode()))
                full_grads[name] = torch.randn(full_shape(p), generator=gen)
                p.main_grad.copy_(local_slice(full_grads[name], shards_of(p)))   # the reduced gradient
            norm = float(opt.grad_norm())
            ref_norm = float(torch.sqrt(sum(g.double().square().sum() for g in full_grads.values())))
            assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (pc, norm, ref_norm)
            lr, coef = 1e-2 * (step + 1), 0.5
            opt.step(lr, coef)
            for group in ref_opt.param_groups:
                group["lr"] = lr
            for name, p in ref.items():
                p.grad = full_grads[name] * coef
            ref_opt.step()
        got = named_full_params(model)
        worst = max((got[n] - p.detach()).abs().max().item() for n, p in ref.items())
        assert worst <= TOL, (pc, worst)
        out.append((worst, opt.state_bytes()))
    return out


def test_distributed_adamw_equals_torch_adamw():
    # one world for every layout; the last one (dp4) measures the ZeRO-1 memory saving
    layouts = [ParallelConfig(tp=2, ep=2), ParallelConfig(etp=2, ep=2), ParallelConfig(cp=2, tp=2), ParallelConfig()]
    results = run_distributed(_compare, 4, layouts, timeout=300)
    assert len(results) == 4 and all(len(r) == len(layouts) for r in results)
    single = _compare([ParallelConfig()])[0][1]
    dp4 = results[0][-1][1]
    print(f"optimizer state per rank: world 1 {single} B, dp4 {dp4} B")
    assert dp4 <= single / 4 + 1024


def test_lr_schedules():
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=2, decay_iters=12, style="cosine")
    assert [s(0), s(1)] == [0.5, 1.0]
    assert s(2) == pytest.approx(1.0) and s(7) == pytest.approx(0.55) and s(12) == pytest.approx(0.1)
    lin = LRSchedule(lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=10, style="linear")
    assert lin(5) == pytest.approx(0.5)
    wsd = LRSchedule(lr=1.0, min_lr=0.0, warmup_iters=2, decay_iters=12, style="WSD", wsd_decay_iters=4)
    assert [wsd(i) for i in (2, 7)] == [1.0, 1.0] and wsd(8) == pytest.approx(0.75) and wsd(11) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="lr decay style 'cos'"):
        LRSchedule(lr=1.0, style="cos")
