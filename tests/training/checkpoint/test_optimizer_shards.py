"""Sharded optimizer checkpoints: each rank writes and reads only the optimizer state it owns.

- The box decomposition of a flat range covers exactly that range (any shape, any range).
- dp4: save and load allocate nothing larger than one parameter (no rank gathers a group's state), and a
  resume at dp4 is bit-identical to the uninterrupted dp4 run.
- Across layouts: dp4 (steps 1-2) -> ep2 x dp2 in a 2-rank world (steps 3-4) -> world 1 (step 5) gives the
  uninterrupted world-1 losses and weights.
- Precision changes on resume: a bf16 run's fp32 masters become an fp32 run's parameters exactly, and an fp32
  run's parameters become a bf16 run's masters exactly.
"""

from __future__ import annotations

import math
import random

import torch

from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import named_full_params
from moefold.training.observe.memory import TensorMemoryTracker
from moefold.training.optim.state_shards import flat_range_boxes
from moefold.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.training.trainer_common import fit_results, run, tiny_config, tiny_data

TOL = 1e-4   # across layouts (fp32); the same layout must be bit-identical


def test_flat_range_boxes_cover_exactly_the_range():
    rng = random.Random(0)
    for _ in range(300):
        shape = [rng.randint(1, 5) for _ in range(rng.randint(0, 4))]
        n = math.prod(shape)
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        index = torch.arange(n).view(shape)
        covered = []
        for offsets, sizes, start in flat_range_boxes(shape, lo, hi):
            box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
            assert box.tolist() == list(range(start, start + box.numel())), (shape, lo, hi)   # contiguous
            covered += box.tolist()
        assert covered == list(range(lo, hi)), (shape, lo, hi)
        assert len(flat_range_boxes(shape, lo, hi)) <= max(1, 2 * len(shape) - 1)


def _dp4(save: str, chain: str) -> dict:
    dims = ParallelDims.build(ParallelConfig())
    data = tiny_data()
    trainer = Trainer(tiny_config(), dims, log=lambda _m: None)   # 5 steps planned (the lr schedule), 4 run
    uninterrupted = [r.loss_lm for r in fit_results(trainer, data, stop_at=4)]
    full_params = named_full_params(trainer.model)
    largest_param = max(p.numel() * p.element_size() for p in trainer.model.parameters())
    own_state = trainer.optimizer.state_bytes()

    first = Trainer(tiny_config(), dims, log=lambda _m: None)
    losses = [r.loss_lm for r in fit_results(first, data, stop_at=2)]
    with TensorMemoryTracker() as saving:
        first.save(save)
    first.save(chain)   # (the same state, for the next layout)
    second = Trainer(tiny_config(), dims, log=lambda _m: None)
    with TensorMemoryTracker() as loading:
        second.load(save)
    losses += [r.loss_lm for r in fit_results(second, data, stop_at=4)]
    resumed = named_full_params(second.model)
    return {"bitwise": losses == uninterrupted and all(torch.equal(resumed[k], v) for k, v in full_params.items()),
            "largest_param": largest_param, "own_state": own_state, "save": (saving.largest, saving.peak),
            "load": (loading.largest, loading.peak)}


def _ep2(load: str, save: str) -> list[float]:
    pc = ParallelConfig(ep=2)
    losses, _, _ = run(tiny_config(pc, save=save), ParallelDims.build(pc), load=load, stop_at=4)
    return losses


def test_sharded_save_load_and_resume_across_layouts(tmp_path):
    ref_losses, ref_params, ref_trainer = run(tiny_config())
    full_state = ref_trainer.optimizer.state_bytes()
    dp4 = run_distributed(_dp4, 4, str(tmp_path / "dp4"), str(tmp_path / "chain"), timeout=300)
    for r in dp4:
        print(f"dp4 rank: own optimizer state {r['own_state']} B of {full_state} B at world 1; save: largest new "
              f"tensor {r['save'][0]} B, peak {r['save'][1]} B; load: largest {r['load'][0]} B, peak {r['load'][1]} B; "
              f"largest parameter {r['largest_param']} B")
        assert r["bitwise"], "a dp4 resume must be bit-identical to the uninterrupted dp4 run"
        # nothing larger than one parameter is allocated: no rank gathers a group's (or the model's) state
        assert r["save"][0] <= r["largest_param"] and r["load"][0] <= r["largest_param"], r
        # and at most this rank's own shard plus one parameter is alive at once (the old gather: 3x the model)
        assert r["save"][1] <= r["own_state"] + r["largest_param"] and r["load"][1] <= r["own_state"], r
        assert r["own_state"] <= full_state / 4 + 4096
    ep2 = run_distributed(_ep2, 2, str(tmp_path / "chain"), str(tmp_path / "ep2"), timeout=300)[0]
    last, params, _ = run(tiny_config(), load=str(tmp_path / "ep2"))
    assert len(ep2) == 2 and len(last) == 1
    diff = max(abs(a - b) for a, b in zip(ep2 + last, ref_losses[2:]))
    assert diff <= TOL, (ep2 + last, ref_losses[2:])
    worst = max((params[k] - v).abs().max().item() for k, v in ref_params.items())
    assert worst <= TOL, worst


def test_resume_with_another_precision_keeps_the_master_values(tmp_path):
    bf16_dir, fp32_dir = str(tmp_path / "bf16"), str(tmp_path / "fp32")
    small = dict(steps=2, recipe="qwen3_moe_tiny", micro_batch_size=4, global_batch_size=4)
    _, _, bf16 = run(tiny_config(**small, bf16=True, save=bf16_dir))
    masters = {p.name: p.of(s.master).clone() for s in bf16.optimizer.slices for p in s.pieces if s.separate_master}
    fp32 = Trainer(tiny_config(**small), ParallelDims.single(), log=lambda _m: None)
    fp32.load(bf16_dir)
    got = {p.name: p.of(s.master) for s in fp32.optimizer.slices for p in s.pieces}
    assert masters and all(torch.equal(got[n], v) for n, v in masters.items())

    _, _, fp32_run = run(tiny_config(**small, save=fp32_dir))
    values = {p.name: p.of(s.master).clone() for s in fp32_run.optimizer.slices for p in s.pieces}
    bf16 = Trainer(tiny_config(**small, bf16=True), ParallelDims.single(), log=lambda _m: None)
    bf16.load(fp32_dir)
    for s in bf16.optimizer.slices:
        for p in s.pieces:
            assert torch.equal(p.of(s.master).float(), values[p.name]), p.name
            if s.separate_master:
                assert torch.equal(p.of(s.param), values[p.name].to(torch.bfloat16)), p.name
