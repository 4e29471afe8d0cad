"""The executor runs the split-backward and overlap schedules: zb-h1, zbv, dualpipev (V placement, the local
turn, I / W / FB actions) and interleaved 1F1B with FB pairs. Loss and every gradient equal the unsplit model's
(fp32, 1e-5); each rank's peak of held activations is the simulator's. One 4-rank gloo world: a pp4 pipeline and
two pp2 pipelines running different schedules at once. The toy stage has no ``forward_backward_step``, so FB runs
as F then B here (the overlapped step is tested with the decoder, tests/pipeline/test_overlap.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moefold.dense.split_backward import WeightGradStore
from moefold.execution.split_backward import install_weight_grad_store
from moefold.parallel import ParallelConfig, ParallelDims
from moefold.parallel.groups import group_rank
from moefold.pipeline.executor import run_schedule
from moefold.pipeline.schedules import build_schedule
from moefold.pipeline.simulator import simulate
from moefold.pipeline.stages import StageLayout
from tests.distributed import run_distributed
from tests.pipeline import toy
from tests.pipeline.test_executor import SPEC

# name -> (pp, schedule, vpp, microbatches, overlap)
PP4 = {"pp4-zb-h1": (4, "zb-h1", 1, 8, False), "pp4-zbv": (4, "zbv", 2, 8, False),
       "pp4-dualpipev": (4, "dualpipev", 2, 8, False), "pp4-interleaved-overlap": (4, "interleaved", 2, 8, True)}
PP2 = [{"pp2-zb-h1-m3": (2, "zb-h1", 1, 3, False), "pp2-dualpipev": (2, "dualpipev", 2, 4, False)},
       {"pp2-zbv-m3": (2, "zbv", 2, 3, False), "pp2-interleaved-overlap": (2, "interleaved", 2, 4, True)}]
CONFIGS = {**PP4, **PP2[0], **PP2[1]}


def _run(config: tuple, group) -> dict:
    pp, name, vpp, m, overlap = config
    rank = group_rank(group)
    schedule = build_schedule(name, pp, m, vpp, overlap=overlap)
    model = toy.ToyStage(StageLayout(toy.NUM_LAYERS, pp, vpp, placement=schedule.placement), rank)
    store = WeightGradStore()
    install_weight_grad_store(model, store)
    result = run_schedule(model, schedule, toy.microbatches(m), toy.loss_fn, group, SPEC, weight_store=store)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    kinds = sorted({a.kind for a in schedule.rank_actions(rank) if a.is_compute})
    return {"pp_rank": rank, "grads": grads, "losses": result.losses, "peak": result.peak_in_flight,
            "kinds": kinds, "has_head": model.head is not None}


def _world() -> dict:
    dims4 = ParallelDims.build(ParallelConfig(pp=4))
    dims2 = ParallelDims.build(ParallelConfig(pp=2))
    out = {key: _run(config, dims4.pp_group) for key, config in PP4.items()}
    for key, config in PP2[dist.get_rank() % 2].items():
        out[key] = _run(config, dims2.pp_group)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_distributed(_world, 4, timeout=240)


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_loss_grads_and_memory_equal_reference_and_simulator(world, key):
    pp, name, vpp, m, overlap = CONFIGS[key]
    ref_losses, ref_grads = toy.reference(m)
    ranks = [res[key] for res in world if key in res]
    assert sorted(r["pp_rank"] for r in ranks) == list(range(pp))
    grads = {}
    for r in ranks:
        assert not set(grads) & set(r["grads"]), "a parameter held by two stages"
        grads.update(r["grads"])
    assert sorted(grads) == sorted(ref_grads)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=0, atol=1e-5, msg=f"{key}: grad of {n}")
    (holder,) = [r for r in ranks if r["has_head"]]
    assert holder["pp_rank"] == (0 if name in ("zbv", "dualpipev") else pp - 1)   # the V ends where it began
    torch.testing.assert_close(torch.stack(holder["losses"]), torch.stack(ref_losses), rtol=0, atol=1e-5)
    sim = simulate(build_schedule(name, pp, m, vpp, overlap=overlap))
    assert tuple(r["peak"] for r in sorted(ranks, key=lambda r: r["pp_rank"])) == sim.peak_in_flight
    wanted = {"zb-h1": {"F", "I", "W"}, "zbv": {"F", "I", "W"}, "dualpipev": {"F", "B", "I", "W", "FB"},
              "interleaved": {"F", "B", "FB"}}[name]
    assert set().union(*(r["kinds"] for r in ranks)) == wanted


def test_split_schedules_need_the_weight_store():
    model = toy.ToyStage(StageLayout(toy.NUM_LAYERS), 0)
    with pytest.raises(ValueError, match="splits backwards into I and W: pass the model's WeightGradStore"):
        run_schedule(model, build_schedule("zb-h1", 1, 2), toy.microbatches(2), toy.loss_fn, None, SPEC)


def test_world1_zb_h1_and_overlap_equal_plain_loop():
    ref_losses, ref_grads = toy.reference(4)
    for name, overlap in (("zb-h1", False), ("1f1b", True)):
        model = toy.ToyStage(StageLayout(toy.NUM_LAYERS), 0)
        store = WeightGradStore()
        install_weight_grad_store(model, store)
        res = run_schedule(model, build_schedule(name, 1, 4, overlap=overlap), toy.microbatches(4), toy.loss_fn,
                           None, SPEC, weight_store=store)
        torch.testing.assert_close(torch.stack(res.losses), torch.stack(ref_losses), rtol=0, atol=1e-6)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=0, atol=1e-6)
